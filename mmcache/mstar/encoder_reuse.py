"""One call that turns encoder-output reuse on for an M* 0.2.1 model: ``enable_encoder_reuse(model)``.

M* builds the same ``Model`` object in every process it starts (the conductor, the data worker, each worker's engine
manager, which asks it for the node submodules with ``model.get_submodule``). Called on that instance, from outside
M*'s code, it:

- wraps every encoder node ``get_submodule`` returns that ``encoder_items.items_for`` knows in a ``CachedEncoderNode``
  (one per node, made once; other nodes come back unchanged), with a store of its own per node unless
  ``store_for(node_name, submodule)`` gives one (e.g. one on the node's KV pool);
- routes the request's tenant salt (``salts.route_salt``) and, for Qwen3-Omni, the carried media digests
  (``media_digests.route_digests``) on the conductor's side.

Keys then come from each node's own inputs (exact); ``media_digests.install_digests`` on the data worker is the
optional second step that keys media by the bytes as sent and enables the decode skip.
"""

from __future__ import annotations

import functools
from typing import Callable

from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidRequest
from mmcache.eviction import DEFAULT_POLICY, check_policy
from mmcache.mstar.encoder_items import items_for
from mmcache.mstar.encoder_node import DEFAULT_CAPACITY, CachedEncoderNode
from mmcache.mstar.media_digests import route_digests
from mmcache.mstar.salts import route_salt


def enable_encoder_reuse(model, *, capacity_bytes: int = DEFAULT_CAPACITY, page_bytes: int = 65536,
                         store_for: Callable[[str, object], EncoderStore | None] | None = None,
                         eviction: str = DEFAULT_POLICY) -> None:
    """Turn encoder-output reuse on for M* model instance ``model`` (see the module doc). Idempotent; the class and
    M*'s files are untouched. ``capacity_bytes``/``page_bytes`` size each node's own store, and ``eviction`` (a name
    in ``mmcache.eviction.POLICIES``) orders what it evicts; a store from ``store_for`` evicts by its pool's policy.
    An unknown ``eviction`` raises ``InvalidConfig`` before ``model`` is touched."""
    check_policy(eviction)
    if getattr(model, "_mmcache_encoder_reuse", False):
        return
    get, wrapped = model.get_submodule, {}

    @functools.wraps(get)
    def get_submodule(node_name, *args, **kwargs):
        sub = get(node_name, *args, **kwargs)
        if sub is None or isinstance(sub, CachedEncoderNode):
            return sub
        if id(sub) not in wrapped:  # models cache their submodules: one wrapper per node
            try:
                items = items_for(sub)
            except InvalidRequest:  # not an encoder mmcache knows (an LLM, a decoder, a sampling VAE)
                return sub
            store = store_for(node_name, sub) if store_for is not None else None
            wrapped[id(sub)] = (sub, CachedEncoderNode(sub, items, store, capacity_bytes=capacity_bytes,
                                                       page_bytes=page_bytes,
                                                       eviction=eviction if store is None else None))
        return wrapped[id(sub)][1]

    model.get_submodule = get_submodule
    route_salt(model)
    if hasattr(model, "_build_thinker_prefill_schedule"):  # Qwen3-Omni: digests travel in the prefill schedule
        route_digests(model)
    model._mmcache_encoder_reuse = True
