"""CSM (Sesame's Conversational Speech Model, ``CsmForConditionalGeneration``) over the runner: its prompt template,
the embedding of text and audio rows, and the frame step the decode loop runs.

Prompt (CSM's chat template, speaker 0 throughout): one segment per line, ``bos "[0]" text eos``, followed for a line
with audio by one ``audio_token`` per frame and one ``audio_eos_token``. Text rows are ``embed_text_tokens`` of the
ids, audio rows the backbone's summed codebook embeddings of the frames, the audio-eos row the embedding of an
all-``codebook_eos`` frame: what ``CsmForConditionalGeneration`` builds from ``input_ids`` and ``input_values``.

A step of the decode loop is one frame: the backbone's last hidden state gives codebook 0 (``lm_head``), the depth
decoder codebooks 1..K-1 (greedy, as ``CsmForConditionalGeneration.generate`` does), and the frame's summed
embedding is fed back to the backbone. Exactness: prefill runs page-aligned chunks (``runner.chunk_spans``) of rows
embedded by the same calls in cached and uncached runs (an audio segment is always embedded whole), so a cached page
was computed by the chunk of exactly that page.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

import digests
from mmcache.hf import runner


@dataclasses.dataclass(frozen=True)
class Template:
    """CSM's prompt template over a tokenizer: ``encode(text)`` gives ids without special tokens."""

    encode: Callable[[str], Sequence[int]]
    bos: int
    eos: int
    audio: int
    audio_eos: int

    @classmethod
    def for_model(cls, model, tokenizer) -> Template:
        """The template of ``model``'s audio tokens over ``tokenizer`` (``encode(list of texts)``, ``bos_id()``,
        ``eos_id()``: a SentencePiece processor or ``workloads.fixtures.HFTokenizer``)."""
        c = model.config
        return cls(lambda s: tokenizer.encode([s])[0], tokenizer.bos_id(), tokenizer.eos_id(), c.audio_token_id,
                   c.audio_eos_token_id)

    def layout(self, lines: Sequence[tuple[str, int | None]]) -> tuple[list[int], list[int]]:
        """Token ids of ``lines`` (text, audio frames or None) and the offset of each audio segment's first frame."""
        ids, offsets = [], []
        for text, frames in lines:
            ids += [self.bos, *self.encode(f"[0]{text}"), self.eos]
            if frames is not None:
                offsets.append(len(ids))
                ids += [self.audio] * frames + [self.audio_eos]
        return ids, offsets


def frames_digest(codes: torch.Tensor) -> digests.Digest:
    """The name of generated frames [frames, K] in a later turn's page chain."""
    return digests.prompt(codes.reshape(-1), {"csm_frames": list(codes.shape)})


class CsmSpeech:
    """Prefill and frame-by-frame decode of one CSM prompt on any ``Cache``."""

    def __init__(self, model):
        self.model = model.eval()
        c = model.config
        with torch.inference_mode():
            eos = torch.full((1, 1, c.num_codebooks), c.codebook_eos_token_id, device=model.device)
            self._eos_row = model.backbone_model.embed_tokens(eos)[0]

    @torch.inference_mode()
    def generate(self, cache: Cache, ids: list[int], audio: Sequence[tuple[int, torch.Tensor]], start: int, *,
                 frames: int, chunk_tokens: int, on_frame: Callable[[int, list], None] | None = None,
                 stage: runner.Stage = runner.no_stage) -> list[torch.Tensor]:
        """``frames`` greedy frames [K] after prefilling ``ids[start:]`` (the cache holds the first ``start``) in
        chunks of ``chunk_tokens``; ``audio``: ``(offset, codes [frames, K])`` of each audio segment. Stages
        ``prefill`` and ``decode``; ``on_frame(step, frames so far)`` after each frame."""
        m = self.model.backbone_model
        x = self.embed(ids, audio, start)
        with stage("prefill"):
            for a, b in runner.chunk_spans(start, len(ids), chunk_tokens):
                # a fresh tensor per chunk: the same alignment in both runs, whatever ``start`` is
                h = m(inputs_embeds=x[:, a - start:b - start].clone(), cache=cache, use_cache=True
                      ).last_hidden_state[:, -1]

        def pick(hidden: torch.Tensor) -> torch.Tensor:
            with stage("decode"):
                return self.frame(hidden)

        def feed(frame: torch.Tensor) -> torch.Tensor:
            with stage("decode"):
                step = m.embed_tokens(frame[None, None])
                return m(inputs_embeds=step, cache=cache, use_cache=True).last_hidden_state[:, -1]

        return runner.greedy(h, pick, feed, frames, on_frame)

    def embed(self, ids: list[int], audio: Sequence[tuple[int, torch.Tensor]], start: int) -> torch.Tensor:
        """``inputs_embeds`` [1, len(ids) - start, hidden] of prompt rows ``[start, len(ids))``. An audio segment that
        reaches past ``start`` is embedded whole (frames, then the audio-eos row), so its rows never depend on
        ``start``."""
        m = self.model
        x = m.embed_text_tokens(torch.tensor(ids[start:], device=m.device)[None])
        for off, codes in audio:
            end = off + len(codes) + 1
            if end > start:
                rows = torch.cat([m.backbone_model.embed_tokens(codes[None])[0], self._eos_row])
                lo = max(off, start)
                x[0, lo - start:end - start] = rows[lo - off:]
        return x

    def frame(self, hidden: torch.Tensor) -> torch.Tensor:
        """One frame's K codes, greedy, from the backbone's last hidden state [1, hidden]: codebook 0 from ``lm_head``,
        codebooks 1..K-1 from the depth decoder fed [placeholder, code 0] with the hidden state in the placeholder's
        row, then one code per step (as ``CsmForConditionalGeneration.generate`` does)."""
        m = self.model
        code = m.lm_head(hidden).argmax(-1, keepdim=True)
        ids, codes = torch.cat([torch.zeros_like(code), code], 1), [code]
        cache, first = DynamicCache(config=m.depth_decoder.config), {"backbone_last_hidden_state": hidden}
        for _ in range(m.config.num_codebooks - 1):
            logits = m.depth_decoder(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **first).logits
            ids, first = logits[:, -1].argmax(-1, keepdim=True), {}
            codes.append(ids)
        return torch.cat(codes, 1)[0]

    @torch.inference_mode()
    def vocode(self, frames: Sequence[torch.Tensor]) -> torch.Tensor:
        """Mimi audio of ``frames`` (each [K]), decoded as one chunk."""
        return self.model.codec_model.decode(torch.stack(list(frames)).T[None]).audio_values[0, 0]
