"""Prometheus metrics of cached M* encoder nodes, under the names the replays export
(``workloads/harness/prometheus.py``): ``mmcache_encoder_cache_{queries,hits}_total{modality}`` and
``mmcache_encoder_cache_bytes{modality}``, plus ``..._misses_total``, ``..._joins_total`` and
``..._saved_seconds_total``.

``EncoderNodeCollector(nodes)`` is a prometheus_client collector: register it on any registry
(``registry.register(EncoderNodeCollector(nodes))``); each scrape reads the nodes' counters then, so nothing runs on
the serving path. Nodes of one modality add up; a store shared by several nodes is counted once.
"""

from __future__ import annotations

from collections import defaultdict

COUNTERS = {  # name suffix -> (help, how to read it off NodeCounters)
    "queries": ("Encoder cache lookups (items of requests).", lambda c: c.hits + c.misses + c.joins),
    "hits": ("Encoder cache lookups served from the store.", lambda c: c.hits),
    "misses": ("Encoder cache lookups the encoder computed.", lambda c: c.misses),
    "joins": ("Encoder cache lookups served by a concurrent or same-batch computation of the same key.",
              lambda c: c.joins),
}
SAVED = ("saved_seconds", "Encoder seconds the hits saved (each entry's measured compute time).")


def node_metrics(nodes) -> tuple[dict, dict]:
    """``({counter: {modality: value}}, {modality: bytes stored})`` summed over ``nodes`` (CachedEncoderNode); time
    saved and bytes come from the stores (a shared store counted once)."""
    counters = {k: defaultdict(float) for k in (*COUNTERS, SAVED[0])}
    stored, seen = defaultdict(int), set()
    for node in nodes:
        m = node.spec.modality
        for k, (_, read) in COUNTERS.items():
            counters[k][m] += read(node.counters)
        if id(node.store) not in seen:
            seen.add(id(node.store))
            for modality, c in node.store.stats().by_modality.items():
                stored[modality] += c.bytes_stored
                counters[SAVED[0]][modality] += c.time_saved_s
    return counters, stored


class EncoderNodeCollector:
    """A prometheus_client collector over cached encoder nodes (see the module docstring)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    def describe(self):
        return []  # unchecked registration: the names may also be exported by a replay's own registry

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters, stored = node_metrics(self.nodes)
        for k, doc in [*((k, doc) for k, (doc, _) in COUNTERS.items()), SAVED]:
            family = CounterMetricFamily(f"mmcache_encoder_cache_{k}", doc, labels=["modality"])
            for modality, value in sorted(counters[k].items()):
                family.add_metric([modality], value)
            yield family
        gauge = GaugeMetricFamily("mmcache_encoder_cache_bytes", "Bytes of encoder outputs stored.",
                                  labels=["modality"])
        for modality, value in sorted(stored.items()):
            gauge.add_metric([modality], value)
        yield gauge
