"""Serve a text workload through transformers' continuous-batching engine with up to ``in_flight`` requests at once,
cache off then on, and measure what users would see: nothing here is simulated. What every engine replay shares
(``mstar_serving`` too) is here as well: the report label, a finished request's bookkeeping and the off/on comparison.

Engine: ``workloads.peers.transformers_cb.PeerEngine``. Cache off: the engine with its prefix sharing off (it
computes every prompt token). Cache on: the same engine with mmcache's allocator under it
(``mmcache.hf.continuous_batching``). Both get the same number of KV blocks (the workload's pool), the same prefill
budget per step and greedy decode of the workload's ``max_new_tokens``, so they differ only in the allocator.

Timeline (seconds since the replay started, wall clock): a request arrives at its schedule's time (``trace`` and
``poisson`` arrivals are waited for in real time; under ``closed:C`` a request arrives when it is sent, so it has no
queueing), starts when the engine takes it (``add_request``: an in-flight slot is free and its session's previous
call has finished), and its tokens are the engine's own stamps. So TTFT = queueing + prefill under the load of the
other requests in flight, ITL = gaps between the engine's token stamps, and throughput and goodput are per second of
the real makespan (``metrics``). The records are the harness's ``RequestRecord``s, in completion order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from workloads.harness.metrics import RequestRecord, RequestResult, RunResult
from workloads.harness.progress import progress_bar
from workloads.harness.serving import Observer, Schedule, Workload

if TYPE_CHECKING:  # mmcache.hf imports torch
    from mmcache.hf.paged_kv import PagedKVCache

ENGINE = "transformers continuous batching (ContinuousBatchingManager)"
PREFILL_TOKENS = 256  # tokens per engine step (its max_batch_tokens), as in benchmarks/bench_peer_transformers.py


@runtime_checkable
class TokenWorkload(Workload, Protocol):
    """What the engine serves: a workload whose every request's payload is an int32 prompt (token ids) for one causal
    LM, ``model``, decoded greedily for ``max_new_tokens`` tokens; ``kv``'s pool numbers the engine's KV blocks, of
    ``page_size`` tokens each, and ``outputs`` gets each request's generated ids (the text workloads of
    ``workloads.models``)."""

    model: Any
    kv: PagedKVCache
    page_size: int
    max_new_tokens: int
    outputs: dict[str, list[int]]


def engine_label(schedule: Schedule, in_flight: int, engine: str = ENGINE) -> str:
    """How a run was served, for the report: the engine, the schedule and the requests in flight."""
    return f"{schedule} via {engine}, {in_flight} in flight"


def record_done(run: RunResult, rec: RequestRecord, stats: dict, observer: Observer | None, bar) -> None:
    """A request finished: its record, a pool occupancy sample (from ``stats["prefix"]``, when the cache is on), the
    observer and the progress bar."""
    run.records.append(rec)
    if "prefix" in stats:
        p = stats["prefix"]
        run.occupancy.append((rec.end_s, p["pages_live"], p["pages_cached"], p["pages_free"]))
    if observer is not None:
        observer.observe(run, rec, stats)
    bar.update(1)


def serve_engine_run(workload: TokenWorkload, schedule: Schedule, cached: bool, in_flight: int, *,
                     observer: Observer | None = None, progress: bool = False) -> RunResult:
    """Serve every request of ``workload`` through the engine (mmcache under it when ``cached``), at most
    ``in_flight`` at once (``closed:C``: at most ``min(C, in_flight)``); ``workload.outputs`` gets each output."""
    from workloads.peers.transformers_cb import PeerEngine

    if not isinstance(workload, TokenWorkload):
        raise TypeError(f"{workload.name}: only text workloads serve through the continuous-batching engine")
    from workloads.peers.transformers_cb import Call

    P = workload.page_size
    order, arrivals = schedule.plan(list(workload.requests()))
    calls = [Call(r.rid, r.session, r.payload.tolist()) for r in order]
    by_rid = {r.rid: (r, arrivals[k] if arrivals is not None else None) for k, r in enumerate(order)}
    limit = min(in_flight, schedule.concurrency or in_flight)
    run = RunResult(workload.name, cached, engine_label(schedule, limit), dict(workload.ceilings()))
    if observer is not None:
        observer.start(run)
    bar = progress_bar(len(calls), f"{workload.name}, cache {run.label}, {limit} in flight", enabled=progress)
    engine = PeerEngine(workload.model, share=cached, mmcache=cached, page_size=P,
                        num_blocks=workload.kv.prefix.pool.num_pages, max_batch_tokens=PREFILL_TOKENS,
                        max_new_tokens=workload.max_new_tokens)
    started = time.perf_counter()

    def done(out) -> None:
        req, arrival = by_rid[out.rid]
        start = out.submitted_s - engine.replay_started_s
        arrival = start if arrival is None else arrival
        workload.outputs[req.rid] = out.output_ids
        result = RequestResult(prompt_tokens=req.payload.size, hit_tokens=out.matched_tokens,
                               prompt_pages=req.payload.size // P, hit_pages=out.matched_tokens // P,
                               output_tokens=len(out.output_ids))
        rec = RequestRecord(req.rid, req.session, arrival, start, out.token_s[-1], result, token_s=out.token_s)
        record_done(run, rec, _stats(engine), observer, bar)

    with engine:
        engine.replay(calls, inflight=limit, arrivals=arrivals, on_done=done)
        run.cache_stats = _stats(engine)
    bar.close()
    run.wall_s = time.perf_counter() - started
    return run


def _stats(engine) -> dict:
    cache = engine.prefix_cache
    return {} if cache is None else {"prefix": cache.stats().to_dict()}


def compare_engine(workload_factory: Callable, schedule: Schedule, in_flight: int, *,
                   observer: Observer | None = None, progress: bool = False, serve: Callable | None = None,
                   warm_up: Callable | None = None) -> tuple[RunResult, RunResult, int]:
    """``(off, on, equal)``: cache off, then on, each with a fresh workload and the same schedule and ``in_flight``;
    ``equal`` counts the requests whose outputs are the same in both runs. ``serve(workload, schedule, cached,
    in_flight, observer=, progress=)`` is the engine replay (default ``serve_engine_run``), ``warm_up(workload)``
    what takes first-call costs off the cache-off run (default ``warm``)."""
    serve, warm_up = serve or serve_engine_run, warm_up or warm
    a = workload_factory()
    warm_up(a)
    off = serve(a, schedule, False, in_flight, observer=observer, progress=progress)
    b = workload_factory()
    on = serve(b, schedule, True, in_flight, observer=observer, progress=progress)
    return off, on, sum(a.outputs[r] == b.outputs.get(r) for r in a.outputs)


def warm(workload: TokenWorkload) -> None:
    """One short request through a throwaway engine, so first-call costs land on neither run."""
    from workloads.peers.transformers_cb import Call, PeerEngine

    P = workload.page_size
    with PeerEngine(workload.model, share=False, page_size=P, num_blocks=64, max_batch_tokens=PREFILL_TOKENS,
                    max_new_tokens=2) as e:
        e.replay([Call("warm", "warm", list(range(3, 3 + 4 * P)))])
