"""Live serving metrics in the Prometheus exposition format, updated by the serving loop after each request.

An ``Exporter`` owns a dedicated ``CollectorRegistry`` (never the process-global one), so several can live in one
process and nothing else the process registers leaks into a scrape. ``serve(port)`` exposes it over HTTP
(``prometheus_client.start_http_server``, loopback unless told otherwise); pass the exporter as ``observer`` to
``serving.serve_run`` / ``serving.compare``.

Cache counters follow the workload's ``cache_stats()``: each advances by the growth of its statistic since the
previous sample of the same run (a run starts with a fresh workload, whose statistics start at 0), so they stay
monotonic across runs. Gauges hold the latest sample. Latency histograms carry ``cached="on"|"off"``; only completed
requests are observed in them, every request in ``mmcache_requests_total{outcome="ok"|"error"}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from workloads.harness.metrics import RequestRecord, RunResult

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PREFIX_COUNTERS = {  # PrefixCache.stats().to_dict() key -> help
    "queries": "Prefix cache lookups (one per admitted request).",
    "hits": "Prefix cache lookups that matched at least one page.",
    "queried_tokens": "Prompt tokens looked up in the prefix cache.",
    "hit_tokens": "Prompt tokens served from the prefix cache.",
    "evicted_pages": "Cached KV pages evicted to make room for live requests.",
}
ENCODER_COUNTERS = {  # EncoderStore.stats().to_dict()["by_modality"][m] key -> help
    "queries": "Encoder cache lookups.",
    "hits": "Encoder cache lookups served from the store.",
}
LATENCIES = {  # metrics.LATENCIES key -> (name, help, buckets)
    "ttft": ("mmcache_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS),
    "ttfa": ("mmcache_time_to_first_audio_seconds", "Time to first audio chunk.", LATENCY_BUCKETS),
    "itl": ("mmcache_inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS),
    "e2e": ("mmcache_e2e_request_latency_seconds", "Arrival to last output.", LATENCY_BUCKETS),
}
POOL_STATES = ("free", "live", "cached")
OUTCOMES = ("ok", "error")


class Exporter:
    """The mmcache metrics of one process on a registry of their own; an ``Observer`` of the serving loop."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = reg = registry if registry is not None else CollectorRegistry()
        self.prefix = {k: Counter(f"mmcache_prefix_cache_{k}_total", doc, registry=reg)
                       for k, doc in PREFIX_COUNTERS.items()}
        self.encoder = {k: Counter(f"mmcache_encoder_cache_{k}_total", doc, ["modality"], registry=reg)
                        for k, doc in ENCODER_COUNTERS.items()}
        self.encoder_bytes = Gauge("mmcache_encoder_cache_bytes", "Bytes of encoder outputs stored.", ["modality"],
                                   registry=reg)
        self.pool_pages = Gauge("mmcache_pool_pages", "Prefix-cache pool pages by state.", ["state"], registry=reg)
        self.latency = {k: Histogram(name, doc, ["cached"], buckets=buckets, registry=reg)
                        for k, (name, doc, buckets) in LATENCIES.items()}
        self.requests = Counter("mmcache_requests_total", "Requests served, by outcome.", ["outcome"], registry=reg)
        for outcome in OUTCOMES:  # present at 0 before the first request
            self.requests.labels(outcome=outcome)
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
        self._last.clear()

    def observe(self, run: RunResult, record: RequestRecord, cache_stats: dict) -> None:
        self.requests.labels(outcome="ok" if record.ok else "error").inc()
        if record.ok:
            for k, hist in self.latency.items():
                child = hist.labels(cached=run.label)
                for value in record.latency(k):
                    child.observe(value)
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

    def _growth(self, key: tuple, value: float) -> float:
        """How much statistic ``key`` grew since its last sample in this run (never negative: counters only rise)."""
        last, self._last[key] = self._last.get(key, 0), value
        return max(value - last, 0)
