"""WaitHistogram: seconds bucketed by fixed upper bounds, for a wait measured on a request's path (the store tier's
lookup). ``observe`` is a bisect and two additions under a lock of its own (never the cache's);
``snapshot()`` is a ``HistogramStats`` (``mmcache.stats``)."""

from __future__ import annotations

import bisect
import threading

from mmcache.errors import InvalidRequest
from mmcache.stats import HistogramStats


class WaitHistogram:
    """Observations counted in the bucket of the first bound at or above them (one bucket past the last bound).

    Invariant: ``sum(counts)`` is the number of observations and ``sum`` their total; a snapshot sees both from the
    same instant (several threads observe at once: lookups run outside the cache's lock)."""

    def __init__(self, bounds):
        bounds = tuple(float(b) for b in bounds)
        if not bounds or any(not b > a for a, b in zip(bounds, bounds[1:])) or not bounds[0] > 0:
            raise InvalidRequest(f"histogram bounds must be positive and increasing, got {bounds!r}")
        self.bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramStats:
        with self._lock:
            return HistogramStats(self.bounds, tuple(self._counts), self._sum)
