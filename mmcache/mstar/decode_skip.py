"""A hit known before decoding skips the decode and the preprocessing too (RFC phase 3a: "a hit skips the decode,
the preprocessing and the encoder").

The data worker has each media item's digest before it decodes anything (``media_digests``). It asks a presence
oracle, ``known(keys) -> set``, which of the request's items the encoder node's store holds. When every media item
of a request is known, the data worker neither decodes nor preprocesses; it sends the digests plus the stand-ins the
graph still needs. The node serves each item from its store by the carried digest and never reads the stand-ins.

The oracle's contract (what makes skipping exact): a key it reports is HELD for its request (pinned in the node's
store) until the node's ``cleanup_request`` for that request, so no eviction can turn the node's lookup into a miss
on stand-in inputs. In a deployment the store lives in the encoder worker's process and the oracle is a call to it;
``store_oracle`` is the in-process one (pins through ``CachedEncoderNode.hold``).

What the downstream graph needs besides the encoder outputs is model specific: ``Qwen3OmniStandIns``. For
Qwen3-Omni (``qwen3_omni_model.py``) the thinker's prefill reads ``image_grid_thw`` (MRoPE positions of the vision
span; ``video_second_per_grid`` only for video, never skipped) and nothing else of the preprocessing: the prompt text
holds no placeholders (the vision/audio walks wrap the encoder output in their sentinels), so ``text_inputs`` depend
only on how many media items there are. The audio encoder node reads ``audio_seqlens``. Both are known only by
preprocessing, so a side table keyed by digest keeps them, filled on a request's first (decoded) pass; the digest
names the bytes and the processor's parameters, which is all they depend on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Callable, Iterable

import torch

from mmcache.errors import InvalidRequest


@dataclasses.dataclass(frozen=True)
class MediaKey:
    """One media item of one request, as the data worker asks the oracle about it."""

    request_id: str
    modality: str
    digest: bytes  # the 16 bytes that travel as ``<modality>_digest`` (the tenant salt folded in, ``salts``)


Known = Callable[[list[MediaKey]], set]


def store_oracle(nodes: dict[str, tuple]) -> Known:
    """The in-process oracle over ``{modality: (CachedEncoderNode, graph walk)}``: a key is known when the node's
    store holds its output, and is then pinned for its request until the node's ``cleanup_request``."""
    def known(keys: Iterable[MediaKey]) -> set:
        out = set()
        for k in keys:
            if k.modality in nodes:
                node, walk = nodes[k.modality]
                if node.hold(k.request_id, k.digest, walk):
                    out.add(k)
        return out
    return known


class _Queue:
    """A stand-in for one HF processor during a skipped request: each call returns the next stored output."""

    def __init__(self, outputs: list, make: Callable, sampling_rate=None):
        self._outputs, self._make, self.sampling_rate = collections.deque(outputs), make, sampling_rate

    def __call__(self, *args, **kwargs):
        return self._make(self._outputs.popleft())


class _SkippingProcessor:
    """The model's ``_processor`` with its ``image_processor``/``feature_extractor`` replaced by stand-ins while
    the calling thread preprocesses a skipped request; everything else (and every other thread) sees the real one."""

    def __init__(self, real, local: threading.local):
        self.__dict__.update(_real=real, _local=local)

    def __getattr__(self, name):
        standins = getattr(self._local, "standins", None)
        if standins and name in standins:
            return standins[name]
        return getattr(self._real, name)


class Qwen3OmniStandIns:
    """What Qwen3-Omni's graph needs from a skipped request's preprocessing, kept per digest (``max_entries``, least
    recently used out): ``image_grid_thw`` for images, ``audio_seqlens`` for audio."""

    modalities = ("image", "audio")

    def __init__(self, max_entries: int = 1 << 16):
        self._table: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._max, self._lock, self._local = max_entries, threading.Lock(), threading.local()

    def install(self, model) -> None:
        """Let ``model.process_prompt`` run without its processors for skipped requests (idempotent)."""
        if not isinstance(model._processor, _SkippingProcessor):
            model._processor = _SkippingProcessor(model._processor, self._local)

    def record(self, digests: dict[str, list[bytes]], result: dict) -> None:
        """After a decoded pass: keep each item's grid / seqlen under its digest (items in file order)."""
        taken = {"image": "image_grid_thw", "audio": "audio_seqlens"}
        with self._lock:
            for modality, name in taken.items():
                for digest, value in zip(digests.get(modality, ()), result.get(name, ())):
                    self._table[digest] = value.clone()
                    self._table.move_to_end(digest)
            while len(self._table) > self._max:
                self._table.popitem(last=False)

    def lookup(self, digests: dict[str, list[bytes]]) -> dict[str, list] | None:
        """Every item's stored grid / seqlen, or None unless all of them are stored (or a modality is not handled)."""
        if set(digests) - set(self.modalities):
            return None
        with self._lock:
            if not all(d in self._table for ds in digests.values() for d in ds):
                return None
            return {m: [self._table[d] for d in ds] for m, ds in digests.items()}

    def raw(self, modality: str):
        """What a loader returns for a skipped item: a tensor that costs nothing to convert."""
        from mstar.model.base import TensorAndMetadata
        return TensorAndMetadata(torch.zeros(3, 1, 1) if modality == "image" else torch.zeros(0))

    def begin(self, stored: dict[str, list]) -> None:
        """The calling thread's next ``process_prompt`` reads ``stored`` instead of running the processors."""
        grids = lambda g: {"pixel_values": torch.zeros(0), "image_grid_thw": g.unsqueeze(0)}  # noqa: E731
        # process_prompt takes input_features[mask] and mask.sum(): a [1, 0, L] stand-in gives [0, L] and L
        feats = lambda n: {"input_features": torch.zeros(1, 0, int(n)),  # noqa: E731
                           "attention_mask": torch.ones(1, int(n), dtype=torch.int32)}
        self._local.standins = {"image_processor": _Queue(stored.get("image", []), grids),
                                "feature_extractor": _Queue(stored.get("audio", []), feats, 16000)}

    def end(self) -> None:
        self._local.standins = None


def stand_ins_for(model):
    """The stand-ins of M* model ``model`` (Qwen3-Omni); InvalidRequest for models without a known set."""
    if type(model).__name__ == "Qwen3OmniModel":
        return Qwen3OmniStandIns()
    raise InvalidRequest(f"no decode-skip stand-ins known for {type(model).__name__}: pass stand_ins=")
