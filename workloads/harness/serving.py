"""Serve a workload's requests on an arrival schedule with its caches off or on, and measure what users would see.

Scheduler: one request at a time, FIFO in arrival order. Arrival times are simulated; service times are measured:
``serve`` runs the real model and the wall clock of that call is the request's service time. So a request starts at
``max(arrival, end of the previous request)``, its queueing delay is start - arrival, and every latency is queueing
plus measured offsets (see ``metrics``). Nothing sleeps: a replay takes as long as its model calls.

Schedules (``Schedule``, or ``Schedule.parse`` of ``trace`` | ``poisson:RATE`` | ``closed:N``):
- ``trace``: each request's own ``arrival_s``, shifted so the first is 0, served in arrival order (ties: listed order);
- ``poisson``: exponential gaps at ``rate`` requests/s from a generator seeded with ``seed``, in listed order;
- ``closed``: ``concurrency`` clients; the first that many requests arrive at 0, then each client sends the next
  listed request when its previous one ends.
``compare`` runs the cache off, then on, each with a fresh workload from the factory and the same schedule: an
open-loop schedule (trace, poisson) gives both runs identical arrival times; closed-loop gives them the same order and
client count, and arrivals follow completions (as in any closed-loop benchmark), so they move with the service times.

Sessions: a workload lists a session's turns in causal order, and trace timestamps must not put a later turn first.
FIFO then serves turn i+1 after turn i has ended, even when a Poisson arrival puts it earlier.

Failures: an ``MmcacheError`` from ``serve`` (a missing media file, a bad trace line) fails that request only: it is
recorded with a message naming the request, holds the server for the time it ran, and the replay goes on. Any other
exception is a bug and propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import time
from typing import Any, Callable, Iterable, Protocol

import numpy as np

from mmcache.errors import MmcacheError
from workloads.harness.metrics import RequestRecord, RequestResult, RunResult
from workloads.harness.progress import progress_bar

SCHEDULES = ("trace", "poisson", "closed")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request of a workload; ``payload`` is whatever its ``serve`` needs (prompt, media paths, outputs)."""

    rid: str
    session: str
    arrival_s: float
    payload: Any = None


class Clock:
    """Event times of one request's service, in seconds since its start (``time.perf_counter``).

    A workload calls ``token()`` when each output token is ready and ``audio_chunk()`` when each audio chunk is, and
    times work with ``with clock.stage(name):``, naming encoder work by its modality (``"image"``, ``"audio"``,
    ``"speaker"``, ``"text"``) and prefill ``"prefill"``; the report compares stage totals with the cache off and on.
    """

    def __init__(self):
        self._t0 = time.perf_counter()
        self.token_s: list[float] = []
        self.audio_s: list[float] = []
        self.stages: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def token(self) -> None:
        self.token_s.append(self.elapsed())

    def audio_chunk(self) -> None:
        self.audio_s.append(self.elapsed())

    @contextlib.contextmanager
    def stage(self, name: str):
        """Add the wall time of the ``with`` body to ``stages[name]`` (stages may repeat and nest)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.stages[name] = self.stages.get(name, 0.0) + time.perf_counter() - t


class Workload(Protocol):
    """What the serving loop drives. A factory builds a fresh one per run, so caches start empty; it may share the
    model weights between the runs it builds, and should warm the model up (first-call costs would land on the
    cache-off run, which goes first).

    ``serve(req, cached, clock)`` runs the real model for ``req``, with the caches when ``cached`` and bypassing them
    (computing everything) when not, reports events on ``clock`` and returns a ``RequestResult``. It may raise an
    ``MmcacheError`` for a bad request, after leaving its caches consistent (aborting what it admitted).
    ``cache_stats()`` is ``{"prefix": PrefixCache.stats().to_dict(), "encoder": EncoderStore.stats().to_dict(),
    "tiers": TierStack.stats().to_dict()}`` (a cache the workload does not have is left out); ``ceilings()`` maps
    ``"prefix"`` (tokens) and encoder modalities (items) to the hit rate an unbounded cache would realize on
    ``requests()``.
    """

    name: str

    def requests(self) -> Iterable[Request]: ...

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult: ...

    def cache_stats(self) -> dict: ...

    def ceilings(self) -> dict[str, float]: ...


class Observer(Protocol):
    """Told when a run starts and after each request, with the workload's ``cache_stats()`` at that point."""

    def start(self, run: RunResult) -> None: ...

    def observe(self, run: RunResult, record: RequestRecord, cache_stats: dict) -> None: ...


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How requests arrive (see the module docstring): ``kind`` is one of ``SCHEDULES``; ``rate`` (requests/s) and
    ``seed`` are for ``poisson``, ``concurrency`` for ``closed``."""

    kind: str = "trace"
    rate: float | None = None
    concurrency: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule kind must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.kind == "poisson" and not (self.rate is not None and math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"a poisson schedule needs a finite rate > 0, got {self.rate!r}")
        if self.kind == "closed" and not (self.concurrency is not None and self.concurrency >= 1):
            raise ValueError(f"a closed schedule needs a concurrency >= 1, got {self.concurrency!r}")
        if (self.rate is not None) != (self.kind == "poisson") or (self.concurrency is not None) != (
                self.kind == "closed"):
            raise ValueError("only a poisson schedule takes a rate, only a closed one a concurrency")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> Schedule:
        """``trace``, ``poisson:RATE`` (requests/s) or ``closed:N`` (clients); ValueError on anything else."""
        kind, _, arg = str(text).strip().partition(":")
        if kind == "trace" and not arg:
            return cls()
        number, what = {"poisson": (float, "a rate in requests/s > 0, e.g. poisson:2.5"),
                        "closed": (int, "a whole number of clients >= 1, e.g. closed:4")}.get(kind, (None, None))
        if number is None:
            raise ValueError(f"not a schedule: {text!r} (use trace, poisson:RATE or closed:N)")
        try:
            value = number(arg)
            return cls("poisson", rate=value, seed=seed) if kind == "poisson" else cls("closed", concurrency=value)
        except ValueError:
            raise ValueError(f"bad schedule {text!r}: {kind} takes {what}") from None

    def __str__(self) -> str:
        if self.kind == "poisson":
            return f"poisson:{self.rate:g} (seed {self.seed})"
        return f"closed:{self.concurrency}" if self.kind == "closed" else "trace"

    def plan(self, requests: list[Request]) -> tuple[list[Request], list[float] | None]:
        """The service order, and each request's arrival time for an open-loop schedule (None for ``closed``)."""
        if self.kind == "trace":
            order = sorted(requests, key=lambda r: r.arrival_s)
            t0 = order[0].arrival_s if order else 0.0
            return order, [r.arrival_s - t0 for r in order]
        if self.kind == "poisson":
            gaps = np.random.default_rng(self.seed).exponential(1 / self.rate, len(requests))
            return requests, np.cumsum(gaps).tolist()
        return requests, None


def serve_run(workload_factory: Callable[[], Workload], schedule: Schedule, cached: bool, *,
           observer: Observer | None = None, progress: bool = False) -> RunResult:
    """Serve every request of a fresh ``workload_factory()`` on ``schedule``, its caches on when ``cached``.

    Records come in service order; pool occupancy is sampled from ``cache_stats()["prefix"]`` after each request.
    Ctrl-C (KeyboardInterrupt) ends the run with the requests served so far (``run.interrupted``).
    """
    wl = workload_factory()
    order, arrivals = schedule.plan(list(wl.requests()))
    run = RunResult(wl.name, cached, str(schedule), dict(wl.ceilings()), planned=len(order))
    if observer is not None:
        observer.start(run)
    clients = [0.0] * (schedule.concurrency or 0)  # closed loop: heap of the times clients send their next request
    bar = progress_bar(len(order), f"{wl.name}, cache {run.label}", enabled=progress)
    started = time.perf_counter()
    try:
        _serve_all(wl, order, arrivals, clients, cached, run, observer, bar)
    except KeyboardInterrupt:  # Ctrl-C: keep what was served; run.interrupted says the rest was not
        pass
    bar.close()
    run.cache_stats = wl.cache_stats()
    run.wall_s = time.perf_counter() - started
    return run


def _serve_all(wl: Workload, order: list[Request], arrivals: list[float] | None, clients: list[float], cached: bool,
               run: RunResult, observer: Observer | None, bar) -> None:
    free = 0.0  # when the server finishes the request before
    for k, req in enumerate(order):
        arrival = arrivals[k] if arrivals is not None else heapq.heappop(clients)
        clock = Clock()
        try:
            result, error, kind = wl.serve(req, cached, clock), None, None
        except MmcacheError as e:
            result, error, kind = None, f"request {req.rid!r}: {e}", type(e).__name__
        service = clock.elapsed()
        if error is None and not isinstance(result, RequestResult):
            raise TypeError(f"{wl.name}.serve returned {type(result).__name__} for request {req.rid!r}, "
                            f"not a RequestResult")
        rec = RequestRecord(req.rid, req.session, arrival, max(arrival, free), service, result, error,
                            tuple(clock.token_s), tuple(clock.audio_s), dict(clock.stages), kind)
        free = rec.end_s
        if arrivals is None:
            heapq.heappush(clients, free)
        stats = wl.cache_stats()
        run.records.append(rec)
        if "prefix" in stats:
            p = stats["prefix"]
            run.occupancy.append((free, p["pages_live"], p["pages_cached"], p["pages_free"]))
        if observer is not None:
            observer.observe(run, rec, stats)
        bar.update(1)


def compare(workload_factory: Callable[[], Workload], schedule: Schedule, *, observer: Observer | None = None,
            progress: bool = False) -> tuple[RunResult, RunResult]:
    """``(off, on)``: the cache off, then on, each with a fresh workload and the same ``schedule``. When Ctrl-C
    stopped the cache-off run, the cache-on run is not started: ``on`` is empty, with ``on.interrupted`` set."""
    off = serve_run(workload_factory, schedule, False, observer=observer, progress=progress)
    if off.interrupted:
        return off, RunResult(off.workload, True, off.schedule, off.ceilings, planned=off.planned)
    return off, serve_run(workload_factory, schedule, True, observer=observer, progress=progress)
