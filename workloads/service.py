"""The service-time model of timestamp-order trace replays (``workloads.sizing``), which generated traces also space
their sessions' turns by (``workloads.traces.text_trace.turn_calls``). A module of its own, below both and apart from
``sizing.replay``, so the CLI's ``--help`` can show its defaults without importing the cache.

``encoder_s`` (multimodal replays: seconds per media item whose encoder runs, i.e. neither inside the matched prefix
nor in the encoder store) defaults to 0.02 s, from a figure measured here: decoding and preprocessing one 0.8-1.2 MB
image took 13-24 ms on the project's 2-core machine (``benchmarks/bench_digests.py``, README "Results"). That CPU work
is what a hit skips and what a GPU does not speed up; the tower's own forward on a GPU (a few ms for a ViT-L at
336 px) is not measured here (no GPU), nor is a codec encoder's, so the default is the same for images and voices.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServiceModel:
    """How long a request stays live in timestamp order, and what its encoder misses add before its prefill."""

    prefill_tokens_per_s: float = 10_000.0
    s_per_output_token: float = 0.02
    encoder_s: float = 0.02

    def duration(self, uncached_tokens: int, output_len: int) -> float:
        return uncached_tokens / self.prefill_tokens_per_s + output_len * self.s_per_output_token
