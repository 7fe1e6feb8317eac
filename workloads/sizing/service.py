"""The service-time model of timestamp-order trace replays (apart from ``replay``, so the CLI's ``--help`` can show
its defaults without importing the cache)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServiceModel:
    """How long a request stays live in timestamp order."""

    prefill_tokens_per_s: float = 10_000.0
    s_per_output_token: float = 0.02

    def duration(self, uncached_tokens: int, output_len: int) -> float:
        return uncached_tokens / self.prefill_tokens_per_s + output_len * self.s_per_output_token
