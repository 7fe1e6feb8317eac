"""Tiers below the device pool (RFC phase 4b and beyond): a host-memory tier for evicted pages and a store shared by
instances (Mooncake Store), both verified like the device index.

``TierStack(fingerprint, host=HostTier(...), store=StoreTier(...))`` is the ``LowerTier`` under a pool:
``PrefixCache(..., tiers=...)``, or ``PrefixReuse(tiers=...)`` for M*'s KV resource. ``HostBudget`` splits host
memory between the tier and preemption offload. ``mmcache.tiers.mooncake`` holds the Mooncake Store client (the tests'
loopback master is ``tests/mooncake_master.py``).
"""

from mmcache.tiers.host import HostBudget, HostTier
from mmcache.tiers.stack import PageFetch, TierStack
from mmcache.tiers.store import MemoryStore, StoreTier

__all__ = ["HostBudget", "HostTier", "MemoryStore", "PageFetch", "StoreTier", "TierStack"]
