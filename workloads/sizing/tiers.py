"""The tiers of a sizing replay (host memory and a shared store under the device pool) and the transfer model that
charges their hits in the TTFT model. Torch-free at import, so the CLI's ``--help`` can show the defaults.

Defaults and where they come from:
- ``host_bytes_per_s`` 50e9: PCIe 5.0 x16 moves 64 GB/s per direction raw; pinned host<->device copies reach about
  50 GB/s in practice (pinned memory needs CUDA; this machine has none to measure it).
- ``store_bytes_per_s`` 1.7e9: Mooncake Store get/put of 1 MiB objects over loopback TCP on this machine (0.5-0.6 ms
  per MiB, docs/tiers.md; benchmarks/bench_tiers.py re-measures it). RDMA would be faster.
- ``kv_bytes_per_token`` 128 KiB: Llama-3-8B in bf16 (32 layers x 2 x 8 KV heads x 128 dims x 2 bytes).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TierModel:
    """Tier sizes in tokens (None: no such tier) and the transfer rates that charge their hits."""

    host_tokens: int | None = None
    store_tokens: int | None = None
    host_bytes_per_s: float = 50e9
    store_bytes_per_s: float = 1.7e9
    kv_bytes_per_token: int = 128 << 10

    @property
    def enabled(self) -> bool:
        return bool(self.host_tokens or self.store_tokens)

    def transfer_s(self, host_tokens: int, store_tokens: int) -> float:
        """Seconds to bring that many tokens' KV up from the host tier and from the store."""
        b = self.kv_bytes_per_token
        return host_tokens * b / self.host_bytes_per_s + store_tokens * b / self.store_bytes_per_s

    def build(self, fingerprint, pool, page_size: int):
        """The ``TierStack`` of a metadata-only replay pool (None when no tier is set)."""
        if not self.enabled:
            return None
        from mmcache.pool import HostPagePool
        from mmcache.tiers import HostTier, MemoryStore, StoreTier, TierStack
        host = store = None
        if self.host_tokens:
            host = HostTier(HostPagePool.like(pool, max(1, self.host_tokens // page_size)), page_size)
        if self.store_tokens:
            store = StoreTier(MemoryStore(max(1, self.store_tokens // page_size)), publish_async=False,
                              deadline_s=None)  # in-process: read inline, never a deadline
        return TierStack(fingerprint, host=host, store=store)
