"""The encoder outputs of a metadata replay: a real ``EncoderStore`` whose entries stand in for the features.

A media item an encoder makes (``TextRequest.encoded``) is served, as vlm-chat and voice-clone serve it, after its
request's admission: from the matched prefix when its placeholder rows lie inside it, else from the store, else the
encoder runs (a miss, stored with the time it took: what a later hit saves). An entry holds one stand-in byte per
``unit`` bytes of output, so eviction and capacity act on the true sizes while the replay holds no feature bytes:
in a store of its own (``StandIns.own``), or on the replay's KV pool (``StandIns.on_pool``: an output of ``nbytes``
takes ``nbytes / kv_page_bytes`` pages, at least one), where KV pages and encoder outputs compete under the pool's
policy.
"""

from __future__ import annotations

import dataclasses

import torch

from mmcache import EncoderKey, EncoderStore, PagePool
from workloads.traces.text_trace import MediaItem, TextRequest

ENCODER_UNIT = 1 << 16  # bytes of encoder output one stand-in byte of a store of its own counts for
_ENCODER = "replay-encoder"  # the fingerprint of the replay's stand-in encoders


DEFAULT_ENCODER_BYTES = 256 << 20  # the model workloads' --encoder-bytes default


@dataclasses.dataclass(frozen=True)
class EncoderPlace:
    """Where a replay keeps encoder outputs: a store of their own of ``capacity_bytes``, or with ``kv_page_bytes``
    the KV pool (a page standing for that many bytes of output)."""

    capacity_bytes: int = DEFAULT_ENCODER_BYTES
    kv_page_bytes: int | None = None

    def build(self, pool: PagePool, encoder_s: float, observer=None) -> "StandIns":
        if self.kv_page_bytes is None:
            return StandIns.own(self.capacity_bytes, encoder_s, observer)
        return StandIns.on_pool(pool, self.kv_page_bytes, encoder_s, observer)


class StandIns:
    """A replay's encoder store and what it served: ``items`` encoded media items of admitted requests, of which
    ``in_prefix`` were inside the matched prefix and ``store_hits`` found in the store (the rest ran)."""

    def __init__(self, store: EncoderStore, unit: int, encoder_s: float):
        self.store, self.unit, self.encoder_s = store, unit, encoder_s
        self.items = self.in_prefix = self.store_hits = 0

    @classmethod
    def own(cls, capacity_bytes: int, encoder_s: float, observer=None) -> "StandIns":
        """A store of its own holding ``capacity_bytes`` of outputs."""
        units = max(1, capacity_bytes // ENCODER_UNIT)
        return cls(EncoderStore(capacity_bytes=units, page_bytes=1, observer=observer), ENCODER_UNIT, encoder_s)

    @classmethod
    def on_pool(cls, pool: PagePool, kv_page_bytes: int, encoder_s: float, observer=None) -> "StandIns":
        """A store on the KV ``pool``, a page standing for ``kv_page_bytes`` of output."""
        stand_ins = torch.zeros((pool.num_pages, 1), dtype=torch.uint8)
        return cls(EncoderStore(pool=pool, page_data=stand_ins, observer=observer), kv_page_bytes, encoder_s)

    def serve(self, req: TextRequest, matched: int) -> int:
        """Serve every encoded media item of the admitted ``req`` (``matched`` tokens from the cache); the runs."""
        runs = 0
        for item in req.encoded:
            self.items += 1
            if item.offset + item.tokens <= matched:
                self.in_prefix += 1
                continue
            key = EncoderKey(item.digest, _ENCODER, item.modality)
            if self.store.get(key) is not None:
                self.store_hits += 1
            else:
                self.store.put(key, self._stand_in(item), compute_s=self.encoder_s)
                runs += 1
        return runs

    def _stand_in(self, item: MediaItem) -> torch.Tensor:
        return torch.zeros(max(1, -(-item.nbytes // self.unit)), dtype=torch.uint8)
