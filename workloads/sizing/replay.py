"""Replay a text trace through a metadata-only PrefixCache of a given size and measure the reuse it realizes.

Per request, in the order of ``ordering.schedule``: ``admit`` (its ``matched_tokens`` are the realized reuse),
``grow`` to the prompt, ``mark_computed`` the prompt, ``grow`` to prompt + output, ``mark_computed`` the output
(all but the last sampled token, whose KV an engine never writes), then later ``finish`` with the output ids when
the trace has them (their pages extend the chain), with none otherwise (output pages are held while live but never
indexed).

A page becomes reusable when it is marked computed, as in an engine that indexes pages as they are written: the
prompt's full pages right after admission (the replay prefills at once), the output's at its mark. Finishing a
request releases its pages to the index. Live-request model (when a request is finished):
- always: a session's previous call is finished before its next call is admitted (the agent needs the output);
- ``round-robin``: at most ``in_flight`` requests are live; admitting one more first finishes the oldest. With the
  rotation of ``ordering``, that is the same session's previous call or the last call of a session that ended;
- ``timestamp``: a deterministic service-time model. A request starts at ``max(arrival, clock)`` and is live for
  ``(prompt - matched) / prefill_tokens_per_s + output_len * s_per_output_token`` seconds; before each arrival every
  request that ends by then is finished, earliest end first. Admission is FIFO: a stalled request holds back the
  arrivals behind it (head-of-line), and the clock moves to the ends it waited for.

Stalls: when ``grow`` raises ``OutOfPages`` (live requests alone fill the pool; the cache has already evicted every
cached page it could), the request waits: the earliest-ending live request is finished (advancing the clock in
timestamp order) and ``grow`` retried. A request that waited at least once counts one stall. A request whose prompt
+ output alone needs more pages than the pool is counted as failed and not admitted (its prompt tokens still count
in ``prompt_tokens``, with no hit).

Metrics: an ``observer`` (``CacheObserver``; the Prometheus exporter is one) is told when the fresh cache is made,
then sampled with its statistics (``cache_stats``, the serving workloads' shape: ``prefix`` and, with tiers,
``tiers``) at once, every ``SAMPLE_S`` of replay and at the end.

Realized reuse = ``hit_tokens / prompt_tokens`` where ``hit_tokens`` is the sum of ``matched_tokens`` at admission:
prompt tokens served from the cache instead of prefilled. The ceiling is the same replay with an unbounded pool
(``pool_tokens=None``: pages for every request of the trace at once, so nothing is ever evicted). In round-robin
order, and in timestamp order without stalls, the finish schedule does not depend on the pool, so realized <=
ceiling. A timestamp-order stall finishes requests earlier than the unbounded run would, so a stalled request can
match a little more than in the ceiling run.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Protocol

from mmcache import Fingerprint, OutOfPages, PagePool, PrefixCache
from mmcache.eviction import DEFAULT_POLICY, EvictionPolicy, OfflineOptimal
from mmcache.prefix_index import IndexObserver
from workloads.harness.progress import progress_bar
from workloads.service import ServiceModel
from workloads.sizes import format_size
from workloads.sizing.ordering import schedule
from workloads.sizing.tiers import TierModel
from workloads.traces.text_trace import TextRequest, TextTrace

SAMPLE_S = 0.05  # how often a replay samples its cache for an observer: a tenth of a fast scrape interval


class CacheObserver(Protocol):
    """Told when a replay makes its fresh cache, then given that cache's statistics from time to time."""

    def new_caches(self) -> None: ...

    def sample(self, cache_stats: dict) -> None: ...


@dataclasses.dataclass
class ReplayRun:
    """One replay's counts. ``pool_tokens`` is None for the unbounded (ceiling) pool."""

    pool_tokens: int | None
    pool_pages: int
    page_size: int
    order: str
    in_flight: int | None
    eviction: str = DEFAULT_POLICY
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    eviction_batches: int = 0
    stalls: int = 0
    failed: int = 0
    collisions: int = 0
    peak_live_requests: int = 0
    elapsed_s: float = 0.0
    # tiers (workloads.sizing.tiers): hits served from the host tier and the store (part of hit_tokens), and the
    # TTFT model: uncached prompt tokens at the prefill rate plus tier transfers, summed over admitted requests
    host_tokens: int | None = None
    store_tokens: int | None = None
    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    ttft_sum_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        return self.hit_tokens - self.host_hit_tokens - self.store_hit_tokens

    @property
    def mean_ttft_s(self) -> float:
        admitted = self.requests - self.failed
        return self.ttft_sum_s / admitted if admitted else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate, "device_hit_tokens": self.device_hit_tokens,
                "mean_ttft_s": self.mean_ttft_s}


def pool_pages_for(trace: TextTrace, page_size: int, pool_tokens: int | None) -> int:
    """Pages of a pool of ``pool_tokens`` (rounded down, at least 1); for None, enough pages for every request's
    prompt + output at once, an upper bound on live + cached pages over the whole replay."""
    if pool_tokens is not None:
        return max(1, int(pool_tokens) // page_size)
    return 1 + sum(-(-(c.prompt_len + c.output_len) // page_size) for s in trace.sessions for c in s.calls)


class _Replayer:
    """The state of one replay: the cache, the live requests keyed by end, and the counters."""

    def __init__(self, trace: TextTrace, run: ReplayRun, service: ServiceModel, tiers: TierModel = TierModel(),
                 policy: EvictionPolicy | None = None, observer: IndexObserver | None = None):
        self.trace, self.run, self.service, self.tiers = trace, run, service, tiers
        self.pool = PagePool(run.pool_pages, page_shape=(), eviction=policy or run.eviction)
        fp = Fingerprint(model="replay", page_size=run.page_size)
        self.stack = tiers.build(fp, self.pool, run.page_size)
        self.cache = PrefixCache(self.pool, fp, tiers=self.stack, observer=observer,  # observer: its KV events
                                 page_seconds=run.page_size / service.prefill_tokens_per_s)  # a page hit saves that
        self.live: dict[str, TextRequest] = {}
        self.ends: list[tuple[float, int, str]] = []  # heap of (end, admission seq, rid); stale entries skipped
        self.by_session: dict[str, str] = {}
        self.clock = 0.0
        self.seq = 0

    def finish(self, rid: str) -> None:
        req = self.live.pop(rid)
        if self.by_session.get(req.session) == rid:
            del self.by_session[req.session]
        self.cache.finish(rid, output_ids=req.output_ids if req.output_ids is not None else ())

    def finish_earliest(self) -> None:
        """Finish the live request that ends first; in timestamp order the clock moves to its end."""
        while True:
            end, _, rid = heapq.heappop(self.ends)
            if rid in self.live:
                break
        if self.run.order == "timestamp":
            self.clock = max(self.clock, end)
        self.finish(rid)

    def finish_ended_by(self, t: float) -> None:
        while self.ends and self.ends[0][0] <= t:
            _, _, rid = heapq.heappop(self.ends)
            if rid in self.live:
                self.finish(rid)

    def grow(self, rid: str, tokens: int) -> bool:
        """Grow, finishing earliest-ending requests while live demand exceeds the pool; True if it had to wait."""
        waited = False
        while True:
            try:
                self.cache.grow(rid, tokens)
                return waited
            except OutOfPages:
                if len(self.live) <= 1:  # only this request: cannot happen after the size check in ``step``
                    raise
                waited = True
                self.finish_earliest()

    def step(self, req: TextRequest) -> int | None:
        """Admit ``req`` (finishing what must end first) and run it; its matched tokens, or None if it failed."""
        run, P = self.run, self.run.page_size
        if run.order == "timestamp":
            self.clock = max(self.clock, req.arrival_s)
            self.finish_ended_by(self.clock)
        prev = self.by_session.get(req.session)
        if prev is not None:
            self.finish(prev)
        if run.order == "round-robin":
            while len(self.live) >= run.in_flight:
                self.finish_earliest()
        n, out = req.prompt_len, req.output_len
        run.requests += 1
        run.prompt_tokens += n
        if -(-(n + out) // P) > run.pool_pages:
            run.failed += 1
            return None
        state = self.cache.admit(req.rid, req.token_ids, media=req.marks, names=req.names)
        run.hit_tokens += state.matched_tokens
        host = store = 0
        if state.fetch is not None:
            host, store = state.fetch.host_pages * P, state.fetch.store_pages * P
            run.host_hit_tokens += host
            run.store_hit_tokens += store
        run.ttft_sum_s += (n - state.matched_tokens) / self.service.prefill_tokens_per_s \
            + self.tiers.transfer_s(host, store)
        self.live[req.rid] = req
        self.by_session[req.session] = req.rid
        waited = self.grow(req.rid, n)
        self.cache.mark_computed(req.rid, n)
        waited |= self.grow(req.rid, n + out)
        if out > 1:
            self.cache.mark_computed(req.rid, n + out - 1)
        run.stalls += waited
        run.peak_live_requests = max(run.peak_live_requests, len(self.live))
        heapq.heappush(self.ends, (self.end_of(req, state.matched_tokens), self.seq, req.rid))
        self.seq += 1
        return state.matched_tokens

    def end_of(self, req: TextRequest, matched: int) -> float:
        """When the admitted request ``req`` ends: the service model's duration from now in timestamp order, its
        admission sequence number in round-robin order."""
        if self.run.order == "timestamp":
            return self.clock + self.service.duration(req.prompt_len - matched, req.output_len)
        return float(self.seq)

    def drain(self) -> None:
        while self.live:
            self.finish_earliest()

    def cache_stats(self) -> dict:
        """The cache's statistics in a serving workload's ``cache_stats()`` shape."""
        stats = {"prefix": self.cache.stats().to_dict()}
        if self.stack is not None:
            stats["tiers"] = self.stack.stats().to_dict()
        return stats


def replay_trace(trace: TextTrace, *, page_size: int, pool_tokens: int | None, order: str = "timestamp",
           in_flight: int = 8, service: ServiceModel = ServiceModel(), progress: bool = False,
           tiers: TierModel = TierModel(), observer: CacheObserver | None = None,
           eviction: str | EvictionPolicy = DEFAULT_POLICY, lookups: list[list[int]] | None = None) -> ReplayRun:
    """Replay every call of ``trace`` through a fresh cache of ``pool_tokens`` (None: unbounded) with ``tiers``
    (host tier and store; the unbounded pool never evicts, so it gets none), sampled by ``observer``, evicting by
    ``eviction``: a policy's name (``mmcache.eviction``), or ``"optimal"`` with ``lookups``, the chains a replay of
    the same calls looked up (``LookupRecorder``; the order of lookups does not depend on the pool), or a policy."""
    if eviction == "optimal":
        if lookups is None:
            raise ValueError("eviction 'optimal' needs the lookups of a replay of the same calls (LookupRecorder)")
        policy, name = OfflineOptimal(lookups), "optimal"
    elif isinstance(eviction, str):  # an unknown name fails when the pool is made, before the replay
        policy, name = None, eviction
    else:
        policy, name = eviction, eviction.name
    if trace.page_size is not None and page_size != trace.page_size:
        raise ValueError(f"{trace.kind} traces fix the page size at {trace.page_size}, got {page_size}")
    pages = pool_pages_for(trace, page_size, pool_tokens)
    run = ReplayRun(pool_tokens=None if pool_tokens is None else pages * page_size, pool_pages=pages,
                    page_size=page_size, order=order, in_flight=in_flight if order == "round-robin" else None,
                    eviction=name)
    if pool_tokens is None:
        tiers = TierModel(host_bytes_per_s=tiers.host_bytes_per_s, store_bytes_per_s=tiers.store_bytes_per_s,
                          kv_bytes_per_token=tiers.kv_bytes_per_token)
    run.host_tokens, run.store_tokens = tiers.host_tokens, tiers.store_tokens
    r = _Replayer(trace, run, service, tiers, policy)
    if observer is not None:
        observer.new_caches()
        observer.sample(r.cache_stats())
    started = sampled = time.perf_counter()
    bar = progress_bar(trace.num_requests, f"pool {format_size(pool_tokens)}", enabled=progress)
    for s, i in schedule(trace.sessions, order, in_flight):
        r.step(trace.sessions[s].build(i))
        bar.update(1)
        if observer is not None and time.perf_counter() - sampled >= SAMPLE_S:
            observer.sample(r.cache_stats())
            sampled = time.perf_counter()
    r.drain()
    bar.close()
    if observer is not None:
        observer.sample(r.cache_stats())
    stats = r.cache.stats().to_dict()
    run.evicted_pages, run.eviction_batches = stats["evicted_pages"], stats["eviction_batches"]
    run.collisions = stats["collisions"]
    run.elapsed_s = time.perf_counter() - started
    return run
