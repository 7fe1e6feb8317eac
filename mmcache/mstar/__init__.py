"""mmcache inside M*: a drop-in ``PagedAllocationManager`` with prefix reuse (``allocator``) whose page allocation M*'s
cache managers batch per plan (``cache_manager``, set up by ``install``), cached encoder nodes
(``encoder_node``, keyed by ``encoder_items``, with digests taken in the data worker by ``media_digests`` and counters
exported by ``encoder_metrics``), and replica affinity in M*'s conductor (``conductor``).

M* is found through ``vendor`` (``$MMCACHE_MSTAR`` or ``../shared/vendor/mstar``): importing this package puts it on
``sys.path`` when it is found and does not fail when it is not, so ``mmcache.mstar.vendor.mstar_root()`` can tell
callers (and tests, which then skip) whether it is there; the names below import M* on first access. The core
(``mmcache``) never imports this package.
"""

import importlib

from mmcache.mstar.vendor import import_mstar

try:
    import_mstar()
except ImportError:  # not found: the modules that need M* raise when imported
    pass

_EXPORTS = {"CountedPageAllocator": "allocator", "PrefixPagedAllocationManager": "allocator",
            "PrefixReuse": "allocator", "install": "allocator", "BatchedAllocPlanning": "cache_manager",
            "use_batched_planning": "cache_manager", "AffinityConductor": "conductor",
            "CachedEncoderNode": "encoder_node", "cache_encoder_nodes": "encoder_node",
            "install_digests": "media_digests", "route_digests": "media_digests", "store_oracle": "decode_skip",
            "EncoderNodeCollector": "encoder_metrics"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
