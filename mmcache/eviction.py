"""Eviction policies: what to drop first when a live owner needs pages, kept apart from the caches that hold them.

A policy only orders. The caches on a pool (prefix indexes, the encoder store) keep every invariant: they offer
only pages no live request holds, a page leaves with its indexed descendants, and every hit is verified. A cache
tells the pool's policy what each request looks up (``looked_up``: the uses a policy counts), asks it for an entry's
**eviction key** whenever the entry is stored or used (``key``, or ``keys`` for many at once), keeps it per entry,
and evicts the lowest keys first (``mmcache.reclaim`` merges the caches of one pool by key). Two rules every policy
keeps, so the caches' lazy heaps stay exact:

- an entry's key never decreases while it is cached (a cache passes the key it holds as ``floor``);
- keys of every cache on one pool compare: they are ticks of the pool's one clock, plus a bonus in ticks.

Policies (``POLICIES``; ``make_policy(name)``):

- ``lru``: the tick of the last use. Deeper pages first among equal ticks (the caches subtract the depth), so cold
  tails leave from their ends.
- ``odds`` (the default): the tick of the last use, plus the **keep duration** learned for the entry's lookup count
  (``KeepDurations``: per count, how far apart a name's lookups come, and the durations that hit the most lookups
  the pool's pages can hold), plus ``GENERATIONS_PER_USE`` **generations** per further lookup the entry's name is
  expected to get. A generation is how long an unused entry has lately stayed in the pool (measured from the
  evictions, ``Lifetimes``). The expectation is learned online per lookup count (``ReturnOdds``): of the names that
  reached ``c`` lookups, the share that reached ``c + 1`` (shrunk toward the share over every count,
  ``PRIOR_LOOKUPS``) gives the odds of one more; lookups are counted per name, also after the entry left
  (``UseCounts``: a ghost history bounded by the pool). The durations say how long each count is worth keeping on
  this pool (on a short pool, one-off prompts not at all and a conversation's twice-sent history for several
  turnovers); the odds rank by frequency where it predicts reuse (an agent's history, re-sent by every call) and not
  where it does not (a finished chat session's pages, looked up as often as a live one's, never return: their count
  class says so).
- ``lfu``: the tick of the last use plus ``GENERATIONS_PER_USE`` generations per recent lookup of the entry's name
  beyond the first (GreedyDual's aging by inflation, in ticks): frequency alone.

Costs, for ``odds`` and ``lfu``: where the caches give them (an encoder output's forward time per page it holds, a KV
page's prefill time), an entry's bonus over its last use (``odds``: its keep duration and expected lookups; ``lfu``: its
lookups) is weighed by its cost over the pool's running mean (GreedyDual-Size-Frequency), so one pool holding both
kinds keeps what saves most; with none, every entry is average.

- ``adaptive``: ``lru``'s or ``lfu``'s key, whichever of the two is realizing more reuse on this traffic lately.
  Both run as **shadow caches** on a sample of the names looked up (``SAMPLE`` of them, by name, in a pool of the
  same share of the pages: set dueling), scored by their hits with a decay; the real pool takes the winner's keys
  from then on. A hedge for traffic where frequency would keep dead history too long. Measured, it realizes less
  than either most of the time (its shadows see neither chains nor live requests, so they misjudge which wins;
  ``benchmarks/bench_eviction.py``).
- ``optimal`` (``OfflineOptimal``): the offline optimum for a replay, whose future is known (Belady: the entry whose
  next use is farthest goes first). Not an online policy; it bounds what any policy can keep, counting hits (it takes
  no cost: the optimum of time saved weighs entries, a harder problem).

What the policies cost: ``lru`` is one tick per use. ``lfu`` adds a dict update per name looked up and a dict read per
key; ``odds`` the same, a dict write per name looked up (its last lookup's tick), and per lookup where each count
class of the chain begins and where its last lookups change (binary searches: both never rise along a chain), and
every ``REFRESH`` lookups its tables. ``adaptive`` adds, per lookup, one modulo per name and the shadow work of the
sampled names (1 in ``SAMPLE``), a heap operation each.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from mmcache.errors import InvalidConfig
from mmcache.keep_durations import KeepDurations

SAMPLE = 16            # adaptive: one name in SAMPLE runs through the shadow caches
SCORE_DECAY = 0.99     # adaptive: a lookup's hit difference weighs this much less at every later lookup
COUNT_TABLE_PAGES = 16  # lfu, odds: the use-count table holds at most this many names per page of the pool
GENERATIONS_PER_USE = 2  # lfu, odds: how many pool turnovers each (expected) further lookup buys an entry
COUNT_CLASSES = 8      # odds: lookup counts past this share one learned return rate
PRIOR_LOOKUPS = 1      # odds: a class's return rate leans on the rate of all classes by this many lookups' names


class EvictionPolicy(Protocol):
    """Orders a pool's cached entries (see the module docstring). Called under the pool's ``cache_lock``."""

    name: str
    monotone: bool  # keys never fall while an entry stays (the caches' lazy heaps rely on it); False: push at each

    def looked_up(self, names: Sequence[int]) -> None:
        """A request looked up ``names`` (a chain, before matching; an encoder key): one use of each."""

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        """The eviction key of the entry named ``name`` used (or stored) at ``tick``: at least ``floor`` (the key it
        holds). ``cost``: the seconds of recompute the entry saves per page it holds at each hit (None: unknown, as
        an average entry's). Lower keys are evicted first."""

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        """``key`` of many entries at once (uint64 names, int64 floors; ``ticks`` one for all or one each; one
        ``cost`` for all). ``chain``: the names are one chain in order, so lookup counts never rise along them (a
        policy may read them by runs)."""

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        """Entries with these keys and last-use ticks left the pool at the pool's current tick."""


class LRU:
    """The tick of the last use: the RFC's rule and every peer's."""

    name = "lru"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        pass

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        return tick if tick > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        return np.maximum(floors, ticks)

    def looked_up(self, names: Sequence[int]) -> None:
        pass

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        pass


def chain_at_least(names: Sequence[int], count: Callable[[int], int], top: int) -> list[int]:
    """``at_least[c]``: how many of the chain's ``names`` have ``count(name) >= c``, for ``c`` from 0 to ``top``. A page
    is looked up whenever a page below it is, so counts never rise along a chain: where each count begins is a binary
    search, not a read of every name (a long chain costs a few dozen reads)."""
    down = lambda name: -count(name)  # noqa: E731  (ascending along the chain)
    return [len(names)] + [bisect.bisect_right(names, -c, key=down) for c in range(1, top + 1)]


class UseCounts:
    """Recent uses per name, kept after the entry left (a ghost history). Bounded: past ``limit`` names, every count
    is halved and the names at zero are dropped, which also ages the counts."""

    __slots__ = ("counts", "limit")

    def __init__(self, limit: int):
        self.counts: Counter[int] = Counter()
        self.limit = limit

    def add(self, names: Iterable[int]) -> None:
        """Count one use of each of ``names`` (``Counter.update`` counts in C)."""
        self.counts.update(names)
        if len(self.counts) > self.limit:
            self.counts = Counter({n: c >> 1 for n, c in self.counts.items() if c > 1})


class Lifetimes:
    """How long an entry lately stayed in the pool unused before it was evicted, in ticks (a running mean over
    evictions; 1 until the first)."""

    __slots__ = ("mean", "_clock")

    def __init__(self, clock: Callable[[], int]):
        self.mean = 1.0
        self._clock = clock

    def evicted(self, ticks: Iterable[int]) -> None:
        now = self._clock()
        for t in ticks:
            self.mean += (max(1, now - t) - self.mean) * 0.01


class CostScale:
    """The running mean of the per-page costs entries were keyed with (seconds saved per page and hit), so a cost
    reads relative to the pool's average entry: 1.0 for an unknown cost, and until a cost is known."""

    __slots__ = ("mean",)

    def __init__(self):
        self.mean = 0.0

    def relative(self, cost: float | None, pages: int = 1) -> float:
        """``cost`` over the mean, after counting it for ``pages`` pages (the mean weighs each page keyed alike)."""
        if cost is None or not cost > 0:
            return 1.0
        self.mean = cost if self.mean == 0.0 else self.mean + (cost - self.mean) * min(1.0, 0.01 * pages)
        return cost / self.mean


class LFU:
    """The tick of the last use plus ``GENERATIONS_PER_USE`` generations (``Lifetimes.mean``) per recent lookup
    beyond the first (``UseCounts``): frequency with aging, in the pool's ticks. With costs, GreedyDual-Size-Frequency
    in those units: ``GENERATIONS_PER_USE x (uses x relative cost - 1)`` generations, so an entry that saves twice
    the average per page counts as looked up twice as often, and one that saves less leaves sooner (``CostScale``);
    at the average cost it is the count rule above."""

    name = "lfu"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.uses = UseCounts(COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = Lifetimes(clock)
        self.costs = CostScale()

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        uses = max(1, self.uses.counts.get(name, 0))
        k = tick + int((uses * self.costs.relative(cost) - 1) * GENERATIONS_PER_USE * self.lifetimes.mean)
        return k if k > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        # a Counter answers 0 for a name it lacks
        uses = np.fromiter(map(self.uses.counts.__getitem__, names.tolist()), dtype=np.int64, count=len(names))
        scale = GENERATIONS_PER_USE * self.lifetimes.mean
        bonus = ((np.maximum(uses, 1) * self.costs.relative(cost, len(names)) - 1) * scale).astype(np.int64)
        return np.maximum(floors, ticks + bonus)

    def looked_up(self, names: Sequence[int]) -> None:
        self.uses.add(names)

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        self.lifetimes.evicted(ticks)



class ReturnOdds:
    """How likely a name looked up ``c`` times is looked up again, learned online per count ``c`` (capped at
    ``COUNT_CLASSES``): of the names that reached ``c`` lookups, the share that reached ``c + 1``, decayed with the
    use-count table. ``odds[c]`` is ``p / (1 - p)``: the expected further lookups if each comes with the same chance.
    A new name reads as class 1. The table is recomputed every ``REFRESH`` lookups (the rates move slowly).

    Each class's share is shrunk toward the share of all classes together by ``PRIOR_LOOKUPS`` lookups' worth of
    names (the mean names a lookup counts): the pages of one request reach a count together, so a class reached by one
    or two requests is one or two observations, not hundreds. Unshrunk, a class that a shared system prompt's few pages
    had reached read as 9 expected lookups (``p = 0.9``) before any session page reached it, and the keys the
    session pages took from it then never fell (keys only rise while an entry stays)."""

    __slots__ = ("reached", "odds", "table", "_since", "lookups", "names")
    REFRESH = 16

    def __init__(self):
        self.lookups = self.names = 0.0  # lookups counted and the names they held (decayed with the counts)
        self.reached = [0.0] * (COUNT_CLASSES + 2)  # [c]: names that reached c lookups (the top class: c or more)
        self.odds = np.zeros(COUNT_CLASSES + 2)      # for many names at once
        self.table = [0.0] * (COUNT_CLASSES + 2)     # the same, for one
        self._since = 0
        self._refresh()

    def add(self, counts: Iterable[int]) -> None:
        """Names looked up once more, with ``counts`` their counts now."""
        r, top = self.reached, COUNT_CLASSES + 1
        n = 0
        for c in counts:
            r[c if c < top else top] += 1
            n += 1
        self.names += n
        self._counted()

    def add_chain(self, names: Sequence[int], count: Callable[[int], int]) -> list[int]:
        """The names of one chain looked up once more, ``count(name)`` their counts now, read by runs
        (``chain_at_least``, which it returns)."""
        r, top = self.reached, COUNT_CLASSES + 1
        at_least = chain_at_least(names, count, top)
        for c in range(1, top + 1):
            r[c - 1] += at_least[c - 1] - at_least[c]
        r[top] += at_least[top]
        self.names += len(names)
        self._counted()
        return at_least

    def _counted(self) -> None:
        self.lookups += 1
        self._since += 1
        if self._since >= self.REFRESH:
            self._refresh()

    def halve(self) -> None:
        self.reached = [x * 0.5 for x in self.reached]
        self.lookups *= 0.5
        self.names *= 0.5
        self._refresh()

    def _refresh(self) -> None:
        r, odds = self.reached, self.table
        prior = PRIOR_LOOKUPS * self.names / max(1.0, self.lookups)  # one (mean) lookup's names
        pooled = (sum(r[2:]) + 0.5) / (sum(r[1:-1]) + 1.0)
        for c in range(1, COUNT_CLASSES + 1):  # class c: reached c + 1 of reached c
            p = min(0.99, (r[c + 1] + 0.5 + prior * pooled) / (r[c] + 1.0 + prior))
            odds[c] = p / (1 - p)
        odds[0], odds[-1] = odds[1], odds[-2]  # never looked up: as new; past the top: the top
        self.odds[:] = odds
        self._since = 0

    def of(self, count: int) -> float:
        return self.table[count if count <= COUNT_CLASSES else COUNT_CLASSES]


class Odds:
    """The tick of the last use plus the learned keep duration of the entry's lookup-count class
    (``KeepDurations``) plus ``GENERATIONS_PER_USE`` generations (``Lifetimes.mean``) per further lookup the entry's
    name is expected to get (``ReturnOdds`` of its count, ``UseCounts``), all times its relative cost
    (``CostScale``). The durations say how long a class is worth keeping for this pool (a one-off prompt's pages: not
    at all when the pool is short); the odds rank within them by frequency where it predicts reuse (an agent's
    history), and not where it does not (a finished session's pages, looked up as often as a live one's)."""

    name = "odds"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.uses = UseCounts(COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = Lifetimes(clock)
        self.costs = CostScale()
        self.returns = ReturnOdds()
        self.durations = KeepDurations(num_pages, COUNT_CLASSES, clock)

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        c = min(self.uses.counts.get(name, 0), COUNT_CLASSES)
        bonus = self.durations.ticks[c] + self.returns.table[c] * GENERATIONS_PER_USE * self.lifetimes.mean
        k = tick + int(bonus * self.costs.relative(cost))
        return k if k > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        counts = self.uses.counts
        if chain and len(names) > 64:  # classes by runs
            at_least = chain_at_least(names.tolist(), counts.__getitem__, COUNT_CLASSES)
            c = np.repeat(np.arange(COUNT_CLASSES, -1, -1), np.diff(at_least[::-1], prepend=0))
        else:
            c = np.fromiter(map(counts.__getitem__, names.tolist()), dtype=np.int64, count=len(names))
            c = np.minimum(c, COUNT_CLASSES)
        bonus = self.durations.ticks[c] + self.returns.odds[c] * (GENERATIONS_PER_USE * self.lifetimes.mean)
        return np.maximum(floors, ticks + (bonus * self.costs.relative(cost, len(names))).astype(np.int64))

    def looked_up(self, names: Sequence[int]) -> None:
        chain = len(names) > 64  # long: by runs (counts never rise along a chain); few: one by one
        if chain:
            self.durations.returned_chain(names)
        else:
            self.durations.returned(names)
        size = len(self.uses.counts)
        self.uses.add(names)
        counts = self.uses.counts
        if len(counts) < size:  # the table was halved: its history weighs half
            self.returns.halve()
            self.durations.halve(counts)
        if chain:
            self.durations.visited_chain(names, self.returns.add_chain(names, counts.__getitem__))
        else:
            now = np.fromiter(map(counts.__getitem__, names), dtype=np.int64, count=len(names))
            self.returns.add(now.tolist())
            self.durations.visited(names, now)

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        self.lifetimes.evicted(ticks)


class ShadowCache:
    """A names-only cache of ``capacity`` entries ordered by a policy of its own (``kind``, on its own clock: one tick
    per request): how many of a chain's names it would have held. Pages are independent here (no chains): it only
    scores."""

    __slots__ = ("capacity", "policy", "entries", "heap", "tick")

    def __init__(self, capacity: int, kind: type):
        self.capacity = max(1, capacity)
        self.tick = 0
        self.policy = kind(self.capacity, lambda: self.tick)
        self.entries: dict[int, tuple[int, int]] = {}  # name -> (key, tick of the last use)
        self.heap: list[tuple[int, int]] = []

    def request(self, names: Sequence[int]) -> int:
        """Look up ``names`` (each then used or stored); how many were held."""
        self.tick += 1
        self.policy.looked_up(names)
        hits, entries, key = 0, self.entries, self.policy.key
        for name in names:
            held = entries.get(name)
            hits += held is not None
            if held is None:
                while len(entries) >= self.capacity:
                    self._evict_one()
            k = key(name, self.tick, 0 if held is None else held[0])
            entries[name] = (k, self.tick)
            heapq.heappush(self.heap, (k, name))
        return hits

    def _evict_one(self) -> None:
        while True:
            k, name = heapq.heappop(self.heap)
            held = self.entries.get(name)
            if held is not None and held[0] == k:
                del self.entries[name]
                self.policy.evicted([k], [held[1]])
                return


class Adaptive:
    """``lru``'s or ``lfu``'s key, whichever shadow cache realizes more on a sample of the lookups (set dueling)."""

    name = "adaptive"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.lfu = LFU(num_pages, clock)
        shadow_pages = max(1, num_pages // SAMPLE)
        self.shadows = (ShadowCache(shadow_pages, LRU), ShadowCache(shadow_pages, LFU))
        self.score = 0.0  # > 0: the frequency shadow realized more lately
        self.frequency = False

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        if self.frequency:
            return self.lfu.key(name, tick, floor, cost)
        return tick if tick > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        return self.lfu.keys(names, ticks, floors, cost) if self.frequency else np.maximum(floors, ticks)

    def looked_up(self, names: Sequence[int]) -> None:
        self.lfu.looked_up(names)  # counted either way, so a switch finds them
        sampled = [n for n in names if n % SAMPLE == 0]
        if not sampled:
            return
        recency, frequency = self.shadows
        self.score = self.score * SCORE_DECAY + frequency.request(sampled) - recency.request(sampled)
        self.frequency = self.score > 0

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        self.lfu.evicted(keys, ticks)


class OfflineOptimal:
    """Belady's rule for a replay whose lookups are known in advance (``lookups``: every chain ``looked_up`` will be
    given, in order, as the index sees them): the entry whose name is looked up next farthest in the future goes
    first; never looked up again, first of all. A parent is looked up whenever its child is, so its next use is never
    later and what stays is prefix-closed. Keys fall when an entry is used (its next use moves on), so caches push a
    fresh heap item at every key change (``monotone`` is False)."""

    name = "optimal"
    monotone = False
    NEVER = 1 << 40

    def __init__(self, lookups: Sequence[Sequence[int]]):
        uses: dict[int, list[int]] = {}
        for t, names in enumerate(lookups):
            for name in names:
                uses.setdefault(name, []).append(t)
        self._uses = uses
        self._now = -1  # the lookup being served

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        times = self._uses.get(name, ())
        at = bisect.bisect_right(times, self._now)
        return self.NEVER - (times[at] if at < len(times) else self.NEVER)

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        return np.fromiter((self.key(n, 0) for n in names.tolist()), dtype=np.int64, count=len(names))

    def looked_up(self, names: Sequence[int]) -> None:
        self._now += 1

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        pass


class LookupRecorder(LRU):
    """LRU that records every chain looked up: run a replay once with it (unbounded, say) to build the
    ``OfflineOptimal`` of the same calls."""

    def __init__(self, num_pages: int = 0, clock: Callable[[], int] | None = None):
        self.lookups: list[list[int]] = []

    def looked_up(self, names: Sequence[int]) -> None:
        self.lookups.append(list(names))


def entry_name(key) -> int:
    """The 64-bit name a policy counts the uses of a cache entry with no page name by (an encoder output's key: its
    hash in this process, so counts live as long as the process does)."""
    return hash(key) & 0xFFFFFFFFFFFFFFFF


POLICIES: dict[str, type] = {"lru": LRU, "lfu": LFU, "odds": Odds, "adaptive": Adaptive}
DEFAULT_POLICY = "odds"


def check_policy(name: str | None) -> str:
    """The online policy's name ``name`` stands for (None: ``DEFAULT_POLICY``); ``InvalidConfig`` for an unknown one.
    APIs that build their pools later call it up front, so a bad name fails before any state changes."""
    name = DEFAULT_POLICY if name is None else name
    if name not in POLICIES:
        raise InvalidConfig(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
    return name


def make_policy(name: str | None, num_pages: int, clock: Callable[[], int]) -> EvictionPolicy:
    """The online policy ``name`` (None: ``DEFAULT_POLICY``) for a pool of ``num_pages`` on ``clock`` (its current
    tick). ``InvalidConfig`` for an unknown name."""
    return POLICIES[check_policy(name)](num_pages, clock)
