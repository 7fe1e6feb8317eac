"""Tiers below the device pool (RFC phase 4b and beyond): a host-memory tier for evicted pages and a store shared by
instances (Mooncake Store), both verified like the device index.

``TierStack(fingerprint, host=HostTier(...), store=StoreTier(...))`` is the ``LowerTier`` under a pool:
``PrefixCache(..., tiers=...)``, or ``PrefixReuse(tiers=...)`` for M*'s KV resource. ``EncoderTiers(host=
EncoderHostTier(...), store=StoreTier(...))`` is the ``EncoderLowerTier`` under an ``EncoderStore`` (``tiers=...``):
the same ``StoreTier`` may serve both, and the two host tiers may share one ``HostPagePool``. ``HostBudget`` splits
host memory between the tier and preemption offload. ``mmcache.tiers.mooncake`` holds the Mooncake Store client (the
tests' loopback master is ``tests/mooncake_master.py``).
"""

from mmcache.tiers.encoder_host import EncoderHostTier
from mmcache.tiers.encoder_tiers import EncoderTiers
from mmcache.tiers.host import HostBudget, HostTier
from mmcache.tiers.stack import PageFetch, TierStack
from mmcache.tiers.store import MemoryStore, StoreTier

__all__ = ["EncoderHostTier", "EncoderTiers", "HostBudget", "HostTier", "MemoryStore", "PageFetch", "StoreTier",
           "TierStack"]
