"""mmcache: exact cross-request reuse of prefix KV pages and encoder outputs.

Public API: ``Fingerprint``, ``page_names``, ``PagePool``, ``PrefixCache``, ``RequestState``, ``ShadowIndex``,
``EncoderStore``, ``EncoderKey``, ``PagedAllocator`` (an engine's per-label allocator) with ``HostPagePool``, and the
errors in ``mmcache.errors`` (``OutOfPages`` re-exported here).
"""

from .encoder_key import EncoderKey
from .encoder_store import EncoderPin, EncoderStore
from .engine_allocator import PagedAllocator, Reloaded
from .errors import AllocationFailed, OutOfPages
from .host_pool import HostPagePool
from .names import Fingerprint, page_names
from .pool import PagePool
from .prefix_cache import PrefixCache, RequestState
from .shadow import ShadowIndex, ShadowMatch

__all__ = ["AllocationFailed", "HostPagePool", "PagedAllocator", "Reloaded", "EncoderKey", "EncoderPin", "EncoderStore", "Fingerprint", "OutOfPages", "PagePool", "PrefixCache", "RequestState", "ShadowIndex", "ShadowMatch",
           "page_names"]
