"""Replay a text trace through a metadata-only PrefixCache of a given size and measure the reuse it realizes.

Calls reach the cache in the order and with the requests in service that ``workloads.sizing.ordering.Serving`` sets.
Per request: ``admit`` (its ``matched_tokens`` are the realized reuse), ``grow`` to the prompt, ``mark_computed`` the
prompt, ``grow`` to prompt + output, ``mark_computed`` the output (all but the last sampled token, whose KV an engine
never writes); when it completes, ``finish`` with the output ids when the trace has them (their pages extend the
chain), with none otherwise (output pages are held while it is served but never indexed).

As in an engine, a request holds its pages from its admission until it completes, and a page becomes reusable when it
is marked computed: the prompt's full pages right after admission (the replay prefills at once), the output's at its
mark. Between a session's calls nothing of it is held, only cached (unless ``pin_sessions``). A session's previous
call has completed before its next call is admitted (the agent needs the output). In timestamp and closed order a
request completes ``(prompt - matched) / prefill_tokens_per_s + output_len * s_per_output_token`` seconds after it
starts, and starts at its arrival, or when a place in service frees (first come, first served: a waiting request
holds back the arrivals behind it); in round-robin order it completes when a later request needs its place.

Stalls: when ``grow`` raises ``OutOfPages`` (held requests alone fill the pool; the cache has already evicted every
cached page it could), the request waits: a pinned session's call is released, else the earliest-ending request in
service completes (advancing the clock in clocked orders), and ``grow`` is retried. A request that waited at least
once counts one stall. A request whose prompt + output alone needs more pages than the pool is counted as failed and
not admitted (its prompt tokens still count in ``prompt_tokens``, with no hit).

The offline optimum (``eviction="optimal"``) replays the same calls: a policy with a ``begin(request)`` method is told
the position of every call in the order before it is served (failed ones too), which is how ``LookupRecorder`` files
each call's lookups and ``OfflineOptimal`` knows where in the future it stands; the lookups of calls that fail at a
size are left out of that size's future.

Metrics: an ``observer`` (``CacheObserver``; the Prometheus exporter is one) is told when the fresh cache is made,
then sampled with its statistics (``cache_stats``, the serving workloads' shape: ``prefix`` and, with tiers,
``tiers``) at once, every ``SAMPLE_S`` of replay and at the end.

Realized reuse = ``hit_tokens / prompt_tokens`` where ``hit_tokens`` is the sum of ``matched_tokens`` at admission:
prompt tokens served from the cache instead of prefilled. The ceiling is the same replay with an unbounded pool
(``pool_tokens=None``: pages for every request of the trace at once, so nothing is ever evicted). Where no request
stalls, what is held when does not depend on the pool, so realized <= ceiling; a stall completes requests earlier
than the unbounded run would, so a stalled request can match a little more than in the ceiling run.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from typing import Protocol

from mmcache import Fingerprint, OutOfPages, PagePool, PrefixCache
from mmcache.eviction import DEFAULT_POLICY, Eviction, OfflineOptimal, check_policy, policy_name
from mmcache.index_types import IndexObserver
from workloads.harness.progress import progress_bar
from workloads.service import ServiceModel
from workloads.sizes import format_size
from workloads.sizing.encoders import EncoderPlace
from workloads.sizing.ordering import Serving, schedule
from workloads.sizing.tiers import TierModel
from workloads.traces.text_trace import TextRequest, TextTrace

SAMPLE_S = 0.05  # how often a replay samples its cache for an observer: a tenth of a fast scrape interval


class CacheObserver(Protocol):
    """Told when a replay makes its fresh cache, then given that cache's statistics from time to time."""

    def new_caches(self) -> None: ...

    def sample(self, cache_stats: dict) -> None: ...


@dataclasses.dataclass
class ReplayRun:
    """One replay's counts. ``pool_tokens`` is None for the unbounded (ceiling) pool; ``sessions`` is None in timestamp
    order, ``in_service`` None where nothing caps it."""

    pool_tokens: int | None
    pool_pages: int
    page_size: int
    order: str
    sessions: int | None
    in_service: int | None = None
    pin_sessions: bool = False
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
    # encoder outputs (``encoders``: workloads.sizing.encoders): media items of admitted requests, of which inside
    # the matched prefix and found in the encoder store (the rest ran)
    encoder_items: int = 0
    encoder_in_prefix: int = 0
    encoder_store_hits: int = 0

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


class ReplayObserver(Protocol):
    """Told of every call a replay serves, in order (``replay_trace(..., watch=)``): what a prototype or a report
    needs beside the cache's own statistics."""

    def served(self, request: int, req: TextRequest, matched: int | None, encoder_runs: int) -> None:
        """Call number ``request`` of the order was admitted with ``matched`` tokens from the cache (None: it failed,
        too large for the pool) and ran the encoder for ``encoder_runs`` of its media items (with ``encoders``)."""


class Replayer:
    """The state of one replay: the cache, the requests it holds (in service, keyed by end; pinned sessions' last
    calls) and the counters."""

    def __init__(self, trace: TextTrace, run: ReplayRun, service: ServiceModel, tiers: TierModel = TierModel(),
                 policy: Eviction = None, observer: IndexObserver | None = None,
                 serving: Serving = Serving(), encoders: EncoderPlace | None = None, encoder_observer=None):
        self.trace, self.run, self.service, self.tiers, self.serving = trace, run, service, tiers, serving
        self.pool = PagePool(run.pool_pages, page_shape=(), eviction=run.eviction if policy is None else policy)
        self.begin = getattr(self.pool.policy, "begin", None)  # a replay-aware policy is told each call's position
        fp = Fingerprint(model="replay", page_size=run.page_size)
        self.stack = tiers.build(fp, self.pool, run.page_size)
        self.cache = PrefixCache(self.pool, fp, tiers=self.stack, observer=observer,  # observer: its KV events
                                 page_seconds=run.page_size / service.prefill_tokens_per_s)  # a page hit saves that
        self.encoders = None if encoders is None else encoders.build(self.pool, service.encoder_s, encoder_observer)
        self.encoded = 0  # the encoder runs of the request admitted last
        self.live: dict[str, TextRequest] = {}        # every request held: in service or pinned
        self.ends: list[tuple[float, int, str]] = []  # heap of (end, admission seq, rid) of those in service
        self.pinned: dict[str, None] = {}              # rids held after they completed (pin_sessions), oldest first
        self.more: set[str] = set()                    # rids whose session has a later call
        self.by_session: dict[str, str] = {}
        self.clock = 0.0
        self.seq = 0        # admissions
        self.position = 0   # calls served, failed ones included

    @property
    def in_service(self) -> int:
        return len(self.live) - len(self.pinned)

    def finish(self, rid: str) -> None:
        """Release a held request: its pages go to the index."""
        req = self.live.pop(rid)
        self.pinned.pop(rid, None)
        self.more.discard(rid)
        if self.by_session.get(req.session) == rid:
            del self.by_session[req.session]
        self.cache.finish(rid, output_ids=req.output_ids if req.output_ids is not None else ())

    def complete(self, rid: str) -> None:
        """A request's service ended: released, or held as its session's pinned call."""
        if self.serving.pin_sessions and rid in self.more:
            self.pinned[rid] = None
        else:
            self.finish(rid)

    def complete_earliest(self) -> None:
        """Complete the request in service that ends first; in clocked orders the clock moves to its end."""
        while True:
            end, _, rid = heapq.heappop(self.ends)
            if rid in self.live and rid not in self.pinned:
                break
        if self.serving.clocked:
            self.clock = max(self.clock, end)
        self.complete(rid)

    def finish_ended_by(self, t: float) -> None:
        """Complete every request in service that ends by ``t``."""
        while self.ends and self.ends[0][0] <= t:
            _, _, rid = heapq.heappop(self.ends)
            if rid in self.live and rid not in self.pinned:
                self.complete(rid)

    def make_way(self) -> bool:
        """Release something held so a stalled request may grow: the oldest pinned call, else the earliest-ending
        request in service; False when nothing else is held."""
        if self.pinned:
            self.finish(next(iter(self.pinned)))
            return True
        if self.in_service <= 1:  # only the stalled request itself
            return False
        self.complete_earliest()
        return True

    def grow(self, rid: str, tokens: int) -> bool:
        """Grow, making way while held requests fill the pool; True if it had to wait."""
        waited = False
        while True:
            try:
                self.cache.grow(rid, tokens)
                return waited
            except OutOfPages:
                if not self.make_way():  # only this request: cannot happen after the size check in ``step``
                    raise
                waited = True

    def step(self, req: TextRequest, arrival_s: float | None = None, more_calls: bool = False) -> int | None:
        """Admit ``req`` (arriving at ``arrival_s``, default its own; ``more_calls``: its session has a later call),
        completing what must end first, and run it; its matched tokens, or None if it failed."""
        run, P, serving = self.run, self.run.page_size, self.serving
        if self.begin is not None:
            self.begin(self.position)
        self.position += 1
        if serving.clocked:
            self.clock = max(self.clock, req.arrival_s if arrival_s is None else arrival_s)
            self.finish_ended_by(self.clock)
        prev = self.by_session.get(req.session)
        if prev is not None:
            self.finish(prev)
        cap = serving.cap
        while cap is not None and self.in_service >= cap:
            self.complete_earliest()
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
        if more_calls:
            self.more.add(req.rid)
        waited = self.grow(req.rid, n)
        self.cache.mark_computed(req.rid, n)
        waited |= self.grow(req.rid, n + out)
        if out > 1:
            self.cache.mark_computed(req.rid, n + out - 1)
        run.stalls += waited
        run.peak_live_requests = max(run.peak_live_requests, len(self.live))
        self.encoded = 0 if self.encoders is None else self.encoders.serve(req, state.matched_tokens)
        heapq.heappush(self.ends, (self.end_of(req, state.matched_tokens), self.seq, req.rid))
        self.seq += 1
        return state.matched_tokens

    def end_of(self, req: TextRequest, matched: int) -> float:
        """When the admitted request ``req`` ends: the service model's duration from now in clocked orders, its
        admission sequence number in round-robin order (first in, first out)."""
        if self.serving.clocked:
            return self.clock + self.service.duration(req.prompt_len - matched, req.output_len)
        return float(self.seq)

    def counted(self) -> ReplayRun:
        """The run, its cache's counters read in."""
        run, stats = self.run, self.cache.stats()
        run.evicted_pages, run.eviction_batches, run.collisions = (stats.evicted_pages, stats.eviction_batches,
                                                                   stats.collisions)
        if self.encoders is not None:
            e = self.encoders
            run.encoder_items, run.encoder_in_prefix, run.encoder_store_hits = e.items, e.in_prefix, e.store_hits
        return run

    def drain(self) -> None:
        for rid in list(self.live):
            if rid in self.pinned:
                self.finish(rid)
        while self.live:
            self.complete_earliest()
            for rid in list(self.pinned):
                self.finish(rid)

    def cache_stats(self) -> dict:
        """The cache's statistics in a serving workload's ``cache_stats()`` shape."""
        stats = {"prefix": self.cache.stats().to_dict()}
        if self.stack is not None:
            stats["tiers"] = self.stack.stats().to_dict()
        return stats


def failing_calls(trace: TextTrace, page_size: int, pages: int, serving: Serving,
                  service: ServiceModel = ServiceModel()) -> set[int]:
    """Positions in the order of the calls whose prompt + output alone need more than ``pages`` pages: they fail at
    that pool size, whatever the policy."""
    return {k for k, (s, i, _) in enumerate(schedule(trace.sessions, serving, service))
            if -(-(trace.sessions[s].calls[i].prompt_len + trace.sessions[s].calls[i].output_len) // page_size) > pages}


def replay_trace(trace: TextTrace, *, page_size: int, pool_tokens: int | None, serving: Serving = Serving(),
                 service: ServiceModel = ServiceModel(), progress: bool = False, tiers: TierModel = TierModel(),
                 observer: CacheObserver | None = None, eviction: Eviction = DEFAULT_POLICY,
                 lookups: list[list[int]] | None = None, watch: ReplayObserver | None = None,
                 encoders: EncoderPlace | None = None) -> ReplayRun:
    """Replay every call of ``trace`` as ``serving`` says through a fresh cache of ``pool_tokens`` (None: unbounded)
    with ``tiers`` (host tier and store; the unbounded pool never evicts, so it gets none), sampled by ``observer``
    and watched call by call by ``watch``, serving media items' encoder outputs from ``encoders`` (None: media only
    named in the chain), evicting by ``eviction``: a policy's name (``mmcache.eviction``), or
    ``"optimal"`` with ``lookups``, the chains each call of a replay of the same calls looked up (``LookupRecorder``),
    a factory or a policy."""
    pages = pool_pages_for(trace, page_size, pool_tokens)
    if eviction == "optimal":
        if lookups is None:
            raise ValueError("eviction 'optimal' needs the lookups of a replay of the same calls (LookupRecorder)")
        failed = failing_calls(trace, page_size, pages, serving, service)
        policy, name = OfflineOptimal([[] if k in failed else names for k, names in enumerate(lookups)]), "optimal"
    else:  # an unknown name fails here, before the replay
        policy, name = check_policy(eviction), policy_name(eviction)
    if trace.page_size is not None and page_size != trace.page_size:
        raise ValueError(f"{trace.kind} traces fix the page size at {trace.page_size}, got {page_size}")
    run = ReplayRun(pool_tokens=None if pool_tokens is None else pages * page_size, pool_pages=pages,
                    page_size=page_size, order=serving.order,
                    sessions=None if serving.order == "timestamp" else serving.sessions, in_service=serving.cap,
                    pin_sessions=serving.pin_sessions, eviction=name)
    if pool_tokens is None:
        tiers = TierModel(host_bytes_per_s=tiers.host_bytes_per_s, store_bytes_per_s=tiers.store_bytes_per_s,
                          kv_bytes_per_token=tiers.kv_bytes_per_token)
    run.host_tokens, run.store_tokens = tiers.host_tokens, tiers.store_tokens
    r = Replayer(trace, run, service, tiers, policy, serving=serving, encoders=encoders)
    if observer is not None:
        observer.new_caches()
        observer.sample(r.cache_stats())
    started = sampled = time.perf_counter()
    bar = progress_bar(trace.num_requests, f"pool {format_size(pool_tokens)}", enabled=progress)
    for k, (s, i, arrival) in enumerate(schedule(trace.sessions, serving, service)):
        session = trace.sessions[s]
        req = session.build(i)
        matched = r.step(req, arrival if serving.order == "closed" else None, i + 1 < len(session.calls))
        if watch is not None:
            watch.served(k, req, matched, r.encoded if matched is not None else 0)
        bar.update(1)
        if observer is not None and time.perf_counter() - sampled >= SAMPLE_S:
            observer.sample(r.cache_stats())
            sampled = time.perf_counter()
    r.drain()
    bar.close()
    if observer is not None:
        observer.sample(r.cache_stats())
    r.counted()
    run.elapsed_s = time.perf_counter() - started
    return run
