"""mmcache: exact cross-request reuse of prefix KV pages and encoder outputs.

Public API: ``Fingerprint``, ``page_names``, ``PagePool``, ``PrefixCache`` (live requests over a ``PrefixIndex``),
``RequestState``, ``PrefixLifecycle`` (the one prefix lifecycle every request table drives, with the ``LowerTier`` and
``GroupAgreement`` interfaces it declares), ``ShadowIndex``, ``EncoderStore``, ``EncoderKey``, ``HostPagePool``, the
typed ``stats()`` snapshots in ``mmcache.stats``, and the errors in ``mmcache.errors`` (``OutOfPages`` re-exported
here). Beside them, imported on their own: ``mmcache.reclaim`` (what a pool evicts, across every cache on it),
``mmcache.tiers`` (host tier and shared store under the device pool), ``mmcache.routing`` (replica affinity) and
``mmcache.tp`` (tensor-parallel agreement); adapters the core never imports: ``mmcache.hf`` (transformers) and
``mmcache.mstar`` (the M* engine).
"""

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_pin import EncoderPin, Lookup
from mmcache.encoder_store import EncoderStore
from mmcache.errors import AllocationFailed, OutOfPages
from mmcache.lifecycle import GroupAgreement, LowerTier, PrefixLifecycle
from mmcache.names import Fingerprint, page_names
from mmcache.pool import HostPagePool, PagePool
from mmcache.prefix_cache import PrefixCache, RequestState
from mmcache.prefix_index import PrefixIndex
from mmcache.shadow import ShadowIndex, ShadowMatch

__all__ = ["AllocationFailed", "EncoderKey", "EncoderPin", "EncoderStore", "Fingerprint", "GroupAgreement",
           "HostPagePool", "Lookup", "LowerTier", "OutOfPages", "PagePool", "PrefixCache", "PrefixIndex",
           "PrefixLifecycle", "RequestState", "ShadowIndex", "ShadowMatch", "page_names"]
