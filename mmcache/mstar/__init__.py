"""mmcache inside M*: a drop-in ``PagedAllocationManager`` with prefix reuse (``allocator``) and replica affinity in
M*'s conductor (``conductor``).

M* is found through ``vendor`` (``$MMCACHE_MSTAR`` or ``../shared/vendor/mstar``) and imported by the modules that
need it, when they are imported: ``import mmcache.mstar.vendor`` works without M*, so callers can check for it and
skip; the names below import M* on first access. The core (``mmcache``) never imports this package.
"""

import importlib

_EXPORTS = {"CountedPageAllocator": "allocator", "PrefixPagedAllocationManager": "allocator",
            "PrefixReuse": "allocator", "install": "allocator", "AffinityConductor": "conductor"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
