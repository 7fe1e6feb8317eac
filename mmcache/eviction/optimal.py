"""``optimal``: the offline optimum of a replay, whose future is known, and the recorder that learns that future.

Not an online policy: it bounds what any policy can keep at a pool size on the same calls (counting hits; the optimum
of time saved weighs entries, a harder problem), which is how every policy is judged (``docs/eviction.md``).
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from mmcache.eviction.base import Clock, EvictionPolicy
from mmcache.eviction.lru import LRU


class OfflineOptimal(EvictionPolicy):
    """Belady's rule for a replay whose lookups are known in advance (``lookups[k]``: every name call ``k`` of the
    replay's order looks up, as the caches see them; empty for a call that fails or looks up nothing): the entry
    whose name is looked up next farthest in the future goes first; never looked up again, first of all. A parent is
    looked up whenever its child is, so its next use is never later and what stays is prefix-closed. The replay
    tells it where it stands (``begin``) before each call, failed ones included, so it never falls out of step.
    Keys fall when an entry is used (its next use moves on): ``monotone`` is False."""

    name = "optimal"
    monotone = False
    NEVER = 1 << 40

    def __init__(self, lookups: Sequence[Sequence[int]], num_pages: int = 1, clock: Clock = lambda: 0):
        super().__init__(num_pages, clock)
        uses: dict[int, list[int]] = {}
        for k, names in enumerate(lookups):
            for name in names:
                times = uses.setdefault(name, [])
                if not times or times[-1] != k:
                    times.append(k)
        self._uses = uses
        self._now = -1  # the call being served

    def begin(self, request: int) -> None:
        """The replay is about to serve call ``request`` of its order."""
        self._now = request

    def rank(self, name: int, tick: int, cost: float | None) -> int:
        times = self._uses.get(name, ())
        at = bisect.bisect_right(times, self._now)
        return self.NEVER - (times[at] if at < len(times) else self.NEVER)

    def ranks(self, names: np.ndarray, ticks, cost: float | None, chain: bool) -> np.ndarray:
        return np.fromiter((self.rank(n, 0, None) for n in names.tolist()), dtype=np.int64, count=len(names))


class LookupRecorder(LRU):
    """LRU that records every name each call of a replay looks up (``lookups[k]`` for call ``k``, told by ``begin``):
    run a replay once with it (unbounded, say) to build the ``OfflineOptimal`` of the same calls."""

    name = "lookup-recorder"

    def __init__(self, num_pages: int = 1, clock: Clock = lambda: 0):
        super().__init__(num_pages, clock)
        self.lookups: list[list[int]] = []

    def begin(self, request: int) -> None:
        """The replay is about to serve call ``request`` of its order."""
        while len(self.lookups) <= request:
            self.lookups.append([])

    def looked_up(self, names, hits: int, held: bool = False) -> None:
        if not self.lookups:
            self.lookups.append([])
        self.lookups[-1].extend(names)
