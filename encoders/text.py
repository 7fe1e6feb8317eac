"""Cached umT5 prompt encoder for Wan-family diffusers pipelines: a prompt in, ``prompt_embeds`` [1, L, D] out, the
encoder run once per (token ids, tokenizer settings, max length, weights).

Level wrapped: one prompt through ``WanPipeline._get_t5_prompt_embeds`` (diffusers 0.42): ``prompt_clean`` ->
tokenizer(padding="max_length", max_length=L, truncation=True) -> ``text_encoder(ids, mask).last_hidden_state`` ->
cast to the encoder's dtype -> keep the first n rows (n real tokens) -> zero-pad to L. The key is taken after
tokenizing (under a millisecond), so prompts that clean and tokenize alike share an entry and the ids verify every
hit; only the n real rows [n, D] are stored (a 48-token DiffusionDB prompt at L=512: 9% of the padded tensor) and
the zero padding is rebuilt on the way out, bit for bit what the pipeline's own padding gives. Wrapping the
pipeline's ``encode_prompt`` call, rather than hooking the text encoder module, leaves the pipeline untouched: its
``__call__`` takes the result as ``prompt_embeds=`` / ``negative_prompt_embeds=`` and skips its own encode.

Exactness: ``encode(p)`` equals ``pipe.encode_prompt(p, ...)[0]`` with the same ``max_sequence_length`` bit for bit
when run as ``__call__`` runs it, under no_grad (with grad enabled, sdpa takes another CPU kernel and differs in the
last bits); the pipeline encodes the prompt and the negative prompt in separate batches of one. Lists are encoded
one prompt per forward; the pipeline's own batched forward of several prompts may differ from that in the last
bits, so cached and uncached runs are compared on the same per-prompt schedule (``store=None``).

Key of one prompt: ``EncoderKey(digests.prompt(real, params), fingerprint, "text", salt, verify_ids=real)``, where
``real`` are the ids under the attention mask, ``params`` the canonical tokenizer, max length, padding side and pad
id, and ``fingerprint`` the text encoder's ``module_fingerprint``, both computed once. Together they fix
the padded ids and mask, i.e. everything the encoder sees; the cleaning and truncation that produced the ids need
not enter (an ftfy installed in one process and not another changes the ids, never the meaning of a key).
"""

from __future__ import annotations

import torch
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from diffusers.utils.torch_utils import get_module_execution_device
from torch import nn

import digests
from encoders.base import CachedEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.module_fingerprint import module_fingerprint


class CachedPromptEncoder(CachedEncoder):
    """``encode(prompt)`` / ``encode_prompt(prompt, negative_prompt)`` for a Wan-family pipeline, through ``store``;
    ``lookup(prompt)`` gives the n real rows [n, D] as a ``Lookup`` that says whether it hit, ``pad`` the
    ``prompt_embeds`` [1, L, D] of those rows.

    Invariants: a hit equals the miss that stored it bit for bit, and both equal the pipeline's own encode of that one
    prompt; the CFG negative prompt, the same on nearly every request, is encoded once and hit from then on; outputs
    are in the text encoder's dtype on ``device`` (default: the encoder's execution device, as in the pipeline),
    whether computed or gathered. ``store=None`` runs the encoder on every call (the uncached baseline).
    ``max_sequence_length`` must be the one given to the pipeline (``WanPipeline.__call__`` defaults to 512).
    """

    modality, media_kind = "text", "prompt"

    def __init__(self, tokenizer, text_encoder: nn.Module, store: EncoderStore | None, *,
                 max_sequence_length: int = 512, fingerprint: str | None = None, salt: bytes = b"",
                 device: str | torch.device | None = None):
        self.tokenizer, self.text_encoder = tokenizer, text_encoder.eval()
        self.max_sequence_length = int(max_sequence_length)
        self.params = digests.canonical({"tokenizer": tokenizer, "max_length": self.max_sequence_length,
                                         "padding_side": tokenizer.padding_side, "pad": tokenizer.pad_token_id})
        super().__init__(store, module_fingerprint(text_encoder) if fingerprint is None else fingerprint, salt=salt,
                         device=device if device is not None else get_module_execution_device(text_encoder),
                         dtype=text_encoder.dtype)

    @classmethod
    def from_pipeline(cls, pipe, store: EncoderStore | None, **kwargs) -> CachedPromptEncoder:
        """The pipeline's tokenizer and text encoder, with outputs on its execution device."""
        kwargs.setdefault("device", pipe._execution_device)
        return cls(pipe.tokenizer, pipe.text_encoder, store, **kwargs)

    def encode(self, prompt: str, *, salt: bytes | None = None) -> torch.Tensor:
        """``prompt_embeds`` [1, max_sequence_length, D] of one prompt: its n real rows, then zeros."""
        return self.pad(self(prompt, salt=salt))

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        """[n, D] real rows -> ``prompt_embeds`` [1, max_sequence_length, D], zero-padded as the pipeline pads."""
        return torch.cat([rows, rows.new_zeros(self.max_sequence_length - rows.size(0), rows.size(1))])[None]

    def encode_prompt(self, prompt: str | list[str], negative_prompt: str | list[str] | None = None, *,
                      do_classifier_free_guidance: bool = True, num_videos_per_prompt: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(prompt_embeds, negative_prompt_embeds)`` as ``WanPipeline.encode_prompt`` returns them (the negative is
        None without guidance, "" when not given), for ``pipe(prompt_embeds=..., negative_prompt_embeds=...)``."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        embeds = self._batch(prompts, num_videos_per_prompt)
        if not do_classifier_free_guidance:
            return embeds, None
        negative = negative_prompt or ""
        negative = len(prompts) * [negative] if isinstance(negative, str) else list(negative)
        if len(negative) != len(prompts):
            raise ValueError(f"negative_prompt has batch size {len(negative)}, prompt has {len(prompts)}")
        return embeds, self._batch(negative, num_videos_per_prompt)

    def read(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt is read by tokenizing it (``tokenize``)."""
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a str, got {type(prompt).__qualname__}")
        return self.tokenize(prompt)

    def tokenize(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids, attention_mask)`` [1, max_sequence_length] of the cleaned prompt, as the pipeline makes
        them."""
        inputs = self.tokenizer(prompt_clean(prompt), padding="max_length", max_length=self.max_sequence_length,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        return inputs.input_ids, inputs.attention_mask

    def compute(self, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The uncached encode of ``tokenize``'s ``(ids, mask)``: the first n rows [n, D] of the encoder's output, n
        the real tokens in ``mask``, cast as the pipeline casts them."""
        ids, mask = data
        device = get_module_execution_device(self.text_encoder)
        with torch.inference_mode():
            hidden = self.text_encoder(ids.to(device), mask.to(device)).last_hidden_state
        return hidden.to(dtype=self.dtype, device=self.device)[0, :int(mask.gt(0).sum())]

    def digest(self, data) -> digests.Digest:
        return digests.prompt(self.verify_ids(data), self.params)

    def verify_ids(self, data) -> torch.Tensor:
        ids, mask = data  # the real ids: with L and the padding side in params, they fix the padded ids and mask
        return ids[0][mask[0].gt(0)]

    def _batch(self, prompts: list[str], num_videos_per_prompt: int) -> torch.Tensor:
        """One forward per prompt, stacked and repeated per video as the pipeline repeats them."""
        embeds = torch.cat([self.encode(p) for p in prompts])
        return embeds.repeat(1, num_videos_per_prompt, 1).view(len(prompts) * num_videos_per_prompt,
                                                               self.max_sequence_length, -1)
