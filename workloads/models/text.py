"""What the model-backed text workloads share: the ``TextWorkload`` that serves int32 prompts through a causal LM,
the trace order, the prefix ceiling and the vocabulary check.

Serving (``TextWorkload.serve``): ``mmcache.hf.runner.serve`` with greedy decode of ``options.max_new_tokens`` tokens,
one request at a time. Cache on: a ``PagedKVCache`` admits the prompt, the model is fed only the unmatched rest, and
the prompt's full pages go to the index at the end. Cache off: the runner's uncached path (a fresh ``DynamicCache``
and the whole prompt). Both prefill in page-sized chunks (``chunk_spans``), so a position is computed by the forward
over the same page in both runs. Only prompt pages are indexed: a generated reply enters the index when the next turn
re-sends it as part of its prompt (and prefills it), so every indexed page was written by exactly the forward the
cache-off run computes it with, and cache on and off generate the same tokens, bit for bit (DESIGN.md, correctness
gate), while the cache-off run stays a plain chunked prefill. The price is recomputing each re-sent reply once
(``max_new_tokens`` tokens per turn).
"""

from __future__ import annotations

from typing import Callable, Sequence

from mmcache import ShadowIndex
from mmcache.errors import InvalidRequest
from mmcache.hf import runner
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.module_fingerprint import module_fingerprint
from workloads import fixtures
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request
from workloads.options import ModelWorkloadOptions


def check_vocab(requests: Sequence[Request], ids: Callable[[Request], Sequence[int]], vocab_size: int) -> None:
    """InvalidRequest naming the first request with a token id the model cannot embed."""
    for req in requests:
        top = max(ids(req), default=0)
        if top >= vocab_size:
            raise InvalidRequest(f"request {req.rid!r} has token id {top}, beyond the model's vocabulary of "
                                 f"{vocab_size}: give --model a folder with its own tokenizer")


def trace_order(requests: Sequence[Request]) -> list[Request]:
    """``requests`` in the order the ``trace`` schedule serves them (arrival time, ties in listed order)."""
    return sorted(requests, key=lambda r: r.arrival_s)


def prefix_ceiling(shadow: ShadowIndex) -> float:
    """Prompt tokens an unbounded prefix cache would serve, as a share of all prompt tokens admitted to ``shadow``."""
    prompt = sum(r.prompt_tokens for r in shadow.records)
    return sum(r.matched_pages for r in shadow.records) * shadow.page_size / prompt if prompt else 0.0


def timed(clock: Clock) -> dict:
    """The runner's timing hooks reporting to ``clock``: a token event per generated token, stages by name."""
    return {"on_token": lambda step, out: clock.token(), "stage": clock.stage}


class TextWorkload:
    """Requests whose payload is an int32 prompt, served through one causal LM with a fresh ``PagedKVCache``;
    ``outputs`` maps each completed request to its generated tokens.

    An agent's later calls re-send the recorded replies, not the generated ones, so generated tokens are never
    reused here."""

    def __init__(self, name: str, model, requests: list[Request], options: ModelWorkloadOptions, fingerprint: str):
        self.name, self.model, self._requests = name, model, requests
        self.page_size, self.max_new_tokens = options.page_size, options.max_new_tokens
        self.kv = PagedKVCache.for_model(model, options.pool_pages, options.page_size, fingerprint=fingerprint)
        self.outputs: dict[str, list[int]] = {}
        self._ceilings: tuple[dict, dict] | None = None

    def requests(self) -> list[Request]:
        return self._requests

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        ids, P = req.payload, self.page_size
        served = runner.serve(self.model, self.kv if cached else None, req.rid, ids, max_new_tokens=self.max_new_tokens,
                              chunk_tokens=P, index_output=False, **timed(clock))
        out, matched = served.output_ids, served.matched_tokens
        self.outputs[req.rid] = out
        return RequestResult(prompt_tokens=ids.size, hit_tokens=matched, prompt_pages=ids.size // P,
                             hit_pages=matched // P, output_tokens=len(out))

    def cache_stats(self) -> dict:
        return {"prefix": self.kv.prefix.stats().to_dict()}

    def ceilings(self) -> dict[str, float]:
        """The unbounded-cache prefix hit rate over the prompts in trace order."""
        return self._shadow()[0]

    def ceiling_weights(self) -> dict[str, int]:
        """What each ceiling is a share of (prompt tokens), so a blend of workloads can weigh them."""
        return self._shadow()[1]

    def _shadow(self) -> tuple[dict, dict]:
        if self._ceilings is None:
            shadow = ShadowIndex(self.kv.prefix.fingerprint)
            for req in trace_order(self._requests):
                shadow.admit(req.rid, req.payload)
                shadow.finish(req.rid)
            self._ceilings = ({"prefix": prefix_ceiling(shadow)},
                              {"prefix": sum(r.prompt_tokens for r in shadow.records)})
        return self._ceilings


def text_factory(name: str, options: ModelWorkloadOptions, requests: Callable[[int], list[Request]]):
    """Load the model (tiny Llama unless ``options.model``) and ``requests(vocab_size)`` once; each call of the
    result: a fresh workload (empty caches) over them."""
    model, _ = fixtures.load_llama(options)
    kv_page_shape(model.config, options.page_size)  # ValueError now, for a model whose KV pages cannot stand for
    vocab = model.config.get_text_config(decoder=True).vocab_size
    reqs = requests(vocab)
    check_vocab(reqs, lambda r: r.payload, vocab)
    fingerprint = module_fingerprint(model)
    return lambda: TextWorkload(name, model, reqs, options, fingerprint)
