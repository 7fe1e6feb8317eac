"""mmcache: exact cross-request reuse of prefix KV pages and encoder outputs.

Public API: ``Fingerprint``, ``page_names``, ``PagePool``, ``PrefixCache``, ``RequestState``, ``ShadowIndex``,
``EncoderStore``, ``EncoderKey``, and the errors in ``mmcache.errors`` (``OutOfPages`` re-exported here).
"""

from .encoder_key import EncoderKey
from .encoder_store import EncoderPin, EncoderStore
from .errors import OutOfPages
from .names import Fingerprint, page_names
from .pool import PagePool
from .prefix_cache import PrefixCache, RequestState
from .shadow import ShadowIndex, ShadowMatch

__all__ = ["EncoderKey", "EncoderPin", "EncoderStore", "Fingerprint", "OutOfPages", "PagePool", "PrefixCache", "RequestState", "ShadowIndex", "ShadowMatch",
           "page_names"]
