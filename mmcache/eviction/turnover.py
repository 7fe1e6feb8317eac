"""How many ticks a pool takes to turn over: to take in as many new pages as it holds. The unit in which a policy
moves a key away from the last use (a demoted page a turnover back, a costly one part of a turnover ahead), so a
shift means the same share of the pool whatever the pace of the traffic."""

from __future__ import annotations

from mmcache.eviction.base import Clock


class Turnover:
    """A running estimate from the pages requests compute and the pool's clock: ticks per new page (each sample
    weighs its pages over the pool's), times the pool's pages. A pool's worth of new pages refreshes it."""

    __slots__ = ("num_pages", "ticks_per_page", "_clock", "_at")

    def __init__(self, num_pages: int, clock: Clock):
        self.num_pages = max(1, int(num_pages))
        self.ticks_per_page = 1.0
        self._clock = clock
        self._at = clock()

    def inserted(self, pages: int) -> None:
        """``pages`` new pages came in now."""
        if pages <= 0:
            return
        now = self._clock()
        sample = max(1, now - self._at) / pages
        self._at = now
        self.ticks_per_page += (sample - self.ticks_per_page) * min(1.0, pages / self.num_pages)

    @property
    def ticks(self) -> int:
        return int(self.ticks_per_page * self.num_pages)
