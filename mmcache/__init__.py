"""mmcache: exact cross-request reuse of prefix KV pages and encoder outputs.

Public API: ``Fingerprint``, ``page_names``, ``PagePool``, ``PrefixCache`` (live requests over a ``PrefixIndex``),
``RequestState``, ``ShadowIndex``, ``EncoderStore``, ``EncoderKey``, ``PagedAllocator`` (an engine's per-label
allocator) with ``HostPagePool``, the typed ``stats()`` snapshots in ``mmcache.stats``, and the errors in
``mmcache.errors`` (``OutOfPages`` re-exported here).
"""

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_store import EncoderPin, EncoderStore, Lookup
from mmcache.paged_allocator import PagedAllocator, Reloaded
from mmcache.errors import AllocationFailed, OutOfPages
from mmcache.pool import HostPagePool, PagePool
from mmcache.names import Fingerprint, page_names
from mmcache.prefix_cache import PrefixCache, RequestState
from mmcache.prefix_index import PrefixIndex
from mmcache.shadow import ShadowIndex, ShadowMatch

__all__ = ["AllocationFailed", "HostPagePool", "PagedAllocator", "Reloaded", "EncoderKey", "EncoderPin", "EncoderStore", "Lookup", "Fingerprint", "OutOfPages", "PagePool", "PrefixCache", "PrefixIndex", "RequestState", "ShadowIndex", "ShadowMatch",
           "page_names"]
