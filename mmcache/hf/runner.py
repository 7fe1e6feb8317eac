"""Run one request through a transformers causal LM with a ``PagedKVCache``: admission, page-aligned chunked prefill
of what the cache did not supply, greedy decode, teardown.

``serve`` is one request of an engine loop; ``replay`` runs given forward spans on any ``Cache`` (a ``DynamicCache``
for the uncached runs the bit-exact gate compares with); ``generate`` is the same lifecycle around
``model.generate``.

Exactness is defined for a schedule. The bits a forward call produces depend on its shape (query rows, cached
positions), so two runs agree bit for bit when every position's K/V came from forward calls over the same spans.
``serve`` prefills ``chunk_spans(matched, n, chunk_tokens)`` (chunks end at multiples of ``chunk_tokens``; ``matched``
is a page boundary) and decodes one token per forward. The uncached run of the same schedule replays the spans that
computed the matched pages (earlier requests' chunks and decode steps), then the cached run's own. With
``chunk_tokens`` equal to the page size every page boundary is a chunk boundary, so that replay always exists; this
is how tests/test_bit_exact_gate.py runs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Hashable, Sequence

import torch
from transformers.cache_utils import Cache

from mmcache.errors import InvalidRequest

from mmcache.hf.paged_kv import PagedKVCache

Embed = Callable[[int, int], torch.Tensor]  # (start, end) -> inputs_embeds [1, end - start, hidden]


@dataclasses.dataclass
class Served:
    """One request's outcome: generated ids, the last-position logits of every forward call with the token span
    that call covered (prefill chunks, then one span per decode step), the tokens taken from the cache, and the time
    from arrival to the first token."""

    output_ids: list[int]
    logits: list[torch.Tensor]
    spans: list[tuple[int, int]]
    matched_tokens: int
    ttft_s: float


def chunk_spans(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at every multiple of ``chunk_tokens``: where a chunk ends never depends on ``start``."""
    cuts = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def serve(model, kv: PagedKVCache, rid: Hashable, token_ids, *, max_new_tokens: int = 16,
          chunk_tokens: int | None = None, media: Sequence = (), names: Sequence[int] | None = None,
          salt: bytes = b"", embed: Embed | None = None, arrival: float | None = None) -> Served:
    """Admit ``rid`` on ``kv``, prefill the unmatched rest in page-aligned chunks of ``chunk_tokens`` (default: one
    page), decode ``max_new_tokens`` greedily, and finish (written pages go to the index). Any error aborts the
    request, so no page of a failed request is ever indexed.

    ``embed`` feeds ``inputs_embeds`` for prefill chunks instead of ``input_ids`` (VLMs, see ``mmcache.hf.llava``);
    ``arrival`` is the ``time.perf_counter()`` the request arrived at (default: now), from which ``ttft_s`` counts.
    """
    arrival = time.perf_counter() if arrival is None else arrival
    chunk = chunk_tokens or kv.page_size
    if chunk % kv.page_size:
        raise InvalidRequest(f"chunk_tokens ({chunk}) must be a multiple of the page size ({kv.page_size})")
    state = kv.admit(rid, token_ids, media=media, salt=salt, names=names)
    try:
        served = replay(model, kv, token_ids, chunk_spans(state.matched_tokens, _length(token_ids), chunk),
                        max_new_tokens=max_new_tokens, embed=embed, arrival=arrival)
    except BaseException:
        kv.abort(rid)
        raise
    kv.finish(rid, served.output_ids)
    return served


@torch.inference_mode()
def replay(model, cache: Cache, token_ids, spans: Sequence[tuple[int, int]], *, max_new_tokens: int = 0,
           embed: Embed | None = None, arrival: float | None = None) -> Served:
    """Forward ``token_ids`` over ``spans`` (contiguous, starting at ``cache.get_seq_length()``), then decode
    ``max_new_tokens`` greedily, one token per forward. With a fresh ``DynamicCache`` and the spans a cached run's
    prefix came from, this is the uncached run of the same schedule."""
    arrival = time.perf_counter() if arrival is None else arrival
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).to(model.device)
    n, matched = ids.shape[1], cache.get_seq_length()
    spans = [(int(a), int(b)) for a, b in spans]
    starts, ends = [a for a, _ in spans], [b for _, b in spans]
    if (starts != [matched, *ends[:-1]] or any(a >= b for a, b in spans) or (ends and ends[-1] > n)
            or (max_new_tokens and ends[-1:] != [n])):
        raise InvalidRequest(f"spans must cover [{matched}, {n}) contiguously before decoding, got {spans}")
    logits = []
    for a, b in spans:
        inputs = {"inputs_embeds": embed(a, b)} if embed is not None else {"input_ids": ids[:, a:b]}
        logits.append(model(**inputs, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
    ttft = time.perf_counter() - arrival
    out: list[int] = []
    for step in range(max_new_tokens):
        out.append(int(logits[-1].argmax()))
        if step + 1 < max_new_tokens:  # the last token is returned, never fed: its K/V is not computed
            step_ids = torch.tensor([out[-1:]], device=ids.device)
            logits.append(model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
            spans.append((n + step, n + step + 1))
    return Served(out, logits, spans, matched, ttft)


@torch.inference_mode()
def generate(model, kv: PagedKVCache, rid: Hashable, token_ids, *, media: Sequence = (),
             names: Sequence[int] | None = None, salt: bytes = b"", embed: Embed | None = None, **generate_kwargs):
    """``model.generate`` on ``kv`` between admission and teardown; returns what ``generate`` returns.

    ``generate`` skips the matched prefix by itself (from ``get_seq_length()``). With ``embed``, the prompt goes in
    as ``inputs_embeds`` whose rows before the matched length are zeros, since ``generate`` slices them off
    unread; transformers cannot chunk an ``inputs_embeds`` prefill (``prefill_chunk_size``), text prompts can.
    """
    n = _length(token_ids)
    state = kv.admit(rid, token_ids, media=media, salt=salt, names=names)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).to(model.device)
    try:
        inputs = {"input_ids": ids}
        if embed is not None:
            rest = embed(state.matched_tokens, n)
            inputs["inputs_embeds"] = torch.cat((rest.new_zeros(1, state.matched_tokens, rest.shape[-1]), rest), 1)
        out = model.generate(**inputs, cache=kv, **generate_kwargs)
    except BaseException:
        kv.abort(rid)
        raise
    kv.finish(rid, (out if isinstance(out, torch.Tensor) else out.sequences)[0, n:])
    return out


def _length(token_ids) -> int:
    return int(token_ids.numel()) if isinstance(token_ids, torch.Tensor) else len(token_ids)
