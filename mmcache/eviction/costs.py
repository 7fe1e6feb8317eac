"""What an entry saves, against the pool's typical entry, as a bounded weight: costs weigh, they do not take over.

A cost is the seconds of recompute a hit on an entry saves per page it holds (a KV page's prefill, an encoder
output's forward over its pages). ``CostWeight.octaves`` reads it as log2 of cost over the pool's typical cost,
clipped to ``[-1, 1]``: an entry that saves twice the typical or more weighs +1, half or less -1. The typical cost is
a running mean of log2 costs (a geometric mean), each cost counted for the pages it was keyed for and clipped to
``OUTLIER`` octaves of the mean first, so one outlier cannot move it far; a pool whose entries all save the same
reads 0 for every one of them (no shift at all). The mean moves only at ``refresh`` (a policy's per-request upkeep),
so every key between two refreshes reads the same scale, one entry at a time or many at once.
"""

from __future__ import annotations

import math

STEP = 0.01     # how far one page's cost moves the typical cost toward it (a pool's worth of pages: all the way)
OUTLIER = 2.0   # octaves: a cost further than this from the typical one counts as if it were this far


class CostWeight:
    __slots__ = ("log_mean", "_sum", "_pages")

    def __init__(self):
        self.log_mean: float | None = None
        self._sum = self._pages = 0.0  # costs counted since the last refresh (log2, clipped, times pages)

    def octaves(self, cost: float | None, pages: int = 1) -> float:
        """log2 of ``cost`` over the typical cost, in ``[-1, 1]`` (0 for an unknown cost, and until a first refresh
        has a typical cost); counted for ``pages`` pages at the next refresh."""
        if cost is None or not 0 < cost < math.inf:  # unknown (the caches refuse the rest before they get here)
            return 0.0
        x = math.log2(cost)
        if self.log_mean is None:
            self._sum += x * pages
            self._pages += pages
            return 0.0
        step = max(-OUTLIER, min(OUTLIER, x - self.log_mean))
        self._sum += (self.log_mean + step) * pages
        self._pages += pages
        return max(-1.0, min(1.0, x - self.log_mean))

    def refresh(self) -> None:
        """Move the typical cost toward the costs counted since the last refresh."""
        if not self._pages:
            return
        mean = self._sum / self._pages
        self.log_mean = mean if self.log_mean is None else (
            self.log_mean + (mean - self.log_mean) * min(1.0, STEP * self._pages))
        self._sum = self._pages = 0.0
