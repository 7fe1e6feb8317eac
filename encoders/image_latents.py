"""Cached image conditioning of Wan 2.2 image-to-video: a conditioning image in, its VAE latents out, computed once
per (image bytes, size and frame layout, VAE weights).

Wan 2.2 conditions on the VAE latents of the image (Wan 2.1 on CLIP image features, which this does not wrap).
Level wrapped: what ``WanImageToVideoPipeline`` does to its ``image`` before denoising: decode to RGB (``decode``, as
diffusers' ``load_image`` gives the pipeline its images), ``video_processor.
preprocess`` to ``height`` x ``width`` (float32 on the execution device), the condition clip (the image alone with
``expand_timesteps``, as TI2V-5B; else the image then ``num_frames - 1`` zero frames) in the VAE's dtype, and
``retrieve_latents(vae.encode(clip), sample_mode="argmax")``: the raw latents, before the pipeline normalizes them.

The pipeline takes no latents for its condition, so ``supplied(pipe, latents)`` stands in for ``pipe.vae.encode``
during one call: the pipeline still builds the condition clip (from a blank placeholder image of the right size,
``placeholder()``, so a hit decodes nothing), and the stand-in returns the latents given, after checking it was
handed a clip of the shape those latents were computed from. Everything after (normalization, masks, denoising) is
the pipeline's own code, so the output equals the uncached call's bit for bit.

Key of one image: ``EncoderKey(digests.image(bytes, params), fingerprint, "image", salt)``; ``params``: the size,
frame layout and the pipeline's video processor config; ``fingerprint``: ``module_fingerprint`` of the VAE.
"""

from __future__ import annotations

import contextlib
import types

import torch
from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents
from diffusers.utils.torch_utils import get_module_execution_device

import digests
from encoders.base import CachedEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError
from mmcache.module_fingerprint import module_fingerprint


def decode(data):
    """Image bytes as the RGB PIL image a Wan pipeline takes (alpha and palettes dropped); InvalidMedia if corrupt."""
    return digests.open_image(data).convert("RGB")


@contextlib.contextmanager
def patched(obj, name: str, value):
    """``obj.name`` is ``value`` within the body (an instance attribute shadowing a method), as before after it."""
    missing = object()
    before = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, before)


class CachedImageLatents(CachedEncoder):
    """``encoder(image)``: the raw VAE latents of one conditioning image (bytes or a path) for ``pipe`` at
    ``height`` x ``width`` and ``num_frames``, through ``store`` when given; ``store=None`` computes every time.

    Invariants: a miss equals the latents the pipeline computes for that image in that call, bit for bit, and a hit
    equals the miss that stored it; a corrupt image raises ``InvalidMedia`` and stores nothing.
    """

    modality, media_kind = "image", "image"

    def __init__(self, pipe, store: EncoderStore | None, *, height: int, width: int, num_frames: int,
                 fingerprint: str | None = None, salt: bytes = b""):
        self.pipe, self.height, self.width = pipe, int(height), int(width)
        self.frames = 1 if pipe.config.expand_timesteps else int(num_frames)
        self.params = digests.canonical({"height": self.height, "width": self.width, "frames": self.frames,
                                         "mode": "RGB", "processor": dict(pipe.video_processor.config)})
        vae = pipe.vae
        super().__init__(store, module_fingerprint(vae) if fingerprint is None else fingerprint, salt=salt,
                         device=pipe._execution_device, dtype=vae.dtype)

    def digest(self, data) -> digests.Digest:
        return digests.image(data, self.params)

    def compute(self, data: bytes) -> torch.Tensor:
        """The pipeline's conditioning steps on image bytes: decode, preprocess, condition clip, VAE encode."""
        with torch.no_grad():
            return self._encode(self._clip(decode(data)))

    def placeholder(self):
        """A blank image of the call's size: what a cached call hands the pipeline as its ``image``."""
        from PIL import Image

        return Image.new("RGB", (self.width, self.height))

    @contextlib.contextmanager
    def supplied(self, latents: torch.Tensor):
        """Within the body, ``pipe.vae.encode`` returns ``latents`` (once) for a condition clip of this encoder's
        shape, instead of encoding it; any other call raises ``EncoderOutputError``."""
        vae, shape = self.pipe.vae, (1, 3, self.frames, self.height, self.width)

        def encode(clip, *args, **kwargs):
            if tuple(clip.shape) != shape:
                raise EncoderOutputError(f"the pipeline encoded a clip of shape {tuple(clip.shape)}; the supplied "
                                         f"latents are for {shape}")
            return types.SimpleNamespace(latents=latents)

        with patched(vae, "encode", encode):
            yield

    def _clip(self, image) -> torch.Tensor:
        pipe = self.pipe
        x = pipe.video_processor.preprocess(image, height=self.height, width=self.width)
        x = x.to(pipe._execution_device, dtype=torch.float32).unsqueeze(2)
        if self.frames > 1:
            x = torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], self.frames - 1, self.height, self.width)], dim=2)
        return x.to(device=get_module_execution_device(pipe.vae), dtype=pipe.vae.dtype)

    def _encode(self, clip: torch.Tensor) -> torch.Tensor:
        return retrieve_latents(self.pipe.vae.encode(clip), sample_mode="argmax")
