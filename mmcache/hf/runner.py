"""Run one request through a transformers model with a ``PagedKVCache``: admission, page-aligned chunked prefill
of what the cache did not supply, greedy decode, teardown. Every model adapter and workload goes through here.

- ``request`` is the one request lifecycle: admit, yield, finish (written pages go to the index), abort on any
  error: nothing more of a failed request is indexed (the pages its completed forwards wrote were committed as they
  were written, and stay). With ``kv=None`` it is the uncached path: a fresh
  ``DynamicCache``, nothing matched, the same chunk spans after.
- ``greedy`` is the one decode loop: pick a token (a text id, a CSM frame) from the last step's output, report it,
  feed it back, never feeding the last one.
- ``replay`` runs given forward spans on any ``Cache`` then decodes; ``serve`` is ``request`` around ``replay``
  (one request of an engine loop); ``generate`` is ``request`` around ``model.generate``.
Timing hooks come from the caller (``on_token``, ``stage(name)`` context managers), so this module knows nothing of
the serving harness.

Exactness is defined for a schedule. The bits a forward call produces depend on its shape (query rows, cached
positions), so two runs agree bit for bit when every position's K/V came from forward calls over the same spans.
``serve`` prefills ``chunk_spans(matched, n, chunk_tokens)`` (chunks end at multiples of ``chunk_tokens``; ``matched``
is a page boundary) and decodes one token per forward. The uncached run of the same schedule replays the spans that
computed the matched pages (earlier requests' chunks and decode steps), then the cached run's own. With
``chunk_tokens`` equal to the page size every page boundary is a chunk boundary, so that replay always exists; this
is how tests/mmcache/hf/test_bit_exact_gate.py runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, ContextManager, Hashable, Iterator, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from mmcache.errors import InvalidRequest
from mmcache.hf.paged_kv import PagedKVCache

Embed = Callable[[int, int], torch.Tensor]  # (start, end) -> inputs_embeds [1, end - start, hidden]
Prepare = Callable[[int], "Embed | None"]   # matched tokens -> the embed function of the rest (None: input_ids)
Stage = Callable[[str], ContextManager]     # stage(name): a context that times the work inside it


def no_stage(name: str) -> ContextManager:
    return contextlib.nullcontext()


@dataclasses.dataclass
class Served:
    """One request's outcome: generated ids, the last-position logits of every forward call with the token span
    that call covered (prefill chunks, then one span per decode step), the tokens taken from the cache, the time
    from arrival to the first token, and (set by a model adapter) how many encoder outputs it did not compute."""

    output_ids: list[int]
    logits: list[torch.Tensor]
    spans: list[tuple[int, int]]
    matched_tokens: int
    ttft_s: float
    encoder_hits: int = 0


@dataclasses.dataclass
class Lease:
    """What ``request`` yields: the cache to run on, the tokens it already holds, and ``output_ids``, the generated
    tokens whose pages ``finish`` indexes too (leave empty to index the prompt's pages only)."""

    cache: Cache
    matched_tokens: int
    output_ids: Sequence[int] = ()


@contextlib.contextmanager
def request(kv: PagedKVCache | None, rid: Hashable, token_ids, *, config=None, media: Sequence = (),
            names: Sequence[int] | None = None, salt: bytes = b"") -> Iterator[Lease]:
    """The request lifecycle: ``kv.admit`` -> yield a ``Lease`` -> ``kv.finish(rid, lease.output_ids)``; any
    exception in the body aborts the request (its pages are released, nothing more is indexed) and propagates.

    ``kv=None``: the uncached path, a fresh ``DynamicCache(config=config)`` with nothing matched."""
    if kv is None:
        yield Lease(DynamicCache(config=config), 0)
        return
    lease = Lease(kv, kv.admit(rid, token_ids, media=media, salt=salt, names=names).matched_tokens)
    try:
        yield lease
    except BaseException:
        kv.abort(rid)
        raise
    kv.finish(rid, lease.output_ids)


def greedy(first: Any, pick: Callable[[Any], Any], feed: Callable[[Any], Any], max_new_tokens: int,
           on_token: Callable[[int, list], None] | None = None) -> list:
    """The decode loop: ``max_new_tokens`` times, ``pick`` a token from the last step's output (``first``: the
    prefill's), call ``on_token(step, tokens so far)``, then ``feed`` the token to get the next step's output. The
    last token is returned, never fed: its K/V is not computed."""
    out, state = [], first
    for step in range(max_new_tokens):
        out.append(pick(state))
        if on_token is not None:
            on_token(step, out)
        if step + 1 < max_new_tokens:
            state = feed(out[-1])
    return out


def chunk_spans(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut at every multiple of ``chunk_tokens``: where a chunk ends never depends on ``start``."""
    cuts = [start, *range((start // chunk_tokens + 1) * chunk_tokens, end, chunk_tokens), end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]


def serve(model, kv: PagedKVCache | None, rid: Hashable, token_ids, *, max_new_tokens: int = 16,
          chunk_tokens: int | None = None, media: Sequence = (), names: Sequence[int] | None = None,
          salt: bytes = b"", embed: Embed | None = None, prepare: Prepare | None = None,
          arrival: float | None = None, index_output: bool = True,
          on_token: Callable[[int, list], None] | None = None, stage: Stage = no_stage) -> Served:
    """Admit ``rid`` on ``kv``, prefill the unmatched rest in page-aligned chunks of ``chunk_tokens`` (default: one
    page), decode ``max_new_tokens`` greedily, and finish: the prompt's written pages go to the index, and the
    output's too with ``index_output``. Any error aborts the request: nothing more of it is indexed.
    ``kv=None`` is the uncached run of the same schedule (``chunk_tokens`` required).

    ``embed`` feeds ``inputs_embeds`` for prefill chunks instead of ``input_ids`` (VLMs, see ``encoders.llava``);
    ``prepare(matched)``, called after admission, returns it instead when it depends on what was matched;
    ``arrival`` is the ``time.perf_counter()`` the request arrived at (default: now), from which ``ttft_s`` counts.
    """
    arrival = time.perf_counter() if arrival is None else arrival
    chunk = chunk_tokens or (kv.page_size if kv is not None else None)
    if chunk is None:
        raise InvalidRequest("an uncached serve needs chunk_tokens (the cached run's page size)")
    if kv is not None and chunk % kv.page_size:
        raise InvalidRequest(f"chunk_tokens ({chunk}) must be a multiple of the page size ({kv.page_size})")
    with request(kv, rid, token_ids, config=model.config, media=media, names=names, salt=salt) as lease:
        if prepare is not None:
            embed = prepare(lease.matched_tokens)
        served = replay(model, lease.cache, token_ids, chunk_spans(lease.matched_tokens, _length(token_ids), chunk),
                        max_new_tokens=max_new_tokens, embed=embed, arrival=arrival, on_token=on_token, stage=stage)
        if index_output:
            lease.output_ids = served.output_ids
    return served


@torch.inference_mode()
def replay(model, cache: Cache, token_ids, spans: Sequence[tuple[int, int]], *, max_new_tokens: int = 0,
           embed: Embed | None = None, arrival: float | None = None,
           on_token: Callable[[int, list], None] | None = None, stage: Stage = no_stage) -> Served:
    """Forward ``token_ids`` over ``spans`` (contiguous, starting at ``cache.get_seq_length()``; inside
    ``stage("prefill")``), then decode ``max_new_tokens`` greedily, one token per forward. With a fresh
    ``DynamicCache`` and the spans a cached run's prefix came from, this is the uncached run of the same schedule."""
    arrival = time.perf_counter() if arrival is None else arrival
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).to(model.device)
    n, matched = ids.shape[1], cache.get_seq_length()
    spans = [(int(a), int(b)) for a, b in spans]
    starts, ends = [a for a, _ in spans], [b for _, b in spans]
    if (starts != [matched, *ends[:-1]] or any(a >= b for a, b in spans) or (ends and ends[-1] > n)
            or (max_new_tokens and ends[-1:] != [n])):
        raise InvalidRequest(f"spans must cover [{matched}, {n}) contiguously before decoding, got {spans}")
    logits = []
    with stage("prefill"):
        for a, b in spans:
            inputs = {"inputs_embeds": embed(a, b)} if embed is not None else {"input_ids": ids[:, a:b]}
            logits.append(model(**inputs, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
    ttft = time.perf_counter() - arrival

    def feed(token: int) -> torch.Tensor:
        spans.append((spans[-1][1], spans[-1][1] + 1))
        step_ids = torch.tensor([[token]], device=ids.device)
        logits.append(model(input_ids=step_ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1])
        return logits[-1]

    out = greedy(logits[-1] if logits else None, lambda lg: int(lg.argmax()), feed, max_new_tokens, on_token)
    return Served(out, logits, spans, matched, ttft)


@torch.inference_mode()
def generate(model, kv: PagedKVCache, rid: Hashable, token_ids, *, media: Sequence = (),
             names: Sequence[int] | None = None, salt: bytes = b"", prepare: Prepare | None = None,
             **generate_kwargs):
    """``model.generate`` on ``kv`` between admission and teardown; returns what ``generate`` returns.

    ``generate`` skips the matched prefix by itself (from ``get_seq_length()``). With ``prepare``, the prompt goes in
    as ``inputs_embeds`` whose rows before the matched length are zeros, since ``generate`` slices them off
    unread; transformers cannot chunk an ``inputs_embeds`` prefill (``prefill_chunk_size``), text prompts can.
    """
    n = _length(token_ids)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1).to(model.device)
    with request(kv, rid, token_ids, media=media, salt=salt, names=names) as lease:
        inputs, m = {"input_ids": ids}, lease.matched_tokens
        embed = prepare(m) if prepare is not None else None
        if embed is not None:
            rest = embed(m, n)
            inputs["inputs_embeds"] = torch.cat((rest.new_zeros(1, m, rest.shape[-1]), rest), 1)
        out = model.generate(**inputs, cache=kv, **generate_kwargs)
        lease.output_ids = (out if isinstance(out, torch.Tensor) else out.sequences)[0, n:]
    return out


def _length(token_ids) -> int:
    return int(token_ids.numel()) if isinstance(token_ids, torch.Tensor) else len(token_ids)
