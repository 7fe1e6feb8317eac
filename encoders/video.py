"""Cached video encoders: a clip in, the features its language model consumes out, computed once per (container
bytes, frame sampling, preprocessing, weights).

Level wrapped: the whole clip -> features function: PyAV decode, frame sampling (``digests.FrameSampling``), the
video processor and the model's ``get_video_features`` (LLaVA-NeXT-Video: the CLIP tower per frame, the spatial
pooler and the projector), giving ``pooler_output[0]`` [num_frames * tokens per frame, text hidden size], the rows
the model scatters into its ``<video>`` placeholders.

Key of one clip: ``EncoderKey(digests.video(bytes, params), fingerprint, "video", salt)``, where ``params`` are the
canonical frame sampling, video processor and its backend class, and ``fingerprint`` is ``module_fingerprint`` of
the model; both are computed once. The digest hashes the container bytes as sent, so two samplings of one file
(other ``num_frames`` or ``fps``) never share an entry, and a re-encoded copy of a clip is another clip.
"""

from __future__ import annotations

import torch
from torch import nn

import digests
from encoders.base import CachedEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.module_fingerprint import module_fingerprint


class CachedVideoEncoder(CachedEncoder):
    """``encoder(clip)``: the features of one video file (bytes or a path), through ``store`` when given.

    Invariants: a hit equals the miss that stored it bit for bit, and a miss equals decoding, sampling, processing
    and running ``model.get_video_features`` by hand (one clip per forward); a file that is not a readable video,
    is truncated, or is sampled beyond its end raises ``InvalidMedia`` from the decode and stores nothing.
    ``store=None`` runs the pipeline on every call. A full processor is reduced to its ``video_processor``.
    """

    modality, media_kind = "video", "video"

    def __init__(self, model: nn.Module, processor, store: EncoderStore | None, sampling: digests.FrameSampling, *,
                 fingerprint: str | None = None, salt: bytes = b""):
        self.model, self.sampling = model.eval(), sampling
        self.processor = getattr(processor, "video_processor", processor)
        backend = type(self.processor)
        self.params = digests.canonical({"sampling": sampling, "processor": self.processor,
                                         "backend": f"{backend.__module__}.{backend.__qualname__}"})
        p = next(model.parameters())
        super().__init__(store, module_fingerprint(model) if fingerprint is None else fingerprint, salt=salt,
                         device=p.device, dtype=p.dtype)
        config = model.config
        self._select = dict(vision_feature_layer=config.vision_feature_layer,
                            vision_feature_select_strategy=config.vision_feature_select_strategy)

    def digest(self, data) -> digests.Digest:
        return digests.video(data, self.params)

    def compute(self, data: bytes) -> torch.Tensor:
        """The uncached pipeline on clip bytes: decode and sample, preprocess, forward one clip."""
        frames = digests.load_video(data, self.sampling)
        pixels = self.processor(videos=[frames], do_sample_frames=False, return_tensors="pt")["pixel_values_videos"]
        with torch.inference_mode():
            return self.model.get_video_features(pixel_values_videos=pixels.to(self.device, self.dtype),
                                                 **self._select).pooler_output[0]


def tokens_per_video(config, sampling: digests.FrameSampling) -> int:
    """Placeholders per clip of a LLaVA-NeXT-Video config: per sampled frame, the patch grid pooled by
    ``spatial_pool_stride`` (plus the CLS row under the ``full`` strategy, which the pooler does not see)."""
    vision = config.vision_config
    side = vision.image_size // vision.patch_size // config.spatial_pool_stride
    return sampling.num_frames * side * side
