"""Replica affinity in M*'s conductor, from outside M*'s code (RFC phase 3b).

M*'s ``Conductor._assign_worker_graphs_to_workers`` picks each node group's data-parallel replica with
``np.random.randint``. ``AffinityConductor`` overrides that one method: the replica of each group comes from an
``AffinityRouter`` over the request's page names, below a queue threshold, and from the same ``np.random.randint``
above it. The queue of a replica is the number of the conductor's live requests (``self.requests``) assigned to it,
so the router keeps no state of its own.

The conductor sees no token ids (the data worker tokenizes and sends tensors), so the page names travel with the
request: ``route_names(body)`` reads ``body.model_kwargs["mmcache_route_names"]`` by default (the API side computes
them with ``mmcache.page_names``; a list of ints). Override ``route_names`` in a subclass to derive them otherwise.
A request without names is placed as today.

Routing by media (``key = "media"``, see ``mmcache.routing``): ``route_media(body)`` reads the request's media
digests from ``body.model_kwargs["mmcache_route_media"]``, which ``mmcache.mstar.media_digests.install_digests``
fills in the data worker with the digests it carries (16 bytes each, file order), so nothing on the API side
changes; the tenant salt from ``model_kwargs["mmcache_salt"]`` (``mmcache.mstar.salts``) is folded into the key. A
request without them falls back to its names.

Importing this module imports M* (checked by ``mmcache.mstar.requirement``; M*'s own dependencies: ``pip install
'mmcache[mstar]'``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from mmcache.mstar.media_digests import ROUTE_MEDIA_KWARG
from mmcache.mstar.requirement import require_mstar
from mmcache.mstar.salts import request_salt
from mmcache.routing import DEFAULT_KEY_PAGES, DEFAULT_THRESHOLD, AffinityRouter

require_mstar()
from mstar.conductor.conductor import Conductor  # noqa: E402

ROUTE_NAMES_KWARG = "mmcache_route_names"


class _NumpyRandom:
    """``randrange`` through ``np.random.randint``: the fallback is exactly M*'s own choice."""

    @staticmethod
    def randrange(n: int) -> int:
        return int(np.random.randint(n))


def replica_units(wg) -> list[list[int]]:
    """The worker ranks of each replica of worker graph ``wg``, as the conductor indexes them."""
    return wg._instance_ranks if wg._instance_ranks else [[r] for r in wg.ranks]


def assign_worker_graphs(worker_graphs: Mapping, pick: Callable[[object], int]) -> dict[str, list[str]]:
    """M*'s assignment with the replica choice made by ``pick(wg) -> replica index``, called once per node group
    (``_group_id``) so every worker graph of a group lands on the same replica, as M*'s own method does. With a
    ``pick`` that falls back to ``np.random.randint``, the assignment and the random stream are M*'s own."""
    chosen: dict[int, int] = {}
    result = {}
    for wg_id, wg in worker_graphs.items():
        if wg._group_id not in chosen:
            chosen[wg._group_id] = pick(wg)
        else:  # M*'s ``setdefault(group, np.random.randint(n))`` draws for every worker graph: keep its stream
            np.random.randint(len(replica_units(wg)))
        result[wg_id] = [f"worker_{r}" for r in replica_units(wg)[chosen[wg._group_id]]]
    return result


def replica_loads(requests: Mapping, wg) -> list[int]:
    """Live requests per replica of ``wg``'s group, read from the conductor's request table."""
    index = {tuple(f"worker_{r}" for r in unit): i for i, unit in enumerate(replica_units(wg))}
    loads = [0] * len(index)
    for req in requests.values():
        i = index.get(tuple(req.worker_graph_to_workers.get(wg.worker_graph_id, ())))
        if i is not None:
            loads[i] += 1
    return loads


class AffinityConductor(Conductor):
    """M*'s conductor with prefix (``key = "text"``) or media (``key = "media"``) affinity below ``threshold`` live
    requests per replica (see the module doc)."""

    threshold: int = DEFAULT_THRESHOLD
    key_pages: int = DEFAULT_KEY_PAGES
    key: str = "text"

    def route_names(self, body) -> Sequence[int]:
        """The request's page names (empty: no affinity, today's choice)."""
        return list((body.model_kwargs or {}).get(ROUTE_NAMES_KWARG, ()))

    def route_media(self, body) -> Sequence[bytes]:
        """The request's media digests in prompt order (empty: route by its names)."""
        return list((body.model_kwargs or {}).get(ROUTE_MEDIA_KWARG, ()))

    def _routers(self) -> dict[int, AffinityRouter]:
        routers = self.__dict__.setdefault("_mmcache_routers", {})
        for wg in self.worker_graphs.values():
            if wg._group_id not in routers:
                units = [tuple(u) for u in replica_units(wg)]
                routers[wg._group_id] = AffinityRouter(units, self.threshold, self.key_pages, _NumpyRandom(),
                                                       key=self.key)
        return routers

    def _do_ingest_request(self, body):
        self._mmcache_body = body
        try:
            return super()._do_ingest_request(body)
        finally:
            self._mmcache_body = None

    def _assign_worker_graphs_to_workers(self) -> dict[str, list[str]]:
        body = getattr(self, "_mmcache_body", None)
        names = self.route_names(body) if body is not None else []
        media = self.route_media(body) if body is not None else []
        salt = request_salt(body.model_kwargs, "model_kwargs") if body is not None else b""
        routers = self._routers()
        return assign_worker_graphs(self.worker_graphs, lambda wg: routers[wg._group_id].choose(
            names, replica_loads(self.requests, wg), media, salt))
