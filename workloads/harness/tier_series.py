"""The tier series of the Prometheus exporter (``prometheus.Exporter`` owns one ``TierSeries``), read off
``TierStack.stats().to_dict()`` (a workload's ``cache_stats()["tiers"]``):

- ``mmcache_tier_hit_pages_total{tier, kind}``, ``mmcache_tier_hit_tokens_total{tier, kind}``: what lookups got from
  each tier, ``tier`` device/host/store. The host and store shares are the pages of their verified hits copied up
  to requests; the device's is the prefix cache's hit tokens less both, so the three stacked are
  ``mmcache_prefix_cache_hit_tokens_total``.
- ``mmcache_tier_host_pages{kind}`` (gauge): pages the host tier holds now.
- ``mmcache_tier_store_up`` (gauge): 1 while the store is up, 0 while it is marked down (probed in the background).
- ``mmcache_tier_store_wait_seconds{kind}`` (histogram, buckets ``mmcache.tiers.store.WAIT_BOUNDS``): seconds a
  lookup that asked the store spent in it (its batched reads, bounded by the store's deadline, and verification),
  measured in ``StoreTier.match``.
- ``mmcache_tier_store_*_total{kind}`` (``STORE_COUNTERS``): entries refused (MAC failures, failed verification),
  reads late or failed, puts stored, already held, refused for space or dropped, entries removed to make room or
  because a reader refused them, lookups that skipped the store, times it was marked down.

``kind`` is what the entries are: ``kv`` (prefix pages) here; encoder outputs in the tiers are meant to join as
``kind="encoder"`` under the same names, and the dashboard sums over it. The series appear with the first sample
that has tiers (only the tiers a cache has); a fresh cache sampled before its first request puts them at 0 first,
as the trace replay does. Counters and the histogram advance by each statistic's growth since the previous sample of
the same caches (the exporter's ``growth``), so they stay monotonic across fresh caches; gauges hold the latest.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

TIER_SERIES = "mmcache_tier_"  # what every tier series' name starts with
KIND = "kv"
TIERS = ("device", "host", "store")
STORE_COUNTERS = {  # TierStats field -> (name suffix, help)
    "store_mac_failures": ("mac_failures", "Store entries whose keyed MAC failed (forged, keyless or under another "
                                           "key): counted misses."),
    "store_rejected": ("rejected", "Store entries that failed verification (fingerprint, salt, layout, depth, tokens, "
                                   "media, parent lineage or checksum): counted misses."),
    "store_late": ("late_reads", "Store reads that missed their lookup's deadline: dropped (misses)."),
    "store_read_errors": ("read_errors", "Store reads that failed: misses, and failures in the store's window."),
    "store_publish_dropped": ("publish_dropped", "Pages not published to the store: its queue was full, it was "
                                                 "marked down, or the put failed."),
    "store_published_pages": ("published_pages", "Pages stored in the store."),
    "store_publish_exists": ("publish_exists", "Puts of keys the store already held (left as they were)."),
    "store_publish_full": ("publish_full", "Puts the store refused for space after the tier made room: skipped, "
                                           "the store stays up."),
    "store_room_removed": ("room_removed", "The tier's own oldest entries removed to make room for a put."),
    "store_refused_removed": ("refused_removed", "Entries a reader refused, removed so the real bytes can be "
                                                 "published again."),
    "store_skipped": ("skipped_lookups", "Lookups that skipped the store while it was marked down (misses at once)."),
    "store_skipped_late_read": ("skipped_late_read", "Lookups that skipped the store while a late read was in "
                                                     "flight."),
    "store_marked_down": ("marked_down", "Times the store was marked down (failure rate over its window, or a "
                                         "stalled read)."),
}

Growth = Callable[[tuple, float], float]  # (statistic key, value now) -> growth since the previous sample


class SnapshotHistogram:
    """A histogram series fed ``HistogramStats`` of a histogram kept elsewhere, as growth: ``add`` the growth of each
    bucket and of the sum; a scrape renders the running totals (``le`` buckets cumulative). Registered on
    ``registry``; its lock covers a scrape that reads while the serving loop adds."""

    def __init__(self, name: str, doc: str, labelnames: tuple[str, ...], registry: CollectorRegistry):
        self.name, self.doc, self.labelnames = name, doc, labelnames
        self._series: dict[tuple, tuple[tuple, list, list]] = {}  # labels -> (bounds, counts, [sum])
        self._lock = threading.Lock()
        registry.register(self)

    def add(self, labels: tuple, bounds: tuple, counts: list[float], total: float) -> None:
        with self._lock:
            _, have, s = self._series.setdefault(labels, (tuple(bounds), [0] * len(counts), [0.0]))
            for i, c in enumerate(counts):
                have[i] += c
            s[0] += total

    def describe(self):
        return [HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)]

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labelnames)
        with self._lock:
            for labels, (bounds, counts, s) in self._series.items():
                running, buckets = 0, []
                for bound, c in zip((*map(floatToGoString, bounds), "+Inf"), counts):
                    running += c
                    buckets.append((bound, running))
                family.add_metric(list(labels), buckets, s[0])
        yield family


class TierSeries:
    """The tier series on one registry (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry):
        reg = registry
        self.hit_pages = Counter("mmcache_tier_hit_pages_total", "Pages lookups got from each tier (device: the "
                                 "prefix cache's hits less the lower tiers').", ["tier", "kind"], registry=reg)
        self.hit_tokens = Counter("mmcache_tier_hit_tokens_total", "Prompt tokens lookups got from each tier (pages "
                                  "x page size).", ["tier", "kind"], registry=reg)
        self.host_pages = Gauge("mmcache_tier_host_pages", "Pages the host tier holds.", ["kind"], registry=reg)
        self.store_up = Gauge("mmcache_tier_store_up", "1 while the shared store is up, 0 while it is marked down "
                              "(probed in the background; lookups miss at once).", registry=reg)
        self.store = {field: Counter(f"mmcache_tier_store_{suffix}_total", doc, ["kind"], registry=reg)
                      for field, (suffix, doc) in STORE_COUNTERS.items()}
        self.store_wait = SnapshotHistogram("mmcache_tier_store_wait_seconds", "Seconds a lookup that asked the "
                                            "store spent in it (batched reads within the deadline, and "
                                            "verification).", ("kind",), reg)

    def sample(self, tiers: dict, prefix: dict | None, growth: Growth) -> None:
        """Advance the series to ``tiers`` (``TierStats.to_dict()``); ``prefix`` (``PrefixCacheStats.to_dict()``,
        the same cache's) gives the device's share of the hits."""
        P = tiers["page_size"]
        hits = {t: tiers[f"{t}_adopted_pages"] for t in TIERS[1:] if tiers[t]}
        if prefix is not None:
            hits = {"device": prefix["hit_tokens"] // P - sum(hits.values()), **hits}
        for tier, pages in hits.items():
            grew = growth(("tiers", "hit_pages", tier, KIND), pages)
            self.hit_pages.labels(tier=tier, kind=KIND).inc(grew)
            self.hit_tokens.labels(tier=tier, kind=KIND).inc(grew * P)
        if tiers["host"]:
            self.host_pages.labels(kind=KIND).set(tiers["host_pages_held"])
        if not tiers["store"]:
            return
        self.store_up.set(1 if tiers["store_up"] else 0)
        for field, counter in self.store.items():
            counter.labels(kind=KIND).inc(growth(("tiers", field, KIND), tiers[field]))
        wait = tiers["store_wait"]
        self.store_wait.add((KIND,), wait["bounds"],
                            [growth(("tiers", "store_wait", KIND, i), c) for i, c in enumerate(wait["counts"])],
                            growth(("tiers", "store_wait_sum", KIND), wait["sum"]))
