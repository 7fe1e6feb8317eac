"""mmcache inside M*: a drop-in ``PagedAllocationManager`` with prefix reuse (``PrefixPagedAllocationManager``).

Importing this package imports M* (``mmcache.mstar.vendor.import_mstar``); the core (``mmcache``) never imports it.
"""

from mmcache.mstar.vendor import import_mstar

import_mstar()

from mmcache.mstar.allocator import (  # noqa: E402
    CountedPageAllocator, PrefixPagedAllocationManager, PrefixReuse, install,
)

__all__ = ["CountedPageAllocator", "PrefixPagedAllocationManager", "PrefixReuse", "install"]
