"""Live serving metrics in the Prometheus exposition format, updated by the serving loop after each request.

An ``Exporter`` owns a dedicated ``CollectorRegistry`` (never the process-global one), so several can live in one
process and nothing else the process registers leaks into a scrape. ``serve(port)`` exposes it over HTTP
(``prometheus_client.start_http_server``, loopback unless told otherwise); pass the exporter as ``observer`` to
``serving.serve_run`` / ``serving.compare``. Names follow vLLM's and SGLang's: counters end in ``_total``, times are
in seconds, sizes in bytes, and what varies is a label (``cached``, ``cache_outcome``, ``modality``, ``state``).

- Cache counters (``mmcache_prefix_cache_*_total``, ``mmcache_encoder_cache_*_total{modality}``) follow the
  workload's ``cache_stats()``: each advances by the growth of its statistic since the previous sample of the same
  run (a run starts with a fresh workload, whose statistics start at 0), so they stay monotonic across runs. The
  cache-off run bypasses the caches, so they only move in the cache-on run. Gauges hold the latest sample.
- Counters per tier and kind (``mmcache_tier_<name>_total{tier, kind}``): one series per counter of
  ``mmcache.stats.COUNTERS`` (pages evicted and freed, hit tokens and hits, puts stored, held, skipped for room or
  dropped, entries removed, refused), with that table's name and meaning, for every ``tier`` (device, host, store)
  and ``kind`` (kv, encoder) the sampled caches have; the device's KV series exist at 0 from the start.
- Page counters (``mmcache_prefix_cache_{prompt,matched}_pages_total``) come from the completed requests of the
  cache-on run: their ratio is the matched-page share.
- Latency histograms carry ``cached="on"|"off"`` and ``cache_outcome="hit"|"miss"`` (hit: the request reused
  something, a prefix page or an encoder output; every cache-off request is a miss). Their buckets span tens of
  milliseconds to minutes, so first-token and first-audio SLOs fall on bucket bounds. Only completed requests are
  observed in them; every request in ``mmcache_requests_total{outcome="ok"|"error"}``, and those that meet the
  ``SLO`` in ``mmcache_requests_slo_met_total{cached}`` (its rate is the goodput).
- Videos (requests whose ``RequestResult.videos`` is set): their E2E latency in ``mmcache_video_latency_seconds``
  (``cached``, ``cache_outcome``) and their frames in ``mmcache_video_frames_total{cached}``. Stage times of every
  completed request add to ``mmcache_stage_seconds_total{cached, stage}``: off minus on is the time the cache saved.
- Every series a dashboard panel reads exists from the first scrape (at 0), before the first request: a rate needs
  a sample before the first increase, and a replay is often shorter than a few scrape intervals. The tier series
  (``tier_series``: host pages held, store up/down, the store's admission wait, its read faults) and the lower tiers'
  counters exist once a cache with tiers was sampled.
- ``sample(cache_stats)`` advances the cache series alone (``observe`` calls it); ``new_caches()`` says the caches
  sampled next start at 0 again. A trace replay, which has no requests to observe, drives the exporter with these.
"""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from mmcache.stats import COUNTERS, counter_values
from workloads.harness.metrics import SLO, RequestRecord, RunResult
from workloads.harness.tier_series import TierSeries

DASHBOARD = Path(__file__).resolve().parent / "grafana" / "mmcache_dashboard.json"
LATENCY_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
                   30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PREFIX_COUNTERS = {  # PrefixCache.stats().to_dict() key -> help
    "queries": "Prefix cache lookups (one per admitted request).",
    "hits": "Prefix cache lookups that matched at least one page.",
    "queried_tokens": "Prompt tokens looked up in the prefix cache.",
    "hit_tokens": "Prompt tokens served from the prefix cache.",
    "stalls": "Admissions that waited for live requests to finish because live demand filled the pool.",
}
ENCODER_COUNTERS = {  # EncoderStore.stats().to_dict()["by_modality"][m] key -> (name suffix, help)
    "queries": ("queries", "Encoder cache lookups."),
    "hits": ("hits", "Encoder cache lookups served from the store."),
    "time_saved_s": ("saved_seconds", "Encoder time the hits saved: the measured time of the misses that computed "
                                      "the outputs they returned."),
}
PAGE_COUNTERS = {  # RequestResult field -> (name, help)
    "prompt_pages": ("mmcache_prefix_cache_prompt_pages_total", "Full prompt pages of completed cache-on requests."),
    "hit_pages": ("mmcache_prefix_cache_matched_pages_total", "Prompt pages of completed cache-on requests matched "
                                                              "in the prefix cache."),
}
LATENCIES = {  # metrics.LATENCIES key -> (name, help, buckets)
    "ttft": ("mmcache_time_to_first_token_seconds", "Time to first token (queueing included).", LATENCY_BUCKETS),
    "ttfa": ("mmcache_time_to_first_audio_seconds", "Time to first audio chunk (queueing included).",
             LATENCY_BUCKETS),
    "itl": ("mmcache_inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
    "e2e": ("mmcache_e2e_request_latency_seconds", "Arrival to last output.", LATENCY_BUCKETS),
    "queue": ("mmcache_request_queue_time_seconds", "Arrival to start of service.", LATENCY_BUCKETS),
    "service": ("mmcache_request_inference_time_seconds", "Measured model time of a request (no queueing).",
                LATENCY_BUCKETS),
}
STAGES = ("text", "image", "video", "audio", "speaker", "prefill", "denoise", "decode")  # Clock.stage names
POOL_STATES = ("free", "live", "cached")
OUTCOMES = ("ok", "error")
CACHED = ("off", "on")
CACHE_OUTCOMES = ("hit", "miss")


def dashboard_queries(path: Path = DASHBOARD) -> list[tuple[str, str, str]]:
    """``(panel title, refId, PromQL)`` of every query of the Grafana dashboard at ``path``, in panel order."""
    board = json.loads(Path(path).read_text())
    return [(p["title"], t["refId"], t["expr"]) for p in board["panels"] for t in p.get("targets", [])]


def cache_outcome(record: RequestRecord) -> str:
    """``"hit"`` when a completed request reused anything (a prefix page, an encoder output), else ``"miss"``."""
    return "hit" if any(record.result.hits().values()) else "miss"


class Exporter:
    """The mmcache metrics of one process on a registry of their own; an ``Observer`` of the serving loop.

    ``slo`` decides which completed requests count in ``mmcache_requests_slo_met_total`` (no bound: all of them).
    """

    def __init__(self, registry: CollectorRegistry | None = None, slo: SLO = SLO()):
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self.slo = slo
        self.prefix = {k: Counter(f"mmcache_prefix_cache_{k}_total", doc, registry=reg)
                       for k, doc in PREFIX_COUNTERS.items()}
        self.pages = {k: Counter(name, doc, registry=reg) for k, (name, doc) in PAGE_COUNTERS.items()}
        self.encoder = {k: Counter(f"mmcache_encoder_cache_{suffix}_total", doc, ["modality"], registry=reg)
                        for k, (suffix, doc) in ENCODER_COUNTERS.items()}
        self.encoder_bytes = Gauge("mmcache_encoder_cache_bytes", "Bytes of encoder outputs stored.", ["modality"],
                                   registry=reg)
        self.counters = {c.name: Counter(f"mmcache_tier_{c.name}_total", c.meaning, ["tier", "kind"], registry=reg)
                         for c in COUNTERS}
        self.pool_pages = Gauge("mmcache_pool_pages", "Prefix-cache pool pages by state: free, live (held by a live "
                                "request, indexed or not), cached (indexed; a matched page is live and cached).",
                                ["state"], registry=reg)
        self.latency = {k: Histogram(name, doc, ["cached", "cache_outcome"], buckets=buckets, registry=reg)
                        for k, (name, doc, buckets) in LATENCIES.items()}
        self.video_latency = Histogram("mmcache_video_latency_seconds", "Arrival to the finished video (per-video "
                                       "latency).", ["cached", "cache_outcome"], buckets=LATENCY_BUCKETS, registry=reg)
        self.video_frames = Counter("mmcache_video_frames_total", "Frames of the videos generated.", ["cached"],
                                    registry=reg)
        self.stage_seconds = Counter("mmcache_stage_seconds_total", "Measured seconds per serving stage (encoder "
                                     "modalities, prefill, denoise, decode).", ["cached", "stage"], registry=reg)
        self.requests = Counter("mmcache_requests_total", "Requests served, by outcome.", ["outcome"], registry=reg)
        self.slo_met = Counter("mmcache_requests_slo_met_total", f"Completed requests that met the SLO ({slo}).",
                               ["cached"], registry=reg)
        self.tiers: TierSeries | None = None  # registered with the first sample that has tiers
        for outcome in OUTCOMES:  # every series a panel reads is present at 0 before the first request
            self.requests.labels(outcome=outcome)
        for cached in CACHED:
            self.slo_met.labels(cached=cached)
            self.video_frames.labels(cached=cached)
            for stage in STAGES:
                self.stage_seconds.labels(cached=cached, stage=stage)
            for hist in (*self.latency.values(), self.video_latency):
                for hit in CACHE_OUTCOMES:
                    hist.labels(cached=cached, cache_outcome=hit)
        for state in POOL_STATES:
            self.pool_pages.labels(state=state)
        self._cells: dict[tuple[str, str, str], Counter] = {}
        for c in COUNTERS:
            for cell in c.cells:
                if (cell.tier, cell.kind) == ("device", "kv"):
                    self._cell(c.name, "device", "kv")
        self._last: dict[tuple, float] = {}
        self._server = self._thread = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``addr:port`` (0: any free port) from a daemon thread; returns the bound port."""
        self._server, self._thread = start_http_server(port, addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        """Stop serving HTTP (the metrics stay readable from ``registry``)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = self._thread = None

    def start(self, run: RunResult) -> None:
        self.new_caches()
        for m in run.ceilings.keys() - {"prefix"}:  # the workload's encoder modalities, at 0 until first used
            for counter in self.encoder.values():
                counter.labels(modality=m)
            self.encoder_bytes.labels(modality=m)

    def observe(self, run: RunResult, record: RequestRecord, cache_stats: dict) -> None:
        self.requests.labels(outcome="ok" if record.ok else "error").inc()
        if record.ok:
            hit = cache_outcome(record)
            for k, hist in self.latency.items():
                child = hist.labels(cached=run.label, cache_outcome=hit)
                for value in record.latency(k):
                    child.observe(value)
            if record.result.videos:
                self.video_latency.labels(cached=run.label, cache_outcome=hit).observe(record.e2e_s)
                self.video_frames.labels(cached=run.label).inc(record.result.output_tokens)
            for stage, seconds in record.stages.items():
                self.stage_seconds.labels(cached=run.label, stage=stage).inc(seconds)
            if self.slo.met(record):
                self.slo_met.labels(cached=run.label).inc()
            if run.cached:
                for k, counter in self.pages.items():
                    counter.inc(getattr(record.result, k))
        self.sample(cache_stats)

    def new_caches(self) -> None:
        """The caches sampled next are fresh ones: their statistics start at 0 again."""
        self._last.clear()

    def sample(self, cache_stats: dict) -> None:
        """Advance the cache series to ``cache_stats`` (a workload's ``cache_stats()``: ``prefix``, ``encoder`` and
        ``tiers``, each optional)."""
        prefix = cache_stats.get("prefix")
        if prefix is not None:
            for k, counter in self.prefix.items():
                counter.inc(self._growth(("prefix", k), prefix[k]))
            for state in POOL_STATES:
                self.pool_pages.labels(state=state).set(prefix[f"pages_{state}"])
        for m, stats in cache_stats.get("encoder", {}).get("by_modality", {}).items():
            for k, counter in self.encoder.items():
                counter.labels(modality=m).inc(self._growth(("encoder", m, k), stats[k]))
            self.encoder_bytes.labels(modality=m).set(stats["bytes_stored"])
        for key, value in counter_values(cache_stats).items():  # every cell the caches have, at 0 until it grows
            child = self._cell(*key)
            if grew := self._growth(key, value):
                child.inc(grew)
        if (tiers := cache_stats.get("tiers")) is not None:
            if self.tiers is None:
                self.tiers = TierSeries(self.registry)
            self.tiers.sample(tiers, self._growth)

    def _cell(self, name: str, tier: str, kind: str):
        """The series of counter ``name`` (``COUNTERS``) for ``tier`` and ``kind``, made once."""
        child = self._cells.get((name, tier, kind))
        if child is None:
            child = self._cells[name, tier, kind] = self.counters[name].labels(tier=tier, kind=kind)
        return child

    def _growth(self, key: tuple, value: float) -> float:
        """How much statistic ``key`` grew since its last sample in this run (never negative: counters only rise)."""
        last, self._last[key] = self._last.get(key, 0), value
        return max(value - last, 0)
