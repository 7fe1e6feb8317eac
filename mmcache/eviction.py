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
- ``lfu`` (the default): the tick of the last use plus ``GENERATIONS_PER_USE`` **generations** per recent lookup of the entry's
  name beyond the first: a generation is how long an unused entry has lately stayed in the pool (measured from the
  evictions, ``Lifetimes``), so an entry looked up ``k`` times outlives one looked up once by ``2 (k - 1)`` pool
  turnovers (GreedyDual's aging by inflation, in ticks). Lookups are counted per name, also after the entry left
  (``UseCounts``: a ghost history bounded by the pool), so a prefix that comes back is known.
- ``adaptive``: ``lru``'s or ``lfu``'s key, whichever of the two is realizing more reuse on this traffic lately.
  Both run as **shadow caches** on a sample of the names looked up (``SAMPLE`` of them, by name, in a pool of the
  same share of the pages: set dueling), scored by their hits with a decay; the real pool takes the winner's keys
  from then on. A hedge for traffic where frequency would keep dead history too long. Measured, it realizes less
  than ``lfu`` (its shadows see neither chains nor live requests, so they misjudge which wins) and was nowhere
  ahead of it, so it is not the default (``benchmarks/bench_eviction.py``).
- ``optimal`` (``OfflineOptimal``): the offline optimum for a replay, whose future is known (Belady: the entry whose
  next use is farthest goes first). Not an online policy; it bounds what any policy can keep.

Costs: ``lru`` is one tick per use. ``lfu`` adds a dict update per name looked up and a dict read per key.
``adaptive`` adds, per lookup, one modulo per name and the shadow work of the sampled names (1 in ``SAMPLE``), a heap
operation each.
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter
from typing import Callable, Iterable, Protocol, Sequence

import numpy as np

from mmcache.errors import InvalidConfig

SAMPLE = 16            # adaptive: one name in SAMPLE runs through the shadow caches
SCORE_DECAY = 0.99     # adaptive: a lookup's hit difference weighs this much less at every later lookup
COUNT_TABLE_PAGES = 4  # lfu: the use-count table holds at most this many names per page of the pool
GENERATIONS_PER_USE = 2  # lfu: how many pool turnovers each lookup beyond the first buys an entry


class EvictionPolicy(Protocol):
    """Orders a pool's cached entries (see the module docstring). Called under the pool's ``cache_lock``."""

    name: str
    monotone: bool  # keys never fall while an entry stays (the caches' lazy heaps rely on it); False: push at each

    def looked_up(self, names: Sequence[int]) -> None:
        """A request looked up ``names`` (a chain, before matching; an encoder key): one use of each."""

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        """The eviction key of the entry named ``name`` used (or stored) at ``tick``: at least ``floor`` (the key it
        holds). Lower keys are evicted first."""

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray) -> np.ndarray:
        """``key`` of many entries at once (uint64 names, int64 floors; ``ticks`` one for all or one each)."""

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        """Entries with these keys and last-use ticks left the pool at the pool's current tick."""


class LRU:
    """The tick of the last use: the RFC's rule and every peer's."""

    name = "lru"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        pass

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        return tick if tick > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray) -> np.ndarray:
        return np.maximum(floors, ticks)

    def looked_up(self, names: Sequence[int]) -> None:
        pass

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        pass


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


class LFU:
    """The tick of the last use plus ``GENERATIONS_PER_USE`` generations (``Lifetimes.mean``) per recent lookup
    beyond the first (``UseCounts``): frequency with aging, in the pool's ticks."""

    name = "lfu"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.uses = UseCounts(COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = Lifetimes(clock)

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        k = tick + int(max(0, self.uses.counts.get(name, 0) - 1) * GENERATIONS_PER_USE * self.lifetimes.mean)
        return k if k > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray) -> np.ndarray:
        # a Counter answers 0 for a name it lacks
        counts = np.fromiter(map(self.uses.counts.__getitem__, names.tolist()), dtype=np.int64, count=len(names))
        bonus = (np.maximum(counts - 1, 0) * (GENERATIONS_PER_USE * self.lifetimes.mean)).astype(np.int64)
        return np.maximum(floors, ticks + bonus)

    def looked_up(self, names: Sequence[int]) -> None:
        self.uses.add(names)

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

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        if self.frequency:
            return self.lfu.key(name, tick, floor)
        return tick if tick > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray) -> np.ndarray:
        return self.lfu.keys(names, ticks, floors) if self.frequency else np.maximum(floors, ticks)

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

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        times = self._uses.get(name, ())
        at = bisect.bisect_right(times, self._now)
        return self.NEVER - (times[at] if at < len(times) else self.NEVER)

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray) -> np.ndarray:
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


POLICIES: dict[str, type] = {"lru": LRU, "lfu": LFU, "adaptive": Adaptive}
DEFAULT_POLICY = "lfu"


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
