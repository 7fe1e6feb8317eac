"""Eviction policies: what to drop first when a live owner needs pages, kept apart from the caches that hold them.

A policy only orders. The caches on a pool (prefix indexes, the encoder store, host tiers) keep every invariant:
they offer only pages no live request holds, a page leaves with its indexed descendants, and every hit is verified.
A cache asks its pool's policy for an entry's **eviction key** whenever the entry is stored or used (``key``), keeps
it per entry, and evicts the lowest keys first (``mmcache.reclaim`` merges the caches of one pool by key). Two rules
every policy keeps, so the caches' lazy heaps stay exact:

- an entry's key never decreases while it is cached (a cache passes the key it holds as ``floor``);
- keys of every cache on one pool compare: they are ticks of the pool's one clock, plus a bonus in ticks.

Policies (``POLICIES``; ``make_policy(name)``):

- ``lru``: the tick of the last use. Deeper pages first among equal ticks (the caches subtract the depth), so cold
  tails leave from their ends.
- ``lfu``: the tick of the last use plus one **generation** per recent use of the entry's name: a generation is how
  long an unused entry has lately stayed in the pool (measured from the evictions, ``Lifetimes``), so an entry used
  ``k`` times outlives one used once by ``k - 1`` pool turnovers (GreedyDual's aging by inflation, in ticks). Uses are
  counted per name, also after the entry left (``UseCounts``: a ghost history bounded by the pool), so a prefix
  that comes back is known.
- ``adaptive`` (the default): ``lru``'s or ``lfu``'s key, whichever of the two is realizing more reuse on this
  traffic lately. Both run as **shadow caches** on a sample of the names looked up (``SAMPLE`` of them, by name, in
  a pool of the same share of the pages: set dueling), scored by their hits with a decay; the real pool takes the
  winner's keys from then on. LRU thrashes on loops (sessions in flight that need more pages than the pool holds)
  and frequency wins there; frequency keeps dead history too long when the pool is large, and recency wins there.
- ``optimal`` (``OfflineOptimal``): the offline optimum for a replay, whose future is known (Belady: the entry whose
  next use is farthest goes first). Not an online policy; it bounds what any policy can keep.

Costs: ``lru`` is one tick per use. ``lfu`` adds a dict update per page used. ``adaptive`` adds, per lookup, one
modulo per name and the shadow work of the sampled names (1 in ``SAMPLE``), a heap operation each.
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, Iterable, Protocol, Sequence

from mmcache.errors import InvalidConfig

SAMPLE = 16            # adaptive: one name in SAMPLE runs through the shadow caches
SCORE_DECAY = 0.99     # adaptive: a lookup's hit difference weighs this much less at every later lookup
COUNT_TABLE_PAGES = 4  # lfu: the use-count table holds at most this many names per page of the pool


class EvictionPolicy(Protocol):
    """Orders a pool's cached entries (see the module docstring). Called under the pool's ``cache_lock``."""

    name: str
    monotone: bool  # keys never fall while an entry stays (the caches' lazy heaps rely on it); False: push at each

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        """The eviction key of the entry named ``name`` used (or stored) at ``tick``: at least ``floor`` (the key it
        holds). Lower keys are evicted first. A use is counted here: call it once per use."""

    def looked_up(self, names: Sequence[int]) -> None:
        """A request looked up the chain ``names`` (before matching): what an adaptive policy samples."""

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

    def looked_up(self, names: Sequence[int]) -> None:
        pass

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        pass


class UseCounts:
    """Recent uses per name, kept after the entry left (a ghost history). Bounded: past ``limit`` names, every count
    is halved and the names at zero are dropped, which also ages the counts."""

    __slots__ = ("counts", "limit")

    def __init__(self, limit: int):
        self.counts: dict[int, int] = {}
        self.limit = limit

    def add(self, name: int) -> int:
        """Count one use of ``name``; its recent uses, this one included."""
        counts = self.counts
        k = counts[name] = counts.get(name, 0) + 1
        if len(counts) > self.limit:
            self.counts = {n: c >> 1 for n, c in counts.items() if c > 1}
            k = self.counts.get(name, 0) or 1
        return k


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
    """The tick of the last use plus a generation (``Lifetimes.mean``) per recent use beyond the first (``UseCounts``):
    frequency with aging, in the pool's ticks."""

    name = "lfu"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.uses = UseCounts(COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = Lifetimes(clock)

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        k = tick + int((self.uses.add(name) - 1) * self.lifetimes.mean)
        return k if k > floor else floor

    def looked_up(self, names: Sequence[int]) -> None:
        pass

    def evicted(self, keys: Iterable[int], ticks: Iterable[int]) -> None:
        self.lifetimes.evicted(ticks)


class ShadowCache:
    """A names-only cache of ``capacity`` entries under ``lru`` or ``lfu`` keys (lazy heap, one entry per key change):
    how many of a chain's names it would have held. Pages are independent here (no chains): it only scores."""

    __slots__ = ("capacity", "frequency", "keys", "heap", "tick", "uses", "generation", "_evictions")

    def __init__(self, capacity: int, frequency: bool):
        self.capacity, self.frequency = max(1, capacity), frequency
        self.keys: dict[int, float] = {}
        self.heap: list[tuple[float, int]] = []
        self.tick = 0
        self.uses = UseCounts(COUNT_TABLE_PAGES * self.capacity)
        self.generation, self._evictions = 1.0, 0

    def request(self, names: Sequence[int]) -> int:
        """Look up ``names`` (each then used or stored); how many were held."""
        self.tick += 1
        hits, keys = 0, self.keys
        for name in names:
            hits += name in keys
            key = self.tick
            if self.frequency:
                key += (self.uses.add(name) - 1) * self.generation
            if name not in keys:
                while len(keys) >= self.capacity:
                    self._evict_one()
            keys[name] = key
            heapq.heappush(self.heap, (key, name))
        return hits

    def _evict_one(self) -> None:
        while True:
            key, name = heapq.heappop(self.heap)
            if self.keys.get(name) == key:
                del self.keys[name]
                self.generation += (max(1.0, self.tick - key) - self.generation) * 0.01
                return


class Adaptive:
    """``lru``'s or ``lfu``'s key, whichever shadow cache realizes more on a sample of the lookups (set dueling)."""

    name = "adaptive"
    monotone = True

    def __init__(self, num_pages: int, clock: Callable[[], int]):
        self.lfu = LFU(num_pages, clock)
        shadow_pages = max(1, num_pages // SAMPLE)
        self.shadows = (ShadowCache(shadow_pages, False), ShadowCache(shadow_pages, True))
        self.score = 0.0  # > 0: the frequency shadow realized more lately
        self.frequency = False

    def key(self, name: int, tick: int, floor: int = 0) -> int:
        if self.frequency:
            return self.lfu.key(name, tick, floor)
        self.lfu.uses.add(name)  # counts kept either way, so a switch finds them
        return tick if tick > floor else floor

    def looked_up(self, names: Sequence[int]) -> None:
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


POLICIES: dict[str, type] = {"lru": LRU, "lfu": LFU, "adaptive": Adaptive}
DEFAULT_POLICY = "adaptive"


def make_policy(name: str | None, num_pages: int, clock: Callable[[], int]) -> EvictionPolicy:
    """The online policy ``name`` (None: ``DEFAULT_POLICY``) for a pool of ``num_pages`` on ``clock`` (its current
    tick). ``InvalidConfig`` for an unknown name."""
    name = DEFAULT_POLICY if name is None else name
    if name not in POLICIES:
        raise InvalidConfig(f"unknown eviction policy {name!r}; expected one of {', '.join(POLICIES)}")
    return POLICIES[name](num_pages, clock)
