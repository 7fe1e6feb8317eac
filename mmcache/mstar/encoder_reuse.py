"""One call that turns encoder-output reuse on for an M* 0.2.1 model: ``enable_encoder_reuse(model)``.

M* builds the same ``Model`` object in every process it starts (the conductor, the data worker, each worker's engine
manager, which asks it for the node submodules with ``model.get_submodule``). Called on that instance, from outside
M*'s code, it:

- wraps every encoder node ``get_submodule`` returns that ``encoder_items.items_for`` knows in a ``CachedEncoderNode``
  (one per node, made once; other nodes come back unchanged), with a store of its own per node unless
  ``store_for(node_name, submodule)`` gives one (e.g. one on the node's KV pool), and the node's fingerprint from
  the caller's ``fingerprint`` or, by default, from the checkpoint folder the model loads from (its ``local_dir``, or
  ``model_path_hf`` in the hub cache ``cache_dir``: ``mmcache.weights_fingerprint``, no weight read);
- routes the request's tenant salt (``salts.route_salt``) and, for Qwen3-Omni, the carried media digests
  (``media_digests.route_digests``) on the conductor's side.

Keys then come from each node's own inputs (exact); ``media_digests.install_digests`` on the data worker is the
optional second step that keys media by the bytes as sent and enables the decode skip.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Callable

from mmcache.checkpoint_files import resolve_folder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidRequest
from mmcache.eviction import DEFAULT_POLICY, check_policy
from mmcache.mstar.encoder_items import items_for
from mmcache.mstar.encoder_node import DEFAULT_CAPACITY, CachedEncoderNode
from mmcache.mstar.media_digests import route_digests
from mmcache.mstar.salts import route_salt


def enable_encoder_reuse(model, *, capacity_bytes: int = DEFAULT_CAPACITY, page_bytes: int = 65536,
                         store_for: Callable[[str, object], EncoderStore | None] | None = None,
                         eviction: str = DEFAULT_POLICY, fingerprint: str | Mapping[str, str] | None = None) -> None:
    """Turn encoder-output reuse on for M* model instance ``model`` (see the module doc). Idempotent; the class and
    M*'s files are untouched. ``capacity_bytes``/``page_bytes`` size each node's own store, and ``eviction`` (a name
    in ``mmcache.eviction.POLICIES``) orders what it evicts; a store from ``store_for`` evicts by its pool's policy.
    ``fingerprint``: what names the weights, from the caller: a string for the whole model (each node's is
    ``"<fingerprint>/<node name>"``) or node name -> string (nodes not named take the default). It must change
    whenever the weights do; the default (None) is taken from the checkpoint files. An unknown ``eviction`` or a
    ``fingerprint`` of another type raises before ``model`` is touched."""
    check_policy(eviction)
    given = _given_fingerprints(fingerprint)
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
                                                       eviction=eviction if store is None else None,
                                                       fingerprint=given(node_name),
                                                       checkpoints=model_folders(model)))
        return wrapped[id(sub)][1]

    model.get_submodule = get_submodule
    route_salt(model)
    if hasattr(model, "_build_thinker_prefill_schedule"):  # Qwen3-Omni: digests travel in the prefill schedule
        route_digests(model)
    model._mmcache_encoder_reuse = True


def model_folders(model) -> list[Path]:
    """The local checkpoint folders M* model ``model`` loads from: its ``local_dir`` (the hub snapshot M*'s models
    resolve at construction) and its ``model_path_hf`` (a folder, or a repo id found in the hub cache ``cache_dir``
    when it holds one snapshot of it); none found, the nodes' fingerprints fall back to their weights' bytes."""
    cache_dir = getattr(model, "cache_dir", None)
    found = []
    for name in (getattr(model, "local_dir", None), getattr(model, "model_path_hf", None)):
        folder = resolve_folder(name, cache_dir) if isinstance(name, str) else None
        if folder is not None and folder not in found:
            found.append(folder)
    return found


def _given_fingerprints(fingerprint) -> Callable[[str], str | None]:
    """Node name -> the caller's fingerprint for it (None: the default); InvalidRequest for a bad ``fingerprint``."""
    if fingerprint is None:
        return lambda node_name: None
    if isinstance(fingerprint, str):
        return lambda node_name: f"{fingerprint}/{node_name}"
    if isinstance(fingerprint, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in fingerprint.items()):
        table = dict(fingerprint)
        return table.get
    raise InvalidRequest(f"fingerprint must be a str or a mapping of node names to str, got "
                         f"{type(fingerprint).__name__}")
