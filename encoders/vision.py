"""Cached vision encoders: an image in, the features its language model consumes out, computed once per (image
bytes, preprocessing, weights).

Level wrapped: the whole image -> features function, i.e. decode + image processor + encoder, keyed before any of
it runs. That is the unit a VLM computes once per image and everything downstream consumes; it is a pure function
of (raw bytes, processor settings, weights), so a hit skips the decode, the preprocessing and the forward.

- A LLaVA-style model (anything with ``get_image_features``: ``LlavaForConditionalGeneration``, ``LlavaModel``,
  also ``CLIPModel``/``SiglipModel``) gives ``get_image_features(pixel_values=...).pooler_output[0]``: for LLaVA the
  projected features of one image [num_image_tokens, text hidden size], exactly the rows the model scatters into its
  ``<image>`` placeholders (hand them back as ``mm_encoder_outputs={"image": BaseModelOutputWithPooling(
  pooler_output=[...])}`` instead of ``pixel_values``); for CLIPModel/SiglipModel the projected image embedding [D].
- A bare tower (``CLIPVisionModel``, ``SiglipVisionModel``) gives ``last_hidden_state[0]`` [num_patches (+1), D]:
  the sequence a VLM projector consumes; pooled embeddings are what the full models' ``get_image_features`` give.

Key of one image: ``EncoderKey(digests.image(bytes or PIL image, params), fingerprint, "image", salt)``, where
``params`` (the canonical image processor plus its backend class: the PIL and torchvision backends of one processor
give different pixels) and ``fingerprint`` (``module_fingerprint``: weights, config, attention backend, dtype,
device type) are computed once at construction. A path is read once and its bytes are both digested and decoded,
so a file changed between the two can never store one image's features under another's digest.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import digests
from digests.media import media_bytes
from encoders.base import CachedEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidMedia
from mmcache.module_fingerprint import module_fingerprint


class CachedVisionEncoder(CachedEncoder):
    """``encoder(image)``: the features of one image (bytes, a path or a PIL image), through ``store`` when given;
    ``encoder.lookup(image, digest=..., salt=...)`` says whether it hit (``encoders.base.CachedEncoder``).

    Invariants: a hit equals the miss that stored it bit for bit, and a miss equals running ``processor`` and
    ``model`` by hand on the decoded image (one image per forward); a corrupt or truncated file raises
    ``InvalidMedia`` from the decode and stores nothing; outputs come back on the model's device whether computed or
    gathered. ``store=None`` runs the pipeline on every call (the uncached baseline). A full processor (e.g.
    ``LlavaProcessor``) is reduced to its ``image_processor``.
    """

    modality, media_kind = "image", "image"

    def __init__(self, model: nn.Module, processor, store: EncoderStore | None, *, fingerprint: str | None = None,
                 salt: bytes = b""):
        self.model = model.eval()
        self.processor = getattr(processor, "image_processor", processor)
        backend = type(self.processor)
        self.params = digests.canonical({"processor": self.processor,
                                         "backend": f"{backend.__module__}.{backend.__qualname__}"})
        p = next(model.parameters())
        super().__init__(store, module_fingerprint(model) if fingerprint is None else fingerprint, salt=salt,
                         device=p.device, dtype=p.dtype)
        self._projected = callable(getattr(model, "get_image_features", None))

    def features_for(self, images) -> list[torch.Tensor]:
        """One output per image, one forward per image: the simplest schedule whose outputs do not depend on which
        other images share the call, so cached and uncached runs agree bit for bit."""
        return [self(image) for image in images]

    def read(self, image):
        """``image`` as bytes (read once from a path) or the PIL image itself; InvalidMedia for anything else."""
        data = media_bytes(image, "image")
        if data is not None:
            return data
        pil = sys.modules.get("PIL.Image")
        if pil is not None and isinstance(image, pil.Image):
            return image
        raise InvalidMedia(f"cannot encode {type(image).__qualname__} as an image: expected bytes, a path or a PIL "
                           f"image")

    def digest(self, data) -> digests.Digest:
        return digests.image(data, self.params)

    def compute(self, data) -> torch.Tensor:
        """The uncached pipeline on image bytes or a PIL image: decode, preprocess, forward one image."""
        image = digests.open_image(data) if isinstance(data, bytes) else data
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        with torch.inference_mode():
            if self._projected:
                return self.model.get_image_features(pixel_values=pixels).pooler_output[0]
            return self.model(pixel_values=pixels).last_hidden_state[0]
