"""LLaVA-style prefill with image (or video) digests in the page chain: the same image behind the same prefix is
served from the prefix cache like text, and then skips the vision pipeline entirely.

An image enters a prompt as ``tokens_per_item`` placeholder ids. Its digest (raw file bytes plus the canonical
image-processor params: ``CachedVisionEncoder.key``, which decodes nothing) is folded into the name of the page that
holds its first placeholder (``media=[(offset, digest)]``), and every later page chains from that name. So a page
matches only behind the same tokens and the same images, and a different image behind the same text misses from the
page of its first placeholder on.

Features enter the model as ``inputs_embeds``: token embeddings with the image's projected features copied into its
placeholder rows by position, which is what ``LlavaModel`` does with ``masked_scatter``, value for value, without
``pixel_values`` or per-chunk placeholder counting. Features are fetched (through the ``EncoderStore`` when one is
given, under the request's salt, so tenants never share an image's features) only for images with a row past the
matched prefix, so an image whose placeholders all lie in the matched prefix is never decoded, preprocessed or
encoded. Each image is hashed once per request: the digest that names its page is the one its encoder key uses.

A video prefill (``sampling`` given: a LLaVA-NeXT-Video model) is the same with clips for images: each clip is
``tokens_per_item`` ``<video>`` placeholders, named by ``digests.video`` of its container bytes and frame sampling
(``encoders.video.CachedVideoEncoder``), its features from ``get_video_features``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Sequence

import torch

import digests
from digests.media import media_bytes
from encoders.video import CachedVideoEncoder, tokens_per_video
from encoders.vision import CachedVisionEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError
from mmcache.hf import runner
from mmcache.hf.paged_kv import PagedKVCache

_SAME = object()  # serve(kv=...) default: the prefill's own cache


@dataclasses.dataclass(frozen=True)
class VlmPrompt:
    """Token ids with one run of placeholders per media item, and the items (images, or clips for a video prefill)
    as ``(offset of the first placeholder, raw file bytes)`` in prompt order."""

    token_ids: tuple[int, ...]
    items: tuple[tuple[int, bytes], ...] = ()


def num_image_tokens(config) -> int:
    """Placeholders per image of a LLaVA config: one per patch, plus the CLS row under the ``full`` strategy."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")


class LlavaPrefill:
    """Prompts, page names and prefill for a ``LlavaForConditionalGeneration`` over a ``PagedKVCache``.

    ``kv=None`` and ``store=None`` give the uncached pipeline (tower on every image, no KV reuse) with the same
    prompts and embeddings, for baselines and the bit-exact gate. One image per tower forward, so features never
    depend on which other images share a call. ``fingerprint``: the vision encoder's, when already taken.
    ``sampling``: the media are video clips sampled so (a ``LlavaNextVideoForConditionalGeneration`` and its video
    processor), one clip per forward.
    """

    def __init__(self, model, processor, kv: PagedKVCache | None = None, store: EncoderStore | None = None, *,
                 fingerprint: str | None = None, sampling: digests.FrameSampling | None = None):
        self.model = model.eval()
        self.kv = kv
        if sampling is None:
            self.encoder = CachedVisionEncoder(model, processor, store, fingerprint=fingerprint)
            self.placeholder_id, self.tokens_per_item = model.config.image_token_id, num_image_tokens(model.config)
        else:
            self.encoder = CachedVideoEncoder(model, processor, store, sampling, fingerprint=fingerprint)
            self.placeholder_id = model.config.video_token_id
            self.tokens_per_item = tokens_per_video(model.config, sampling)

    def prompt(self, *parts) -> VlmPrompt:
        """Concatenate ``parts``: token id sequences, media (bytes, or a path read once here), and earlier prompts,
        so turn n+1 of a chat is ``prompt(turn_n_prompt, turn_n_output_ids, next_question_ids)``."""
        tokens: list[int] = []
        items: list[tuple[int, bytes]] = []
        for part in parts:
            if isinstance(part, VlmPrompt):
                items += [(len(tokens) + off, data) for off, data in part.items]
                tokens += part.token_ids
            elif (data := media_bytes(part, self.encoder.media_kind)) is not None:
                items.append((len(tokens), data))
                tokens += [self.placeholder_id] * self.tokens_per_item
            else:
                tokens += [int(t) for t in part]
        return VlmPrompt(tuple(tokens), tuple(items))

    def media(self, prompt: VlmPrompt) -> list[tuple[int, digests.Digest]]:
        """The ``(offset, digest)`` marks ``PrefixCache.admit`` folds into the page names (one hash per item, the
        one its encoder key uses too)."""
        return [(off, self.encoder.digest(data)) for off, data in prompt.items]

    def features(self, prompt: VlmPrompt, matched: int = 0, *, media: Sequence | None = None,
                 salt: bytes = b"") -> tuple[dict[int, torch.Tensor], int]:
        """``({offset: features}, hits)`` of the images with a placeholder past ``matched``, looked up under
        ``salt`` (``media``: their digests from ``self.media``, so nothing is hashed twice); ``hits`` counts the
        prompt's images the tower did not run for (stored, joined, or entirely inside the matched prefix)."""
        digest = dict(media or ())
        T, features, computed = self.tokens_per_item, {}, 0
        for off, data in prompt.items:
            if off + T > matched:
                found = self.encoder.lookup(data, digest=digest.get(off), salt=salt)
                if found.value.shape[0] != T:
                    raise EncoderOutputError(f"the {self.encoder.modality} encoder gave {found.value.shape[0]} rows "
                                             f"for an item of {T} placeholders")
                features[off], computed = found.value, computed + (not found.hit)
        return features, len(prompt.items) - computed

    def embedder(self, prompt: VlmPrompt, matched: int = 0, *, media: Sequence | None = None,
                 salt: bytes = b"") -> runner.Embed:
        """``embed(start, end)``: the prompt's ``inputs_embeds`` rows ``[start, end)`` for ``start >= matched``,
        the images' features (``features``) fetched now."""
        return self.rows(prompt, self.features(prompt, matched, media=media, salt=salt)[0])

    def rows(self, prompt: VlmPrompt, features: dict[int, torch.Tensor]) -> runner.Embed:
        """``embed(start, end)``: token embeddings of ``prompt`` with each image's ``features`` copied into its
        placeholder rows (what ``LlavaModel`` scatters); only rows of images in ``features`` may be asked for."""
        table = self.model.get_input_embeddings()
        ids = torch.tensor(prompt.token_ids, device=table.weight.device)[None]
        T = self.tokens_per_item

        @torch.inference_mode()
        def embed(start: int, end: int) -> torch.Tensor:
            rows = table(ids[:, start:end])
            for off, f in features.items():
                lo, hi = max(start, off), min(end, off + T)
                if lo < hi:
                    rows[0, lo - start:hi - start] = f[lo - off:hi - off]
            return rows

        return embed

    def serve(self, rid: Hashable, prompt: VlmPrompt, *, max_new_tokens: int = 16, chunk_tokens: int | None = None,
              salt: bytes = b"", names: Sequence[int] | None = None, kv=_SAME, index_output: bool = True,
              on_token: Callable[[int, list], None] | None = None,
              stage: runner.Stage = runner.no_stage) -> runner.Served:
        """``runner.serve`` on ``kv`` (default ``self.kv``; None: the uncached run) with the image digests in the
        chain and the features under ``salt``; TTFT includes digesting, ``stage(modality)`` (``"image"``, or
        ``"video"``) times digests and encoder, ``Served.encoder_hits`` counts the items the tower did not run for."""
        arrival = time.perf_counter()
        kv = self.kv if kv is _SAME else kv
        with stage(self.encoder.modality):
            media = self.media(prompt) if kv is not None else ()
        hits = 0

        def prepare(matched: int) -> runner.Embed:
            nonlocal hits
            with stage(self.encoder.modality):
                features, hits = self.features(prompt, matched, media=media, salt=salt)
            return self.rows(prompt, features)

        served = runner.serve(self.model, kv, rid, prompt.token_ids, max_new_tokens=max_new_tokens,
                              chunk_tokens=chunk_tokens, media=media, names=names, salt=salt, prepare=prepare,
                              arrival=arrival, index_output=index_output, on_token=on_token, stage=stage)
        served.encoder_hits = hits
        return served

    def generate(self, rid: Hashable, prompt: VlmPrompt, *, salt: bytes = b"", **generate_kwargs):
        """``runner.generate`` (``model.generate`` on ``self.kv``) with the image digests in the chain."""
        media = self.media(prompt)
        return runner.generate(self.model, self.kv, rid, prompt.token_ids, media=media, salt=salt,
                               prepare=lambda m: self.embedder(prompt, m, media=media, salt=salt),
                               **generate_kwargs)
