"""The tier series of the Prometheus exporter (``prometheus.Exporter`` owns one ``TierSeries``), read off
``TierStack.stats().to_dict()`` (a workload's ``cache_stats()["tiers"]``): the tiers' state and the store's health.
What each tier counts per kind of entry (hits, puts, evictions, refusals) is ``mmcache.stats.COUNTERS``, exported by
the exporter itself as ``mmcache_tier_<name>_total{tier, kind}``.

- ``mmcache_tier_host_pages{kind}`` (gauge): pages the host tier holds now.
- ``mmcache_tier_store_up`` (gauge): 1 while the store is up, 0 while it is marked down (probed in the background).
- ``mmcache_tier_store_wait_seconds{kind}`` (histogram, buckets ``mmcache.tiers.store.WAIT_BOUNDS``): seconds a
  lookup that asked the store spent in it (its batched reads, bounded by the store's deadline, and verification),
  measured in ``StoreTier.match``.
- ``mmcache_tier_store_*_total{kind}`` (``STORE_COUNTERS``): reads late or failed, lookups that skipped the store,
  times it was marked down.

``kind`` is ``kv`` here: a ``TierStack``'s (its store's reads and health count an ``EncoderStore``'s too where the
two share it); the dashboard sums over it. The series appear with the first sample that has tiers (only the tiers a
cache has); a fresh cache sampled before its first request puts them at 0 first, as the trace replay does. Counters
and the histogram advance by each statistic's growth since the previous sample of the same caches (the exporter's
``growth``), so they stay monotonic across fresh caches; gauges hold the latest.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

TIER_SERIES = "mmcache_tier_"  # what every series by tier starts with (the device's counters included)
LOWER_TIERS = ("mmcache_tier_host_", "mmcache_tier_store_", 'tier="host"', 'tier="store"')  # only with tiers
KIND = "kv"
STORE_COUNTERS = {  # TierStats field -> (name suffix, help)
    "store_late": ("late_reads", "Store reads that missed their lookup's deadline: dropped (misses)."),
    "store_read_errors": ("read_errors", "Store reads that failed: misses, and failures in the store's window."),
    "store_skipped": ("skipped_lookups", "Lookups that skipped the store while it was marked down (misses at once)."),
    "store_skipped_late_read": ("skipped_late_read", "Lookups that skipped the store while a late read was in "
                                                     "flight."),
    "store_marked_down": ("marked_down", "Times the store was marked down (failure rate over its window, or a "
                                         "stalled read)."),
}

Growth = Callable[[tuple, float], float]  # (statistic key, value now) -> growth since the previous sample


def reads_lower_tiers(expr: str) -> bool:
    """Whether the PromQL ``expr`` reads a series that only a cache with a host tier or a store has."""
    return any(s in expr for s in LOWER_TIERS)


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
        self.host_pages = Gauge("mmcache_tier_host_pages", "Pages the host tier holds.", ["kind"], registry=reg)
        self.store_up = Gauge("mmcache_tier_store_up", "1 while the shared store is up, 0 while it is marked down "
                              "(probed in the background; lookups miss at once).", registry=reg)
        self.store = {field: Counter(f"mmcache_tier_store_{suffix}_total", doc, ["kind"], registry=reg)
                      for field, (suffix, doc) in STORE_COUNTERS.items()}
        self.store_wait = SnapshotHistogram("mmcache_tier_store_wait_seconds", "Seconds a lookup that asked the "
                                            "store spent in it (batched reads within the deadline, and "
                                            "verification).", ("kind",), reg)

    def sample(self, tiers: dict, growth: Growth) -> None:
        """Advance the series to ``tiers`` (``TierStats.to_dict()``)."""
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
