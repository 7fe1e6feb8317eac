"""Replay a trace over R data-parallel replicas, each with its own metadata-only PrefixCache and EncoderStore, under
one router.

The pool: ``pool_tokens`` is the TOTAL, split evenly (each replica gets ``pool_tokens // R``), so every R is compared
at the same total memory and against one pool of that size (R = 1, the reference row). The encoder store's
``encoder_bytes`` is split the same way.

Media (multimodal traces, ``TextRequest.media``): the page names fold in every item's digest at its offset, as an
engine's do. After admission, each item an encoder makes (``TextRequest.encoded``) is served, as vlm-chat and
voice-clone serve it: from the matched prefix when its placeholder rows lie inside it, else from the replica's
``EncoderStore`` (a real store whose entries stand in for the features: one byte per ``ENCODER_UNIT`` bytes of
output, so eviction and capacity act on the true sizes while the replay holds no feature bytes), else the encoder
runs (a miss, stored). The encoder hit rate is the share of items the encoder did not run for.

Per request, in timestamp order: every replica first finishes what has ended by the arrival; a session's previous
call is finished on whichever replica holds it; the router sees the request's page names, prompt length, the digests
of its encoded media and each replica's live requests (its queue) and picks a replica, whose ``Replayer`` admits
and runs the request exactly as the single-pool replay does (``workloads.sizing.replay``).

A router that reads the replicas' caches (``kv-aware``) reads them as an external router would: each replica's
prefix cache and encoder store report to an ``EventLog`` (``mmcache.events``: the messages a ``KVEventPublisher``
sends, with each item's placeholder count described at admission), and before each choice the router's
``CacheView`` of every replica applies the messages made since the last one, decoded from their bytes.

Service model, per replica: a request's prefill waits for the replica's earlier prefills (one prefill at a time,
FIFO) and takes ``encoder misses * encoder_s + uncached tokens / prefill_tokens_per_s`` (the encoder runs in the
request's turn, before its prefill); ``TTFT = prefill end - arrival`` (admission stalls included); the request then
decodes for ``output_len * s_per_output_token`` and ends. Decodes overlap freely. Audio output
(``TextTrace.first_audio_tokens``: frames per first audio chunk): ``TTFA = TTFT + (first_audio_tokens - 1) *
s_per_output_token`` (the prefill yields the first frame).

One pool (``shared_pool``): each replica's encoder store takes its pages from the replica's KV pool, an output of
``nbytes`` taking ``nbytes / (page_size x kv_bytes_per_token)`` pages (at least one), so KV pages and encoder
outputs compete for one pool under its eviction policy, which weighs what each saves: a KV page its prefill
(``page_size / prefill_tokens_per_s``), an encoder output ``encoder_s`` over its pages. ``encoder_bytes`` is then
unused. The time each kind saved is reported (``kv_saved_s``, ``encoder_saved_s``).

Reported: realized hit rate, pages duplicated across replicas (of the distinct prompt pages each replica was ever
sent, the share that another replica was also sent: copies beyond the first; evictions are not subtracted), replica
spread (``mmcache.shadow.ReplicaSpread``), per-replica load (requests routed; peak live), TTFT p50/p99; with media,
the encoder hit rate (in the matched prefix, in the store); with audio output, TTFA p50/p99.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from mmcache import Fingerprint, page_names
from mmcache.events import CacheView, EventLog
from mmcache.eviction import DEFAULT_POLICY
from mmcache.shadow import ReplicaSpread
from workloads.service import ServiceModel
from workloads.sizing.encoders import DEFAULT_ENCODER_BYTES, ENCODER_UNIT, EncoderPlace
from workloads.sizing.ordering import Serving, schedule
from workloads.sizing.replay import Replayer, ReplayRun
from workloads.sizing.routers import make_router
from workloads.sizing.tiers import TierModel
from workloads.traces.text_trace import TextRequest, TextTrace


@dataclasses.dataclass
class ReplicaRun:
    replicas: int
    router: str
    pool_tokens: int              # total over the replicas
    page_size: int
    encoder_bytes: int = DEFAULT_ENCODER_BYTES  # total over the replicas
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
    ttfa_p50_s: float | None = None  # audio output only
    ttfa_p99_s: float | None = None
    encoder_items: int = 0        # media items an encoder makes, over every admitted request
    encoder_in_prefix: int = 0    # of those, inside the matched prefix (no lookup, no encoder)
    encoder_store_hits: int = 0   # found in the replica's encoder store
    eviction: str = DEFAULT_POLICY
    shared_pool: bool = False     # encoder outputs on the KV pool (module docstring)
    kv_saved_s: float = 0.0       # prefill time the prefix hits saved, and the encoder runs inside them
    encoder_saved_s: float = 0.0  # encoder time the encoder store's hits saved
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def encoder_hit_rate(self) -> float:
        """Share of the media items the encoder did not run for (in the matched prefix, or in the store)."""
        return (self.encoder_in_prefix + self.encoder_store_hits) / self.encoder_items if self.encoder_items else 0.0

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
                "load_imbalance": self.load_imbalance, "encoder_hit_rate": self.encoder_hit_rate}


class _Replica(Replayer):
    """One replica's cache, encoder store and live set, with a FIFO prefill queue for TTFT."""

    def __init__(self, trace: TextTrace, run: ReplayRun, service: ServiceModel, encoder_bytes: int,
                 events: bool = False, kv_page_bytes: int | None = None):
        self.log = EventLog(run.page_size, medium="CPU") if events else None  # what this replica would publish
        super().__init__(trace, run, service, observer=self.log,
                         encoders=EncoderPlace(encoder_bytes, kv_page_bytes), encoder_observer=self.log)
        self.view = CacheView()  # a router's picture of this replica, from the decoded messages alone
        self.prefill_free = 0.0
        self.ttfts: list[float] = []
        self.sent: set[int] = set()

    def sync(self) -> None:
        """Decode the messages this replica made since the last call into its ``view``."""
        if self.log is not None:
            self.view.apply(self.log.take())

    def step(self, req: TextRequest) -> int | None:
        if self.log is not None:  # as an engine does at admission: each item's placeholder count
            for item in req.media:
                self.log.describe_media(item.digest, item.tokens)
        return super().step(req)

    def end_of(self, req: TextRequest, matched: int) -> float:
        begin = max(self.clock, self.prefill_free)
        self.prefill_free = begin + self.encoded * self.service.encoder_s \
            + (req.prompt_len - matched) / self.service.prefill_tokens_per_s
        self.ttfts.append(self.prefill_free - req.arrival_s)
        return self.prefill_free + req.output_len * self.service.s_per_output_token


def replay_replicas(trace: TextTrace, *, replicas: int, router: str, page_size: int, pool_tokens: int,
                    service: ServiceModel = ServiceModel(), threshold: int | None = None, key_pages: int | None = None,
                    seed: int = 0, encoder_bytes: int = DEFAULT_ENCODER_BYTES, view_of=None,
                    eviction: str = DEFAULT_POLICY, shared_pool: bool = False,
                    kv_bytes_per_token: int = TierModel.kv_bytes_per_token) -> ReplicaRun:
    """Replay ``trace`` over ``replicas`` pools of ``pool_tokens // replicas`` tokens and encoder stores of
    ``encoder_bytes // replicas`` bytes each (``shared_pool``: on those pools, ``kv_bytes_per_token`` sizing a page),
    routed by ``router``, evicting by ``eviction``. A router that reads the replicas' caches gets ``view_of(replica)``
    for each (default: the replica's ``CacheView`` of its decoded events)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if trace.page_size is not None and page_size != trace.page_size:
        raise ValueError(f"{trace.kind} traces fix the page size at {trace.page_size}, got {page_size}")
    pages = max(1, pool_tokens // replicas // page_size)
    if pool_tokens // replicas < page_size:
        raise ValueError(f"a pool of {pool_tokens} tokens over {replicas} replicas holds no {page_size}-token page")
    if encoder_bytes // replicas < ENCODER_UNIT and not shared_pool:
        raise ValueError(f"an encoder store of {encoder_bytes} bytes over {replicas} replicas holds less than "
                         f"{ENCODER_UNIT} bytes each")
    kw = {k: v for k, v in (("threshold", threshold), ("key_pages", key_pages)) if v is not None}
    policy = make_router(router, replicas, page_size, seed=seed, **kw)
    reads_caches = hasattr(policy, "attach")
    kv_page_bytes = page_size * kv_bytes_per_token if shared_pool else None
    reps = [_Replica(trace, ReplayRun(pages * page_size, pages, page_size, "timestamp", None, eviction=eviction),
                     service, encoder_bytes // replicas, events=reads_caches, kv_page_bytes=kv_page_bytes)
            for _ in range(replicas)]
    if reads_caches:
        policy.attach([view_of(rep) if view_of is not None else rep.view for rep in reps])
    run = ReplicaRun(replicas, router, pages * page_size * replicas, page_size,
                     0 if shared_pool else encoder_bytes // replicas // ENCODER_UNIT * ENCODER_UNIT * replicas,
                     eviction=eviction, shared_pool=shared_pool)
    fp = Fingerprint(model="replay", page_size=page_size)  # the root the replay's caches use
    spread, where = ReplicaSpread(), {}  # where: session -> replica of its live call
    started = time.perf_counter()
    for s, i, _ in schedule(trace.sessions, Serving()):
        req = trace.sessions[s].build(i)
        if req.names is None:
            req = dataclasses.replace(req, names=page_names(fp, req.token_ids, req.marks))
        for rep in reps:
            rep.finish_ended_by(req.arrival_s)
        prev = where.pop(req.session, None)
        if prev is not None and reps[prev].by_session.get(req.session) is not None:
            reps[prev].finish(reps[prev].by_session[req.session])
        for rep in reps:
            rep.sync()
        pick = policy.choose(req.names, req.prompt_len, [len(r.live) for r in reps], req.arrival_s,
                             [m.digest for m in req.encoded])
        rep = reps[pick]
        if rep.step(req) is not None:
            where[req.session] = pick
        limit = (req.prompt_len - 1) // page_size
        spread.add(req.names[:limit], pick)
        rep.sent.update(req.names[:limit])
    for rep in reps:
        rep.drain()
        rep.counted()
    for rep in reps:
        run.requests += rep.run.requests
        run.prompt_tokens += rep.run.prompt_tokens
        run.hit_tokens += rep.run.hit_tokens
        run.stalls += rep.run.stalls
        run.failed += rep.run.failed
        run.per_replica_requests.append(rep.run.requests)
        run.per_replica_peak_live.append(rep.run.peak_live_requests)
        run.encoder_items += rep.run.encoder_items
        run.encoder_in_prefix += rep.run.encoder_in_prefix
        run.encoder_store_hits += rep.run.encoder_store_hits
    run.kv_saved_s = run.hit_tokens / service.prefill_tokens_per_s + run.encoder_in_prefix * service.encoder_s
    run.encoder_saved_s = run.encoder_store_hits * service.encoder_s
    run.sent_pages = sum(len(r.sent) for r in reps)
    run.distinct_pages = len(set().union(*(r.sent for r in reps)))
    run.repeated_prefixes, run.spread_mean, run.spread_max = spread.summary()
    ttfts = np.concatenate([np.asarray(r.ttfts) for r in reps]) if run.requests > run.failed else np.zeros(1)
    run.ttft_p50_s, run.ttft_p99_s = (float(x) for x in np.percentile(ttfts, [50, 99]))
    if trace.first_audio_tokens is not None:  # a constant after the first frame: the same shift at every percentile
        lag = (trace.first_audio_tokens - 1) * service.s_per_output_token
        run.ttfa_p50_s, run.ttfa_p99_s = run.ttft_p50_s + lag, run.ttft_p99_s + lag
    run.elapsed_s = time.perf_counter() - started
    return run


def format_replica_table(runs: list[ReplicaRun], one_pool: ReplicaRun) -> str:
    """replicas | router | [encoder hit %] | hit % | of one pool % | duplicated % | spread | busiest/mean | TTFT p50 |
    TTFT p99 | [TTFA p50 | TTFA p99] | stalls | failed; ``one_pool`` is the R = 1 run of the same total pool. The
    encoder column is shown when the trace has encoded media, the TTFA columns when it has audio output."""
    every = [one_pool, *runs]
    media, audio = one_pool.encoder_items > 0, one_pool.ttfa_p50_s is not None
    head = ("replicas", "router", *(("encoder hit %",) if media else ()), "prefix hit %" if media else "hit %",
            "of one pool %", "dup pages %", "spread", "busiest/mean", "TTFT p50 s", "TTFT p99 s",
            *(("TTFA p50 s", "TTFA p99 s") if audio else ()), "stalls", "failed")
    rows = [(str(r.replicas), r.router, *((f"{100 * r.encoder_hit_rate:.1f}",) if media else ()),
             f"{100 * r.hit_rate:.2f}",
             f"{100 * r.hit_tokens / one_pool.hit_tokens:.1f}" if one_pool.hit_tokens else "-",
             f"{100 * r.duplicated:.1f}", f"{r.spread_mean:.2f}", f"{r.load_imbalance:.2f}",
             f"{r.ttft_p50_s:.3f}", f"{r.ttft_p99_s:.3f}",
             *((f"{r.ttfa_p50_s:.3f}", f"{r.ttfa_p99_s:.3f}") if audio else ()), f"{r.stalls:,}", f"{r.failed:,}")
            for r in every]
    widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(head)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])
