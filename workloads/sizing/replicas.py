"""Replay a text trace over R data-parallel replicas, each with its own metadata-only PrefixCache, under one router.

The pool: ``pool_tokens`` is the TOTAL, split evenly (each replica gets ``pool_tokens // R``), so every R is compared
at the same total memory and against one pool of that size (R = 1, the reference row).

Per request, in timestamp order: every replica first finishes what has ended by the arrival; a session's previous
call is finished on whichever replica holds it; the router sees the request's page names, prompt length and each
replica's live requests (its queue) and picks a replica, whose ``_Replayer`` admits and runs the request exactly as
the single-pool replay does (``workloads.sizing.replay``).

Service model, per replica: a request's prefill waits for the replica's earlier prefills (one prefill at a time,
FIFO) and takes ``uncached tokens / prefill_tokens_per_s``; ``TTFT = prefill end - arrival`` (admission stalls
included); the request then decodes for ``output_len * s_per_output_token`` and ends. Decodes overlap freely.

Reported: realized hit rate, pages duplicated across replicas (of the distinct prompt pages each replica was ever
sent, the share that another replica was also sent: copies beyond the first; evictions are not subtracted), replica
spread (``mmcache.shadow.ReplicaSpread``), per-replica load (requests routed; peak live), TTFT p50/p99.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from mmcache import Fingerprint, page_names
from mmcache.shadow import ReplicaSpread
from workloads.sizing.ordering import schedule
from workloads.sizing.replay import ReplayRun, _Replayer
from workloads.sizing.routers import make_router
from workloads.sizing.service import ServiceModel
from workloads.traces.text_trace import TextRequest, TextTrace


@dataclasses.dataclass
class ReplicaRun:
    replicas: int
    router: str
    pool_tokens: int              # total over the replicas
    page_size: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    stalls: int = 0
    failed: int = 0
    sent_pages: int = 0           # sum over replicas of the distinct prompt pages each was sent
    distinct_pages: int = 0       # distinct prompt pages over all replicas
    repeated_prefixes: int = 0
    spread_mean: float = 0.0
    spread_max: int = 0
    per_replica_requests: list[int] = dataclasses.field(default_factory=list)
    per_replica_peak_live: list[int] = dataclasses.field(default_factory=list)
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def duplicated(self) -> float:
        """Share of the pages sent to replicas that were copies of a page another replica was also sent."""
        return 1 - self.distinct_pages / self.sent_pages if self.sent_pages else 0.0

    @property
    def load_imbalance(self) -> float:
        """Requests of the busiest replica over the mean (1.0 = even)."""
        r = self.per_replica_requests
        return max(r) * len(r) / sum(r) if sum(r) else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate, "duplicated": self.duplicated,
                "load_imbalance": self.load_imbalance}


class _Replica(_Replayer):
    """One replica's cache and live set, with a FIFO prefill queue for TTFT."""

    def __init__(self, trace: TextTrace, run: ReplayRun, service: ServiceModel):
        super().__init__(trace, run, service)
        self.prefill_free = 0.0
        self.ttfts: list[float] = []
        self.sent: set[int] = set()

    def end_of(self, req: TextRequest, matched: int) -> float:
        begin = max(self.clock, self.prefill_free)
        self.prefill_free = begin + (req.prompt_len - matched) / self.service.prefill_tokens_per_s
        self.ttfts.append(self.prefill_free - req.arrival_s)
        return self.prefill_free + req.output_len * self.service.s_per_output_token


def replay_replicas(trace: TextTrace, *, replicas: int, router: str, page_size: int, pool_tokens: int,
                    service: ServiceModel = ServiceModel(), threshold: int | None = None, key_pages: int | None = None,
                    seed: int = 0) -> ReplicaRun:
    """Replay ``trace`` over ``replicas`` pools of ``pool_tokens // replicas`` tokens each, routed by ``router``."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if trace.page_size is not None and page_size != trace.page_size:
        raise ValueError(f"{trace.kind} traces fix the page size at {trace.page_size}, got {page_size}")
    pages = max(1, pool_tokens // replicas // page_size)
    if pool_tokens // replicas < page_size:
        raise ValueError(f"a pool of {pool_tokens} tokens over {replicas} replicas holds no {page_size}-token page")
    kw = {k: v for k, v in (("threshold", threshold), ("key_pages", key_pages)) if v is not None}
    policy = make_router(router, replicas, page_size, seed=seed, **kw)
    reps = [_Replica(trace, ReplayRun(pages * page_size, pages, page_size, "timestamp", None), service)
            for _ in range(replicas)]
    run = ReplicaRun(replicas, router, pages * page_size * replicas, page_size)
    fp = Fingerprint(model="replay", page_size=page_size)  # the root the replay's caches use
    spread, where = ReplicaSpread(), {}  # where: session -> replica of its live call
    started = time.perf_counter()
    for s, i in schedule(trace.sessions, "timestamp"):
        req = trace.sessions[s].build(i)
        if req.names is None:
            req = dataclasses.replace(req, names=page_names(fp, req.token_ids))
        for rep in reps:
            rep.finish_ended_by(req.arrival_s)
        prev = where.pop(req.session, None)
        if prev is not None and reps[prev].by_session.get(req.session) is not None:
            reps[prev].finish(reps[prev].by_session[req.session])
        pick = policy.choose(req.names, req.prompt_len, [len(r.live) for r in reps], req.arrival_s)
        rep = reps[pick]
        if rep.step(req) is not None:
            where[req.session] = pick
        limit = (req.prompt_len - 1) // page_size
        spread.add(req.names[:limit], pick)
        rep.sent.update(req.names[:limit])
    for rep in reps:
        rep.drain()
    for rep in reps:
        run.requests += rep.run.requests
        run.prompt_tokens += rep.run.prompt_tokens
        run.hit_tokens += rep.run.hit_tokens
        run.stalls += rep.run.stalls
        run.failed += rep.run.failed
        run.per_replica_requests.append(rep.run.requests)
        run.per_replica_peak_live.append(rep.run.peak_live_requests)
    run.sent_pages = sum(len(r.sent) for r in reps)
    run.distinct_pages = len(set().union(*(r.sent for r in reps)))
    run.repeated_prefixes, run.spread_mean, run.spread_max = spread.summary()
    ttfts = np.concatenate([np.asarray(r.ttfts) for r in reps]) if run.requests > run.failed else np.zeros(1)
    run.ttft_p50_s, run.ttft_p99_s = (float(x) for x in np.percentile(ttfts, [50, 99]))
    run.elapsed_s = time.perf_counter() - started
    return run


def format_replica_table(runs: list[ReplicaRun], one_pool: ReplicaRun) -> str:
    """replicas | router | hit % | of one pool % | duplicated % | spread | busiest/mean | TTFT p50 | TTFT p99 |
    stalls | failed; ``one_pool`` is the R = 1 run of the same total pool."""
    head = ("replicas", "router", "hit %", "of one pool %", "dup pages %", "spread", "busiest/mean",
            "TTFT p50 s", "TTFT p99 s", "stalls", "failed")
    rows = [(str(r.replicas), r.router, f"{100 * r.hit_rate:.2f}",
             f"{100 * r.hit_tokens / one_pool.hit_tokens:.1f}" if one_pool.hit_tokens else "-",
             f"{100 * r.duplicated:.1f}", f"{r.spread_mean:.2f}", f"{r.load_imbalance:.2f}",
             f"{r.ttft_p50_s:.3f}", f"{r.ttft_p99_s:.3f}", f"{r.stalls:,}", f"{r.failed:,}")
            for r in [one_pool, *runs]]
    widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(head)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])
