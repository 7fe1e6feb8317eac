"""How long an entry is worth keeping after a use, learned online per lookup-count class for the pool it is on
(``KeepDurations``; ``mmcache.eviction``'s ``odds`` adds it to its keys)."""

from __future__ import annotations

import bisect
import math
from itertools import repeat
from typing import Callable, Sequence

import numpy as np

BINS = 64  # half-octaves of ticks: distances from 1 to 2**32
_EDGES = 2.0 ** (np.arange(BINS + 1) / 2)
_UPPER = _EDGES[1:]                             # a bin's distances are below this
_MIDDLE = np.sqrt(_EDGES[:-1] * _EDGES[1:])     # and this is their typical one


class KeepDurations:
    """``ticks[c]``: how many ticks after its last use an entry of class ``c`` (its name's lookups, capped at
    ``classes``) is worth keeping, for a pool of ``num_pages``.

    Learned per class: its **visits** (lookups of names of it) and, of those, how many ticks passed until the name's
    next lookup (a histogram in half-octaves; a visit with no next lookup yet counts as none, so a class reads low
    while its names are out). Keeping class ``c`` for ``T`` ticks hits the visits whose next lookup comes within
    ``T`` and, by Little's law, holds on average its visits per tick times the mean of ``min(distance, T)`` pages.
    ``ticks`` is the choice of ``T`` per class that hits the most visits for the pool's pages: each class's curve
    (pages held, visits hit) over ``T`` is taken by its upper concave hull, and the hull segments of every class
    steepest first while they fit (the fractional knapsack's order; the segment it would split is left out, as a key
    cannot keep a share of a class longer). More pages never shorten a class's ``T``. Only differences between
    classes order entries (a pool's eviction frontier sets the common part), so live requests' pages, which the
    budget ignores, shift it and do not bend it.

    Why not frequency alone: where names seen once rarely come back (a chat trace's one-off prompts) the best use of
    a small pool keeps them not at all and the names seen twice for several turnovers; where every class comes back
    alike (an agent's history) the durations are equal and frequency decides.

    State: one int per name (its last lookup's tick, shifted past the bits ``classes`` takes, and its class), pruned
    with the use-count table it rides on (``halve``)."""

    __slots__ = ("budget", "classes", "ticks", "_bits", "_clock", "_last", "_visits", "_returns", "_span",
                 "_at", "_since")
    REFRESH = 16  # lookups between two solves (the curves move slowly)

    def __init__(self, num_pages: int, classes: int, clock: Callable[[], int]):
        assert classes > 0
        self._bits = classes.bit_length()   # a name's last lookup keeps its class in these low bits
        self.budget = float(max(1, num_pages))
        self.classes = classes
        self.ticks = np.zeros(classes + 1)  # class 0 (never looked up) reads as class 1
        self._clock = clock
        self._last: dict[int, int] = {}     # name -> the tick of its last lookup << _bits | the class it was in
        self._visits = np.zeros(classes + 1)
        self._returns = np.zeros((classes + 1) * BINS)  # [class * BINS + bin]: visits whose next lookup came then
        self._span = 0.0                    # ticks the statistics cover (decayed with them)
        self._at = clock()
        self._since = 0

    def _now(self) -> int:
        now = self._clock()
        self._span += now - self._at
        self._at = now
        return now

    def returned(self, names: Sequence[int]) -> None:
        """``names`` are looked up now (before they are counted): the distances from their last lookups."""
        now = self._now()
        last = np.fromiter(map(self._last.get, names, repeat(-1)), dtype=np.int64, count=len(names))
        self._count_returns(now, last[last >= 0])

    def returned_chain(self, names: Sequence[int]) -> None:
        """``returned`` for one chain, by runs. A page is looked up whenever a page below it is, and its count is
        never below theirs, so the last lookups (tick, then class) never rise along a chain: each run of equal ones
        is found by a binary search, a few dozen reads for a long chain."""
        now = self._now()
        get, start, n = self._last.get, 0, len(names)
        bits = self._bits
        mask = (1 << bits) - 1
        down = lambda name: -get(name, -1)  # noqa: E731  (ascending along the chain)
        while start < n:
            last = get(names[start], -1)
            if last < 0:  # never looked up, or forgotten: so is every page below
                break
            end = bisect.bisect_right(names, -last, lo=start, key=down)
            distance = max(now - (last >> bits), 1)
            self._returns[(last & mask) * BINS + min(int(2 * math.log2(distance)), BINS - 1)] += end - start
            start = end

    def _count_returns(self, now: int, last: np.ndarray) -> None:
        if len(last):  # last: tick << _bits | the class it was looked up in (counts halve in between: not from them)
            distance = np.maximum(now - (last >> self._bits), 1)
            bins = np.minimum((2 * np.log2(distance)).astype(np.int64), BINS - 1)
            classes = last & ((1 << self._bits) - 1)
            self._returns += np.bincount(classes * BINS + bins, minlength=self._returns.size)

    def visited(self, names: Sequence[int], counts: np.ndarray) -> None:
        """``names`` were looked up now and counted: ``counts`` their lookups so far (an int64 array, one each; 0 for
        a name the count table just forgot, which is not kept), whose class is the count capped at ``classes``."""
        classes = np.minimum(counts, self.classes)
        self._visits += np.bincount(classes[classes > 0], minlength=self.classes + 1)
        at = self._at << self._bits
        self._last.update((n, at | c) for n, c in zip(names, classes.tolist()) if c)
        self._visited()

    def visited_chain(self, names: Sequence[int], at_least: Sequence[int]) -> None:
        """``visited`` for one chain, by runs: ``at_least[c]`` of its names have been looked up ``c`` times or more
        (counts never rise along a chain)."""
        top = self.classes
        for c in range(1, top + 1):
            start, end = (at_least[c + 1] if c < top else 0), at_least[c]
            if end > start:
                self._visits[c] += end - start
                run = names if start == 0 and end == len(names) else names[start:end]
                self._last.update(zip(run, repeat((self._at << self._bits) | c)))
        self._visited()

    def _visited(self) -> None:
        self._since += 1
        if self._since >= self.REFRESH:
            self._solve()

    def returns_by_class(self) -> tuple[np.ndarray, np.ndarray]:
        """Per class (decayed with the statistics): its visits, and how many of them came back."""
        return self._visits.copy(), self._returns.reshape(self.classes + 1, BINS).sum(axis=1)

    def last_lookup(self, name: int) -> tuple[int, int]:
        """The tick of ``name``'s last lookup and the class it was in then ((-1, 0): none kept for it)."""
        last = self._last.get(name, -1)
        return (-1, 0) if last < 0 else (last >> self._bits, last & ((1 << self._bits) - 1))

    def halve(self, kept) -> None:
        """The use-count table was halved: the statistics weigh half, and only names in ``kept`` keep a tick."""
        self._visits *= 0.5
        self._returns *= 0.5
        self._span *= 0.5
        self._last = {n: t for n, t in self._last.items() if n in kept}

    def _solve(self) -> None:
        self._since = 0
        if self._span > 0:
            ticks = self._choose(self._segments())
            ticks[0] = ticks[1]
            self.ticks = ticks

    def _segments(self) -> list[tuple[float, float, int, float, float]]:
        """Every class's hull segments, steepest first: (visits hit per page held, pages held, class, T from, T to)."""
        segments = []
        returns = self._returns.reshape(self.classes + 1, BINS)
        for c in range(1, self.classes + 1):
            at = np.flatnonzero(returns[c])  # T past a bin no visit came back in only holds more
            if not len(at):
                continue
            hit = np.cumsum(returns[c])[at]
            held = (np.cumsum(returns[c] * _MIDDLE)[at] + np.maximum(self._visits[c] - hit, 0) * _UPPER[at])
            hull = [(0.0, 0.0, 0.0)]
            for x, y, t in zip((held / self._span).tolist(), (hit / self._span).tolist(), _UPPER[at].tolist()):
                while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                          <= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                    hull.pop()
                hull.append((x, y, t))
            for (x0, y0, t0), (x1, y1, t1) in zip(hull, hull[1:]):
                segments.append(((y1 - y0) / max(x1 - x0, 1e-12), x1 - x0, c, t0, t1))
        segments.sort(key=lambda s: -s[0])
        return segments

    def _choose(self, segments) -> np.ndarray:
        """Each class's T: the segments taken steepest first while they fit the pool's pages, stopping before the
        first that does not."""
        ticks, budget = np.zeros(self.classes + 1), self.budget
        for _, cost, c, t0, t1 in segments:
            if cost > budget:  # the optimum keeps a share of the class to t1, which keys cannot say: stop at t0
                break
            ticks[c] = t1
            budget -= cost
        return ticks
