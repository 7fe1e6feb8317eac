"""Replica affinity (RFC phase 3b): pick a data-parallel replica from a request's prefix, with no cache state.

``affinity_key(names)`` is the page name of the request's ``key_pages``-th full page (or its last, if shorter):
a chain name commits to every token before it, so two requests get the same key exactly when their first
``key_pages`` pages are equal. ``AffinityRouter.choose`` ranks the replicas by rendezvous (highest random weight)
hashing of that key: every router computes the same ranking with no shared state, and a replica joining or leaving
moves only the keys whose top choice it is or was. The top replica is taken while its queue is below ``threshold``;
past it, or for a prompt with no full page, the choice is today's uniform random one.

Nothing here holds cache contents, so nothing it holds can go stale; the load it reads is the caller's live count.
The core imports no engine: the M* conductor adapter is ``mmcache.mstar.conductor``.
"""

from __future__ import annotations

import random
from typing import Hashable, Sequence

import xxhash

from mmcache.errors import InvalidRequest

DEFAULT_KEY_PAGES = 1
DEFAULT_THRESHOLD = 16


def affinity_key(names: Sequence[int], key_pages: int = DEFAULT_KEY_PAGES) -> int | None:
    """The chain name that stands for the request's first ``key_pages`` pages; None when it has no full page."""
    if key_pages < 1:
        raise InvalidRequest(f"key_pages must be >= 1, got {key_pages}")
    if not len(names):
        return None
    return int(names[min(key_pages, len(names)) - 1])


def _replica_seed(replica: Hashable) -> int:
    return xxhash.xxh64_intdigest(repr(replica).encode())


def rendezvous_order(key: int, replicas: Sequence[Hashable]) -> list[int]:
    """Indices into ``replicas``, best first, by the weight ``xxh64(key, seed=xxh64(repr(replica)))``.

    The weight of a (key, replica) pair depends on nothing else, so removing a replica changes the top choice only of
    the keys it topped, and adding one takes only the keys it now tops (about 1/R of them)."""
    kb = int(key).to_bytes(8, "little")
    weights = [xxhash.xxh64_intdigest(kb, seed=_replica_seed(r)) for r in replicas]
    return sorted(range(len(replicas)), key=lambda i: (-weights[i], i))


class AffinityRouter:
    """Rendezvous-hash affinity below a queue threshold, today's random choice above it.

    ``replicas``: stable identifiers (e.g. each replica's worker ranks); the ranking depends on them, not on their
    order. ``threshold``: the preferred replica is taken while its queue (live requests) is below this.
    ``rng``: the random fallback's generator (``random.Random``), seedable for replays.
    """

    def __init__(self, replicas: Sequence[Hashable], threshold: int = DEFAULT_THRESHOLD,
                 key_pages: int = DEFAULT_KEY_PAGES, rng: random.Random | None = None):
        if not len(replicas):
            raise InvalidRequest("a router needs at least one replica")
        if threshold < 1:
            raise InvalidRequest(f"threshold must be >= 1, got {threshold}")
        if key_pages < 1:
            raise InvalidRequest(f"key_pages must be >= 1, got {key_pages}")
        self.replicas = list(replicas)
        self.threshold = int(threshold)
        self.key_pages = int(key_pages)
        self.rng = rng or random.Random()
        self.preferred = self.fallbacks = 0  # how many choices went each way

    def choose(self, names: Sequence[int], loads: Sequence[int]) -> int:
        """The index of the replica for a request whose page names are ``names``, given each replica's queue."""
        if len(loads) != len(self.replicas):
            raise InvalidRequest(f"{len(loads)} loads for {len(self.replicas)} replicas")
        key = affinity_key(names, self.key_pages)
        if key is not None:
            top = rendezvous_order(key, self.replicas)[0]
            if loads[top] < self.threshold:
                self.preferred += 1
                return top
        self.fallbacks += 1
        return self.rng.randrange(len(self.replicas))
