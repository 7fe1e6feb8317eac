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

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# name -> the module that defines it. Imported on first use (PEP 562), so ``import mmcache.errors`` and the other
# torch-free modules stay light: the command line checks every flag before torch is imported.
_EXPORTS = {
    "EncoderKey": "mmcache.encoder_key",
    "EncoderPin": "mmcache.encoder_pin", "Lookup": "mmcache.encoder_pin", "EncoderStore": "mmcache.encoder_store",
    "AllocationFailed": "mmcache.errors", "OutOfPages": "mmcache.errors",
    "Fingerprint": "mmcache.names", "page_names": "mmcache.names",
    "GroupAgreement": "mmcache.lifecycle", "LowerTier": "mmcache.lifecycle", "PrefixLifecycle": "mmcache.lifecycle",
    "HostPagePool": "mmcache.pool", "PagePool": "mmcache.pool",
    "PrefixCache": "mmcache.prefix_cache", "RequestState": "mmcache.prefix_cache",
    "PrefixIndex": "mmcache.prefix_index",
    "ShadowIndex": "mmcache.shadow", "ShadowMatch": "mmcache.shadow",
}
__all__ = ["AllocationFailed", "EncoderKey", "EncoderPin", "EncoderStore", "Fingerprint", "GroupAgreement",
           "HostPagePool", "Lookup", "LowerTier", "OutOfPages", "PagePool", "PrefixCache", "PrefixIndex",
           "PrefixLifecycle", "RequestState", "ShadowIndex", "ShadowMatch", "page_names"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
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
