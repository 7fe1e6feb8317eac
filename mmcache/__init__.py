"""mmcache: exact cross-request reuse of prefix KV pages and encoder outputs.

Public API: ``Fingerprint``, ``page_names``, ``PagePool``, ``PrefixCache``, ``RequestState``, ``ShadowIndex``, and the
errors in ``mmcache.errors`` (``OutOfPages`` re-exported here).
"""

from .errors import OutOfPages
from .names import Fingerprint, page_names
from .pool import PagePool
from .prefix_cache import PrefixCache, RequestState
from .shadow import ShadowIndex, ShadowMatch

__all__ = ["Fingerprint", "OutOfPages", "PagePool", "PrefixCache", "RequestState", "ShadowIndex", "ShadowMatch",
           "page_names"]
