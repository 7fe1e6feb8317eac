"""Serve an M* workload (``voice-mstar``, ``vlm-mstar``) through M*'s real ``Engine`` with up to ``in_flight``
requests at once, cache off then on, and measure what users would see: nothing here is simulated.

Engine: one M* ``Engine`` (mstar-ai 0.2.1) holding the workload's nodes, built by the workload's steps
(``workload.steps(cached, sampled)``: ``orpheus_steps.OrpheusSteps``, ``thinker_steps.ThinkerSteps``). Cache off: M*'s
own ``KVSpec`` (``KVManager``: it computes every prompt row). Cache on: the same model after ``enable_reuse``
(``ReuseKVManager`` over mmcache's pool; encoder nodes behind mmcache's ``CachedEncoderNode``). Both hold the
workload's ``pool_pages`` KV pages of ``page_size`` tokens. On a CPU machine M*'s flashinfer and triton kernels are
torch stand-ins (``workloads.peers.mstar_cpu_kernels``); nothing else is.

One loop, as M*'s worker drives the engine, one iteration a step: admit what may start (``admission.Admission``:
in-flight slots, sessions, arrivals; ``steps.start`` adds each to the engine), then ``steps.step``: the batches of one
worker iteration for every request in flight (the workload's walks: see its steps module), each new token stamped
when the batch that sampled it returns. A request ends when ``steps.done`` says so; then ``steps.finish`` (M*'s
``remove_request``, its outputs kept). Every request generates exactly the workload's tokens (greedy, no stop), so
under ``closed:N`` both runs make the same batches step for step, which is what makes their outputs comparable bit for
bit.

Timeline (seconds since the replay started, wall clock): a request arrives at its schedule's time (trace and poisson
arrivals are waited for in real time; under ``closed:C`` a request arrives when it is sent), starts when admitted (what
M*'s data worker does for it, e.g. decoding and preprocessing its images, is timed from there), its tokens are stamped
when the step that sampled them returns, its audio when the decoder batch that made it returns. TTFT = queueing + the
prefill under the load of the others; TTFA = queueing + the first audio chunk; ITL = gaps between token stamps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Protocol

import torch

from mmcache.errors import MmcacheError
from workloads.admission import Admission
from workloads.harness.engine_serving import compare_engine, engine_label, record_done
from workloads.harness.metrics import RequestRecord, RequestResult, RunResult
from workloads.harness.progress import progress_bar
from workloads.harness.serving import Observer, Schedule


@dataclasses.dataclass(eq=False)
class Live:
    """One request in flight: its stamps (seconds after its start), what it generated, the prompt rows it holds and
    computed, and what its steps keep for it (``state``)."""

    req: object
    k: int                       # its index in the planned order
    arrival: float | None
    start: float
    prompt_rows: int = 0         # rows its prefill feeds cold
    computed: int = 0            # of them, the rows its prefill computed
    tokens: list = dataclasses.field(default_factory=list)
    token_s: list = dataclasses.field(default_factory=list)
    audio_s: list = dataclasses.field(default_factory=list)
    state: object = None

    def add(self, token: int, at: float) -> None:
        self.tokens.append(token)
        self.token_s.append(at - self.start)


class Steps(Protocol):
    """What drives one workload's nodes through one M* ``Engine`` (``engine``)."""

    engine: object

    def start(self, lv: Live) -> None:
        """``lv`` was admitted: add it to the engine, set ``prompt_rows`` and ``state``; an ``MmcacheError`` (its media
        or history missing) before it is added fails that request alone."""

    def step(self, live: dict[str, Live], clock) -> None:
        """One worker iteration over every request in ``live``; ``clock()``: seconds since the replay started."""

    def done(self, lv: Live) -> bool:
        ...

    def finish(self, lv: Live) -> RequestResult:
        """``lv`` is done: remove it from the engine, keep its outputs in the workload, report it."""

    def stats(self) -> dict:
        """The cache's stats (``{"prefix": ..., ...}``; ``{}`` with the cache off)."""


def serve_mstar_run(workload, schedule: Schedule, cached: bool, in_flight: int, *, observer: Observer | None = None,
                    progress: bool = False) -> RunResult:
    """Serve every request of ``workload`` through M*'s engine, reuse on when ``cached``, at most ``in_flight`` at
    once (``closed:C``: at most ``min(C, in_flight)``); the workload's ``outputs`` get each request's tokens."""
    from workloads.peers import mstar_cpu_kernels

    order, arrivals = schedule.plan(list(workload.requests()))
    limit = min(in_flight, schedule.concurrency or in_flight)
    cpu = not torch.cuda.is_available()
    with _quiet_mstar(), mstar_cpu_kernels.installed() if cpu else contextlib.nullcontext() as sampled:
        run = RunResult(workload.name, cached, engine_label(schedule, limit, workload.engine),
                        dict(workload.ceilings()), planned=len(order))  # ceilings may use M*'s classes: in here
        if observer is not None:
            observer.start(run)
        bar = progress_bar(len(order), f"{workload.name}, cache {run.label}, {limit} in flight", enabled=progress)
        steps = workload.steps(cached, sampled)
        started = time.perf_counter()
        _loop(steps, order, arrivals, limit, run, observer, bar)
        run.wall_s = time.perf_counter() - started
        run.cache_stats = steps.stats()
        steps.engine.shutdown()
    bar.close()
    return run


def _loop(steps: Steps, order, arrivals, limit: int, run: RunResult, observer, bar) -> None:
    admission = Admission([r.session for r in order], arrivals, limit)
    live: dict[str, Live] = {}
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    while admission or live:
        for k in admission.take(clock()):
            req = order[k]
            lv = Live(req, k, None if arrivals is None else arrivals[k], clock())
            try:
                steps.start(lv)
            except MmcacheError as e:  # its media or its history is missing: it fails alone, the replay goes on
                admission.finished(k)
                rec = RequestRecord(req.rid, req.session, lv.start if lv.arrival is None else lv.arrival, lv.start,
                                    clock() - lv.start, error=str(e), error_type=type(e).__name__)
                record_done(run, rec, steps.stats(), observer, bar)
                continue
            live[req.rid] = lv
        if not live:
            time.sleep(admission.wait_s(clock()) or 1e-3)
            continue
        steps.step(live, clock)
        for rid in [rid for rid, lv in live.items() if steps.done(lv)]:
            lv = live.pop(rid)
            result = steps.finish(lv)
            admission.finished(lv.k)
            end = max(lv.token_s[-1], lv.audio_s[-1] if lv.audio_s else 0.0)
            rec = RequestRecord(rid, lv.req.session, lv.start if lv.arrival is None else lv.arrival, lv.start, end,
                                result, token_s=tuple(lv.token_s), audio_s=tuple(lv.audio_s))
            record_done(run, rec, steps.stats(), observer, bar)


@contextlib.contextmanager
def _quiet_mstar():
    """M*'s loggers at ERROR while it runs: its hub lookup of a local folder and "no CUDA, no graph capture" warn."""
    logger = logging.getLogger("mstar")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def warm(workload) -> None:
    """The first listed request (a session's first: sessions are listed in turn order), alone through a throwaway
    engine with reuse on (so both paths' first calls are paid), so first-call costs land on neither measured run."""
    first = workload.requests()[0]
    serve_mstar_run(dataclasses.replace(workload.made, requests=(first,))(), Schedule(), True, 1)


def compare_mstar(workload_factory, schedule: Schedule, in_flight: int, *, observer: Observer | None = None,
                  progress: bool = False) -> tuple[RunResult, RunResult, int]:
    """``(off, on, equal)`` through M*'s engine (``engine_serving.compare_engine`` with this replay): ``equal``
    counts the requests whose generated token ids are the same with reuse off and on."""
    return compare_engine(workload_factory, schedule, in_flight, observer=observer, progress=progress,
                          serve=serve_mstar_run, warm_up=warm)
