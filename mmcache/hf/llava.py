"""LLaVA-style prefill with image digests in the page chain: the same image behind the same prefix is served from the
prefix cache like text, and then skips the vision pipeline entirely.

An image enters a prompt as ``tokens_per_image`` placeholder ids. Its digest (raw file bytes plus the canonical
image-processor params: ``CachedVisionEncoder.key``, which decodes nothing) is folded into the name of the page that
holds its first placeholder (``media=[(offset, digest)]``), and every later page chains from that name. So a page
matches only behind the same tokens and the same images, and a different image behind the same text misses from the
page of its first placeholder on.

Features enter the model as ``inputs_embeds``: token embeddings with the image's projected features copied into its
placeholder rows by position, which is what ``LlavaModel`` does with ``masked_scatter``, value for value, without
``pixel_values`` or per-chunk placeholder counting. Features are fetched (through the ``EncoderStore`` when one is
given) only when a forward call covers one of the image's rows, so an image whose placeholders all lie in the matched
prefix is never read, decoded, preprocessed or encoded.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Hashable, Sequence

import torch

import digests
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError

from mmcache.hf import runner
from encoders.base import media_bytes
from mmcache.hf.paged_kv import PagedKVCache
from encoders.vision import CachedVisionEncoder


@dataclasses.dataclass(frozen=True)
class VlmPrompt:
    """Token ids with one run of placeholders per image, and the images as ``(offset of the first placeholder, raw
    file bytes)`` in prompt order."""

    token_ids: tuple[int, ...]
    images: tuple[tuple[int, bytes], ...] = ()


def num_image_tokens(config) -> int:
    """Placeholders per image of a LLaVA config: one per patch, plus the CLS row under the ``full`` strategy."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


class LlavaPrefill:
    """Prompts, page names and prefill for a ``LlavaForConditionalGeneration`` over a ``PagedKVCache``.

    ``kv=None`` and ``store=None`` give the uncached pipeline (tower on every image, no KV reuse) with the same
    prompts and embeddings, for baselines and the bit-exact gate. One image per tower forward, so features never
    depend on which other images share a call.
    """

    def __init__(self, model, processor, kv: PagedKVCache | None = None, store: EncoderStore | None = None):
        self.model = model.eval()
        self.kv = kv
        self.encoder = CachedVisionEncoder(model, processor, store)
        self.image_token_id = model.config.image_token_id
        self.tokens_per_image = num_image_tokens(model.config)

    def prompt(self, *parts) -> VlmPrompt:
        """Concatenate ``parts``: token id sequences, images (bytes, or a path read once here), and earlier prompts,
        so turn n+1 of a chat is ``prompt(turn_n_prompt, turn_n_output_ids, next_question_ids)``."""
        tokens: list[int] = []
        images: list[tuple[int, bytes]] = []
        for part in parts:
            if isinstance(part, VlmPrompt):
                images += [(len(tokens) + off, data) for off, data in part.images]
                tokens += part.token_ids
            elif (data := media_bytes(part, "image")) is not None:
                images.append((len(tokens), data))
                tokens += [self.image_token_id] * self.tokens_per_image
            else:
                tokens += [int(t) for t in part]
        return VlmPrompt(tuple(tokens), tuple(images))

    def media(self, prompt: VlmPrompt) -> list[tuple[int, digests.Digest]]:
        """The ``(offset, digest)`` marks ``PrefixCache.admit`` folds into the page names."""
        return [(off, self.encoder.key(data).digest) for off, data in prompt.images]

    def embedder(self, prompt: VlmPrompt) -> runner.Embed:
        """``embed(start, end)``: the prompt's ``inputs_embeds`` rows ``[start, end)``. An image's features are
        computed (or gathered from the store) the first time a call covers one of its rows, then kept for the
        request."""
        table = self.model.get_input_embeddings()
        ids = torch.tensor(prompt.token_ids, device=table.weight.device)[None]
        T, features = self.tokens_per_image, {}

        def embed(start: int, end: int) -> torch.Tensor:
            rows = table(ids[:, start:end])
            for off, data in prompt.images:
                lo, hi = max(start, off), min(end, off + T)
                if lo < hi:
                    if off not in features:
                        features[off] = self._features(data)
                    rows[0, lo - start:hi - start] = features[off][lo - off:hi - off]
            return rows

        return embed

    def serve(self, rid: Hashable, prompt: VlmPrompt, *, max_new_tokens: int = 16, chunk_tokens: int | None = None,
              salt: bytes = b"", names: Sequence[int] | None = None) -> runner.Served:
        """``runner.serve`` on ``self.kv`` with the image digests in the chain; TTFT includes digesting."""
        arrival = time.perf_counter()
        return runner.serve(self.model, self.kv, rid, prompt.token_ids, max_new_tokens=max_new_tokens,
                             chunk_tokens=chunk_tokens, media=self.media(prompt), names=names, salt=salt,
                             embed=self.embedder(prompt), arrival=arrival)

    def generate(self, rid: Hashable, prompt: VlmPrompt, *, salt: bytes = b"", **generate_kwargs):
        """``runner.generate`` (``model.generate`` on ``self.kv``) with the image digests in the chain."""
        return runner.generate(self.model, self.kv, rid, prompt.token_ids, media=self.media(prompt), salt=salt,
                                embed=self.embedder(prompt), **generate_kwargs)

    def _features(self, data: bytes) -> torch.Tensor:
        features = self.encoder(data)
        if features.shape[0] != self.tokens_per_image:
            raise EncoderOutputError(f"the vision encoder gave {features.shape[0]} rows for an image of "
                                     f"{self.tokens_per_image} placeholders")
        return features

