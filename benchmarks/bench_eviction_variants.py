"""Prototypes of the default eviction policy's alternatives, against ``lru`` and the offline optimum on the same calls:
the figures behind the choice of ``odds`` (``mmcache.eviction``), kept so they can be reproduced and extended.

Every variant keys an entry ``base + K x generation x weight(count)`` (a generation is ``Lifetimes.mean``, the count
the recent lookups of the entry's name, as ``lfu``):

- ``weight``: ``lfu`` (count - 1: the shipped rule, K=2), ``log`` (log2 count), ``sqrt`` (sqrt(count - 1)), ``odds``
  (P/(1-P) of the learned probability P that a name looked up ``count`` times is looked up again: the ratio of names
  that reached count+1 to those that reached count, decayed with the count table), ``oddsc`` (the odds, at most the
  count), ``p`` (P), ``pc`` (P x count);
- ``base``: ``tick`` (the last use), or ``cold`` for entries looked up once (inserted at the eviction frontier, the
  key of the last entry evicted, so an unproven entry leaves first: LRU insertion, as in adaptive insertion
  policies), the last use for the others;
- ``turn``: a generation measured as the pool's turnover (ticks per page evicted times the pool's pages) instead of
  how long evicted entries sat unused (``Turnover``).

``gd:K[:noinherit|:blend|:relative|:tick]``: GreedyDual with learned per-class odds (``GreedyDual``; ``tick``: from
the last use instead of the eviction frontier). ``within:K:H``: ``odds`` whose class rates count a name only once
``H`` generations passed since it reached its count, and a return only within them (``OddsWithin``: no censoring of
names that had no time yet to come back). ``sel:S[:inherit]``: ``odds`` before its keep durations, with a name seen
once given its bonus S times over if its request's new pages were chosen (1 in S, by hash) and none otherwise
(``Selective``).

The default with its keep durations learned per another class (``ClassedDurations``, read name by name):
``count`` (the lookup count, as the default: ``CountDurations``), ``chain`` (names seen once by the count of the
chain they extend: ``ChainDurations``), ``fresh:B`` (the count and B sizes of the request's new pages:
``FreshDurations``), each with options after a colon: ``relative`` (keys less the longest duration), ``odds`` (the
expected lookups per class too), ``names`` (time counted in new names looked up, not ticks), ``bare`` (no expected
lookups: the durations alone), ``decayH`` (the durations' statistics halve every H turnovers), ``gated`` (the
expected lookups only for classes the durations keep), ``goon`` (the knapsack goes on past a segment that does not
fit: ``GoingOnDurations``). ``split``: the default with the hull segment its knapsack stops before taken for a share
of the lookups (``SplitDurations``).
``fixed:COLUMN``: the best keep times of one ``--bound`` column (``count``, ``+new pages``, ``all``, ...) for the
pool, chosen with the whole trace known, as a policy (``FixedKeepTimes``): what that column is worth in the replay
to a policy that needs no learning.

    python benchmarks/bench_eviction_variants.py --traces mooncake --variants lfu:2,lfu:4,log:4,odds:2
    python benchmarks/bench_eviction_variants.py --traces mt-bench --variants odds:2:cold
    python benchmarks/bench_eviction_variants.py --traces mooncake --why 2000
    python benchmarks/bench_eviction_variants.py --traces mooncake --bound
    python benchmarks/bench_eviction_variants.py --traces mooncake --variants "fixed:count,fixed:+new pages,fresh:8"
    python benchmarks/bench_eviction_variants.py --traces mt-bench --requests 14k
    python benchmarks/bench_eviction_variants.py --traces mooncake --quarters 4M --variants fixed:count

``--why PAGES`` explains instead where the optimum's gain comes from, on the lookups the ceiling records, in a
simulation of a cache of PAGES pages with no request in flight (each lookup hits its longest cached prefix, then
holds all its pages): the hits of ``lru``, ``lfu`` and Belady by how often the name was looked up before, and, for
names seen once, how often they come back by what an online policy could see.

``--bound`` prints, per pool size, what a policy that chooses how long to keep a name after each lookup from what it
sees at the lookup (a class) can hit at most, in the same lookups' order with no request in flight: time is counted
in new names (pages no earlier lookup had), a name kept ``T`` after a lookup hits if its next lookup comes within
``T``, and the pool's pages bound the names held on average (Little's law: the mean of ``min(distance, T)`` over
lookups, per new name), each class's curve taken by its concave hull (a class may be split at random). Columns: one
``T`` for every lookup (what ``lru`` does: the model's stand-in for it), one class split at random (keeping a random
share longer), the lookup count (what ``odds`` sees), the count with each of ``--why``'s features, and the oracle
(each lookup its own class: Belady without chains). The relaxation is loose where requests in flight hold much of the
pool (MT-Bench, Mooncake at 512k) and averages the pool over time.

``--quarters POOL`` prints the hit share of ``lru``, the default, each variant and the optimum in each quarter of the
trace's requests at one pool size: where in the trace a policy gains or loses.

``--durations POOL`` prints the keep durations the default learned at one pool size, per lookup count: the mean
over its solves, and the share of solves that kept the class at all.

``--requests POOL`` lists the requests whose matched tokens differ between ``lru``, the default and the optimum at
one pool size, and for each how many later calls of any session (returns) the default's replay had admitted when the
request's own previous call finished (when its pages were last keyed): what the policy could have learned by then.

Needs ../shared/data (as ``bench_eviction.py``). The replays are deterministic: one run each.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_eviction import TRACES, load  # noqa: E402

from mmcache import eviction  # noqa: E402
from mmcache.keep_durations import KeepDurations  # noqa: E402
from workloads.sizes import format_size, parse_sizes  # noqa: E402
from workloads.sizing.replay import replay_trace  # noqa: E402

COUNT_CLASSES = 8  # counts past this share one learned probability


def keys_one_by_one(key, names, ticks, floors) -> np.ndarray:
    """A prototype's ``keys``: its ``key`` of each entry (``ticks`` one for all or one each)."""
    ticks = np.broadcast_to(np.asarray(ticks), names.shape)
    return np.array([key(n, int(t), int(f)) for n, t, f in zip(names.tolist(), ticks.tolist(), floors.tolist())],
                    dtype=np.int64)


class Turnover:
    """A generation as the pool's turnover: ticks per page evicted (a running mean over evictions) times the pool's
    pages, where ``Lifetimes`` takes how long the evicted entries sat unused (which falls as a policy gets better at
    evicting dead entries early)."""

    def __init__(self, num_pages: int, clock):
        self.pages, self.clock, self.last, self.per_page = max(1, num_pages), clock, None, None

    @property
    def mean(self) -> float:
        return 1.0 if self.per_page is None else max(1.0, self.per_page * self.pages)

    def evicted(self, ticks) -> None:
        n = sum(1 for _ in ticks)
        if not n:
            return
        now = self.clock()
        if self.last is not None:
            dt = (now - self.last) / n
            self.per_page = dt if self.per_page is None else self.per_page + (dt - self.per_page) * min(1.0, 0.01 * n)
        self.last = now


class Variant:
    """``lfu``'s key with another weight per count and, optionally, cold insertion (see the module docstring)."""

    name = "variant"
    monotone = True

    def __init__(self, num_pages: int, clock, weight: str, k: float, cold: bool, turnover: bool = False):
        self.uses = eviction.UseCounts(eviction.COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = Turnover(num_pages, clock) if turnover else eviction.Lifetimes(clock)
        self.reached = np.zeros(COUNT_CLASSES + 2)  # names that reached each count (decayed with the table)
        self.frontier, self.weight_name, self.k, self.cold = 0, weight, k, cold

    def reuse_probability(self, count: int) -> float:
        c = min(count, COUNT_CLASSES)
        return min(0.99, (self.reached[c + 1] + 0.5) / (self.reached[c] + 1.0))  # the top class: count > COUNT_CLASSES

    def weight(self, count: int) -> float:
        count = max(1, count)
        if self.weight_name == "lfu":
            return count - 1
        if self.weight_name == "log":
            return float(np.log2(count))
        if self.weight_name == "sqrt":
            return float(np.sqrt(count - 1))
        p = self.reuse_probability(count)
        return {"odds": p / (1 - p), "oddsc": min(p / (1 - p), count), "p": p, "pc": p * count}[self.weight_name]

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        count = self.uses.counts.get(name, 0)
        base = max(self.frontier, tick - self.lifetimes.mean) if self.cold and count <= 1 else tick
        k = int(base + self.k * self.lifetimes.mean * self.weight(count))
        return k if k > floor else floor

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)

    def looked_up(self, names) -> None:
        before = len(self.uses.counts)
        self.uses.add(names)
        if len(self.uses.counts) < before:  # the table was halved: so are the counts reached
            self.reached /= 2
        counts = self.uses.counts
        for n in names:
            self.reached[min(counts[n], COUNT_CLASSES + 1)] += 1

    def evicted(self, keys, ticks) -> None:
        keys = list(keys)
        if keys:
            self.frontier = max(self.frontier, max(keys))
        self.lifetimes.evicted(ticks)


class GreedyDual:
    """GreedyDual's key: the eviction frontier (the key of the last entry evicted) plus ``K`` generations times the
    odds that an entry of the name's class is looked up again, learned online. Classes: a name looked up for the
    first time is classed by the count of the deepest earlier-seen page before it in its chain (``inherit``: what
    the chain it extends has shown), a name seen before by its count."""

    name = "greedydual"
    monotone = True

    def __init__(self, num_pages: int, clock, k: float, inherit: bool, blend: bool = False, relative: bool = False,
                 tick: bool = False):
        self.blend, self.relative, self.tick = blend or relative, relative, tick
        self.uses = eviction.UseCounts(eviction.COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = eviction.Lifetimes(clock)
        self.k, self.inherit, self.frontier = k, inherit, 0
        self.reached: dict = {}  # class -> names that entered it (decayed with the table)
        self.again: dict = {}    # class -> of those, names looked up again
        self.birth: dict = {}    # name -> its first-use class (bounded with the count table)
        self.cls: dict = {}

    def looked_up(self, names) -> None:
        before = len(self.uses.counts)
        counts = self.uses.counts
        parent = 0
        for n in names:
            c = counts.get(n, 0)
            if c == 0:
                break
            parent = c
        self.uses.add(names)
        if len(self.uses.counts) < before:
            for table in (self.reached, self.again):
                for key in table:
                    table[key] /= 2
            self.birth = {n: b for n, b in self.birth.items() if n in self.uses.counts}
            self.cls = {n: b for n, b in self.cls.items() if n in self.uses.counts}
        counts = self.uses.counts
        for n in names:
            c = counts[n]
            if c == 1:
                cls = ("new", min(parent, 3) if self.inherit else 0)
                self.birth[n] = cls
            else:
                prev = self.birth.pop(n, None) if c == 2 else ("seen", min(c - 1, COUNT_CLASSES))
                if prev is not None:
                    self.again[prev] = self.again.get(prev, 0) + 1
                cls = ("seen", min(c, COUNT_CLASSES))
            self.reached[cls] = self.reached.get(cls, 0) + 1
            self.cls[n] = cls

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        cls = self.cls.get(name, ("new", 0))
        p = min(0.99, (self.again.get(cls, 0) + 0.5) / (self.reached.get(cls, 0) + 1.0))
        if self.blend:  # lfu's key, pulled down to the frontier as the class's odds of coming back fall
            count = self.uses.counts.get(name, 0)
            lfu = tick + self.k * self.lifetimes.mean * max(0, count - 1)
            if self.relative:  # against the mean odds of any name looked up coming back
                mean = (sum(self.again.values()) + 0.5) / (sum(self.reached.values()) + 1.0)
                p = min(1.0, p / mean)
            k = int(self.frontier + p * max(0, lfu - self.frontier))
            return k if k > floor else floor
        k = int((tick if self.tick else self.frontier) + self.k * self.lifetimes.mean * p / (1 - p))
        return k if k > floor else floor

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)

    def evicted(self, keys, ticks) -> None:
        keys = list(keys)
        if keys:
            self.frontier = max(self.frontier, max(keys))
        self.lifetimes.evicted(ticks)


class OddsWithin:
    """``odds`` with the return rate of a count class learned without censoring: of the names that reached ``c``
    lookups at least ``H`` generations ago, the share that reached ``c + 1`` within ``H`` generations. ``odds``
    counts every name that reached ``c`` in the rate's denominator at once, so names that had no time yet to come back
    read as never coming back (after a burst of new sessions, a class reads as dead until its names return)."""

    name = "odds-within"
    monotone = True

    def __init__(self, num_pages: int, clock, k: float, horizon: float):
        self.uses = eviction.UseCounts(eviction.COUNT_TABLE_PAGES * max(1, num_pages))
        self.lifetimes = eviction.Lifetimes(clock)
        self.clock, self.k, self.horizon = clock, k, horizon
        self.first: dict = {}    # name -> tick it reached its current count
        self.pending = []        # (tick, class, names) reaching a class at that tick, oldest first
        self.at = 0              # pending[:at] matured
        self.wins: Counter = Counter()  # (tick, class) -> names of it that reached the next count in the window
        self.tried = np.zeros(COUNT_CLASSES + 2)
        self.won = np.zeros(COUNT_CLASSES + 2)

    def window(self) -> float:
        return self.horizon * self.lifetimes.mean

    def looked_up(self, names) -> None:
        now = self.clock()
        before = len(self.uses.counts)
        counts = self.uses.counts
        window = self.window()
        for n in names:
            c = counts.get(n, 0)
            t0 = self.first.get(n)
            if c and t0 is not None and now - t0 <= window:
                self.wins[(t0, min(c, COUNT_CLASSES))] += 1
        self.uses.add(names)
        if len(self.uses.counts) < before:
            self.tried /= 2
            self.won /= 2
            self.first = {n: t for n, t in self.first.items() if n in self.uses.counts}
        counts = self.uses.counts
        classes = Counter()
        for n in names:
            self.first[n] = now
            classes[min(counts[n], COUNT_CLASSES)] += 1
        for c, m in classes.items():
            self.pending.append((now, c, m))
        while self.at < len(self.pending) and now - self.pending[self.at][0] > window:
            t0, c, m = self.pending[self.at]
            self.tried[c] += m
            self.won[c] += self.wins.pop((t0, c), 0)
            self.at += 1
        if self.at > 4096:
            del self.pending[:self.at]
            self.at = 0

    def odds(self, count: int) -> float:
        c = min(max(count, 1), COUNT_CLASSES)
        p = min(0.99, (self.won[c] + 0.5) / (self.tried[c] + 1.0))
        return p / (1 - p)

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        k = int(tick + self.k * self.lifetimes.mean * self.odds(self.uses.counts.get(name, 0)))
        return k if k > floor else floor

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)

    def evicted(self, keys, ticks) -> None:
        self.lifetimes.evicted(ticks)


class Selective(eviction.Odds):
    """``odds`` as it was before its keep durations, where a name seen once gets its class's bonus only if its
    request's new pages were chosen (1 in ``share``, by the hash of the first new name: a whole segment together),
    then ``share`` times over; the others get none. The same expected bonus, spent on a fixed subset: where returns
    come after more new pages than the pool holds (a loop), ``lru`` keeps every segment too briefly for any to
    return, and a fixed subset kept longer is hit. ``inherit``: a segment extending a chosen one is chosen too (a
    session stays chosen)."""

    name = "selective"

    def __init__(self, num_pages: int, clock, share: int, inherit: bool):
        super().__init__(num_pages, clock)
        self.share, self.inherit = share, inherit
        self.chosen: dict = {}  # name seen once -> chosen (bounded with the count table)

    def looked_up(self, names) -> None:
        counts = self.uses.counts
        parent = None
        first_new = next((i for i, n in enumerate(names) if counts.get(n, 0) == 0), None)
        if first_new is not None:
            if self.inherit and first_new > 0:
                parent = self.chosen.get(names[first_new - 1])
            pick = parent if parent is not None else (names[first_new] * 0x9E3779B97F4A7C15 >> 32) % self.share == 0
        before = len(counts)
        super().looked_up(names)
        if len(self.uses.counts) < before:
            self.chosen = {n: c for n, c in self.chosen.items() if n in self.uses.counts}
        if first_new is not None:
            for n in names[first_new:]:
                self.chosen[n] = pick

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        count = self.uses.counts.get(name, 0)
        expected = self.returns.of(count)
        if count <= 1:
            expected = expected * self.share if self.chosen.get(name, False) else 0.0
        k = tick + int(expected * eviction.GENERATIONS_PER_USE * self.lifetimes.mean)
        return k if k > floor else floor

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)


class ClassedDurations(eviction.Odds):
    """The default's key with its keep durations learned per a finer class than the lookup count (``classify``, one
    class per name looked up). ``relative``: each key less the longest duration, so an entry of a class worth keeping
    for no time is keyed below every entry of the longest-kept class used within that duration (what re-keying the
    older entries when a duration rises would do); ``class_odds``: the expected further lookups also per class, from
    the durations' own statistics (the default takes them per count, ``ReturnOdds``)."""

    def __init__(self, num_pages: int, clock, classes: int, relative: bool = False, class_odds: bool = False,
                 names_clock: bool = False, no_odds: bool = False, decay: float = 0.0, gated: bool = False,
                 kind: type = KeepDurations):
        super().__init__(num_pages, clock)
        self.relative, self.class_odds, self.names_clock, self.no_odds = relative, class_odds, names_clock, no_odds
        self.gated = gated  # the expected lookups only for classes the durations keep
        self.half_life = decay * num_pages  # decay: the durations' statistics halve every that many turnovers
        self.since_halved = 0
        self.new_names = 0  # names_clock: time counted in new names looked up (the frontier's pace), not ticks
        self.durations = kind(num_pages, classes, (lambda: self.new_names) if names_clock else clock)

    def classify(self, names, before: np.ndarray, now: np.ndarray) -> np.ndarray:
        """The classes (1 to ``durations.classes``) of ``names`` looked up now, from their counts before and after."""
        raise NotImplementedError

    def looked_up(self, names) -> None:
        before = np.fromiter(map(self.uses.counts.__getitem__, names), dtype=np.int64, count=len(names))
        self.durations.returned(names)
        size = len(self.uses.counts)
        self.uses.add(names)
        counts = self.uses.counts
        if len(counts) < size:
            self.returns.halve()
            self.durations.halve(counts)
        now = np.fromiter(map(counts.__getitem__, names), dtype=np.int64, count=len(names))
        self.returns.add(now.tolist())
        self.durations.visited(names, np.where(now > 0, self.classify(names, before, now), 0))
        fresh = int((before == 0).sum())
        self.new_names += fresh
        self.since_halved += fresh
        if self.half_life and self.since_halved >= self.half_life:
            self.durations.halve(counts)
            self.since_halved = 0

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        ticks = self.durations.ticks
        c = self.durations.last_lookup(name)[1]
        bonus = ticks[c] - (ticks.max() if self.relative else 0)
        if not self.no_odds and not (self.gated and ticks[c] == 0):
            odds = self.odds_by_class()[c] if self.class_odds else self.returns.of(self.uses.counts.get(name, 0))
            bonus += odds * eviction.GENERATIONS_PER_USE * self.lifetimes.mean
        k = (self.new_names if self.names_clock else tick) + int(bonus * self.costs.relative(cost))
        return k if k > floor else floor

    def odds_by_class(self) -> np.ndarray:
        visits, back = self.durations.returns_by_class()
        prior = eviction.PRIOR_LOOKUPS * self.returns.names / max(1.0, self.returns.lookups)
        pooled = (back[1:].sum() + 0.5) / (visits[1:].sum() + 1.0)
        p = np.minimum(0.99, (back + 0.5 + prior * pooled) / (visits + 1.0 + prior))
        odds = p / (1 - p)
        odds[0] = odds[1]
        return odds

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)


class CountDurations(ClassedDurations):
    """Names classed by their lookup count, as the default: its key with ``ClassedDurations``' options."""

    def __init__(self, num_pages: int, clock, **options):
        super().__init__(num_pages, clock, COUNT_CLASSES, **options)

    def classify(self, names, before, now):
        return np.minimum(now, COUNT_CLASSES)


class SplittingDurations(KeepDurations):
    """The keep durations that also record the segment their knapsack stops before: its class, its T and the share
    of it the pool's pages left (``split``)."""

    split = (0, 0.0, 0.0)

    def _choose(self, segments) -> np.ndarray:
        budget, self.split = self.budget, (0, 0.0, 0.0)
        for _, cost, c, _, t1 in segments:
            if cost > budget:
                self.split = (c, t1, budget / cost)
                break
            budget -= cost
        return super()._choose(segments)


class SplitDurations(CountDurations):
    """The default with the segment its keep durations stop before taken for a share of the lookups (by a hash of
    the lookup's tick and the class, so a lookup's run of a class is kept or not as one): what the ``--bound`` table
    allows (a class split at random) and keys otherwise cannot say."""

    def __init__(self, num_pages: int, clock):
        super().__init__(num_pages, clock, kind=SplittingDurations)

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        k = super().key(name, tick, floor, cost)
        c, t1, share = self.durations.split
        at, last = self.durations.last_lookup(name)
        if c and last == c and (((at * 16 + c) * 0x9E3779B97F4A7C15) >> 16) % 1024 < share * 1024:
            k += int((t1 - self.durations.ticks[c]) * self.costs.relative(cost))
        return k if k > floor else floor


class GoingOnDurations(KeepDurations):
    """The keep durations with a knapsack that, where a segment does not fit, ends only that segment's class and goes
    on with the other classes' (the default's stops there)."""

    def _choose(self, segments) -> np.ndarray:
        ticks, budget, ended = np.zeros(self.classes + 1), self.budget, set()
        for _, cost, c, _, t1 in segments:
            if c in ended or cost > budget:
                ended.add(c)
                continue
            ticks[c] = t1
            budget -= cost
        return ticks


class ChainDurations(ClassedDurations):
    """A name looked up for the first time classed by the count of the deepest earlier-seen page it extends (none,
    2, 3, 4 or more: a second turn's own new pages extend a chain seen twice, a first turn's none), a name seen before
    by its count."""

    NEW = 4  # classes of first-seen names

    def __init__(self, num_pages: int, clock, **options):
        super().__init__(num_pages, clock, COUNT_CLASSES + self.NEW - 1, **options)

    def classify(self, names, before, now):
        seen = int(np.argmin(before > 0)) if (before == 0).any() else len(names)
        extends = int(before[seen - 1]) + 1 if seen else 0
        first = 1 + min(max(extends - 1, 0), self.NEW - 1)  # none: 1; 2: 2; 3: 3; 4 or more: 4
        return np.where(now == 1, first, np.minimum(now, COUNT_CLASSES) + self.NEW - 1)


class FreshDurations(ClassedDurations):
    """Names classed by their lookup count and one of ``buckets`` sizes of the request's new pages (log2 of them, the
    last bucket open: a follow-up turn brings a few, a new document many), the feature the ``--bound`` table finds
    worth most beside the count."""

    def __init__(self, num_pages: int, clock, buckets: int, **options):
        super().__init__(num_pages, clock, COUNT_CLASSES * buckets, **options)
        self.buckets = buckets

    def classify(self, names, before, now):
        bucket = min(int(np.log2(max(1, int((before == 0).sum())))), self.buckets - 1)
        return (np.minimum(now, COUNT_CLASSES) - 1) * self.buckets + bucket + 1


def variant_factory(spec: str):
    """A variant's spec (the module docstring) -> a pool's policy factory (``PagePool`` calls it with its pages and
    clock)."""
    if spec == "split":
        return SplitDurations
    kind, *rest = spec.split(":")
    options = {"relative": "relative" in rest, "class_odds": "odds" in rest, "names_clock": "names" in rest,
               "no_odds": "bare" in rest, "gated": "gated" in rest,
               "kind": GoingOnDurations if "goon" in rest else KeepDurations,
               "decay": next((float(r[5:]) for r in rest if r.startswith("decay")), 0.0)}
    if kind in ("chain", "count"):
        kind = ChainDurations if kind == "chain" else CountDurations
        return lambda num_pages, clock: kind(num_pages, clock, **options)
    if kind == "fresh":
        return lambda num_pages, clock: FreshDurations(num_pages, clock, int(rest[0]), **options)
    weight, k, *rest = spec.split(":")
    if weight == "sel":
        return lambda num_pages, clock: Selective(num_pages, clock, int(k), "inherit" in rest)
    if weight == "within":
        return lambda num_pages, clock: OddsWithin(num_pages, clock, float(k), float(rest[0]))
    if weight == "gd":
        return lambda num_pages, clock: GreedyDual(num_pages, clock, float(k), "noinherit" not in rest, "blend" in rest,
                                                        "relative" in rest, "tick" in rest)
    return lambda num_pages, clock: Variant(num_pages, clock, weight, float(k), "cold" in rest, "turn" in rest)


def simulate(lookups, pages: int, key) -> Counter:
    """Hits by the name's earlier lookups (capped at 5) of a ``pages``-page cache keyed by ``key(name, t, count,
    held_key)`` (lowest evicted first; the lookup's own names are never evicted while it runs)."""
    held, heap, seen, hits = {}, [], Counter(), Counter()
    for t, names in enumerate(lookups):
        matched = 0
        while matched < len(names) and names[matched] in held:
            matched += 1
        for depth, n in enumerate(names):
            hits[min(seen[n], 5)] += depth < matched
            seen[n] += 1
        for depth, n in enumerate(names):
            held[n] = key(n, t, seen[n], held.get(n))
            heapq.heappush(heap, (held[n], -depth, n))
        current, kept = set(names), []
        while len(held) > pages and heap:
            item = heapq.heappop(heap)
            if held.get(item[2]) != item[0]:
                continue
            if item[2] in current:
                kept.append(item)
                continue
            del held[item[2]]
        for item in kept:
            heapq.heappush(heap, item)
    return hits


def why(lookups, pages: int) -> None:
    """Print ``--why`` (module docstring)."""
    uses: dict = {}
    for t, names in enumerate(lookups):
        for n in names:
            uses.setdefault(n, []).append(t)
    def belady(n, t, count, old):
        later = uses[n][count] if count < len(uses[n]) else 1 << 40
        return -later

    keys = {"lru": lambda n, t, count, old: t,
            "lfu": lambda n, t, count, old: max(old or 0, t + 2 * 87 * (count - 1)),  # a turnover of ~87 lookups
            "optimal": belady}
    seen, totals = Counter(), Counter()
    for names in lookups:
        for n in names:
            totals[min(seen[n], 5)] += 1
            seen[n] += 1
    print(f"\nhits of a {pages}-page cache by the name's earlier lookups (of all lookups of names with that many):")
    for label, key in keys.items():
        hits = simulate(lookups, pages, key)
        print(f"  {label:>8}: " + ", ".join(f"{c}{'+' if c == 5 else ''}: {hits[c]}/{totals[c]}" for c in
                                             sorted(totals)))
    # names seen once: how often they come back, by what an online policy sees when it first meets them
    count, classes = Counter(), {}
    for names in lookups:
        extends = 0
        for n in names:
            if not count[n]:
                break
            extends = count[n]
        new = [n for n in names if not count[n]]
        matched = len(names) - len(new)
        for j, n in enumerate(new):
            classes[n] = {"count of the chain it extends": min(extends, 6),
                          "log2 of the request's new pages": min(int(np.log2(len(new))), 7),
                          "quarter of its place among them": 4 * j // len(new),
                          "quarter of the request's hit share": min(3, 4 * matched // len(names))}
        count.update(names)
    print("names seen once that come back, by what an online policy sees when it first meets them:")
    for feature in next(iter(classes.values())):
        tot, back = Counter(), Counter()
        for n, c in classes.items():
            tot[c[feature]] += 1
            back[c[feature]] += count[n] > 1
        print(f"  {feature}: " + ", ".join(f"{v}: {back[v] / tot[v]:.2f} of {tot[v]}" for v in sorted(tot)))


def lookup_features(names, count: Counter) -> tuple[int, list[tuple]]:
    """Count one lookup of ``names`` in ``count``; its new names, and per name what a policy sees at the lookup
    (``KeepTimeModel``'s features)."""
    fresh = sum(1 for n in names if not count[n])
    extends = 0
    for n in names:
        if not count[n]:
            break
        extends = count[n]
    count.update(names)
    return fresh, [(min(count[n], COUNT_CLASSES), min(extends, 6) if count[n] == 1 else -1,
                    min(int(np.log2(max(1, fresh))), 7), 4 * j // len(names),
                    min(3, 4 * (len(names) - fresh) // len(names))) for j, n in enumerate(names)]


# --bound's columns: what the keep time depends on (a class of the features)
COLUMNS = {"split": lambda f: 0, "count": lambda f: f[0], "+chain": lambda f: f[:2],
           "+new pages": lambda f: (f[0], f[2]), "+place": lambda f: (f[0], f[3]),
           "+hit share": lambda f: (f[0], f[4]), "all": lambda f: f}


class KeepTimeModel:
    """``--bound``'s relaxed model of the lookups ``lookups`` (module docstring): per lookup of a name, how many new
    names came before its next lookup (``distance``) and what a policy sees at it (``features``: its count, the count
    of the chain it extends if seen once, log2 of the request's new pages, its quarter of the chain, the request's
    hit quarter)."""

    NEVER = 1 << 40

    def __init__(self, lookups):
        last, at, distance, features = {}, [], [], []
        count: Counter = Counter()
        self.new_names = 0
        for names in lookups:
            for n in names:
                if n in last:
                    distance[last[n]] = self.new_names - at[last[n]]
            fresh, seen = lookup_features(names, count)
            for n, f in zip(names, seen):
                last[n] = len(at)
                at.append(self.new_names)
                distance.append(self.NEVER)
                features.append(f)
            self.new_names += fresh
        self.distance, self.features = np.array(distance), features

    def curve(self, d):
        """Over T (each distance a lookup came back at, and 0): names held and lookups hit."""
        d = np.sort(d)
        back = d[d < self.NEVER]
        ts = np.unique(np.concatenate([[0], back]))
        hit = np.searchsorted(d, ts, side="right")
        return ts, hit, np.concatenate([[0], np.cumsum(back)])[hit] + (len(d) - hit) * ts

    def segments(self, d):
        """The curve's upper concave hull, as (slope, held, hit, T) segments."""
        hull = [(0, 0, 0)]
        for t, y, x in zip(*(a.tolist() for a in self.curve(d))):
            while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])
                                      <= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
                hull.pop()
            hull.append((x, y, t))
        return [((y1 - y0) / (x1 - x0) if x1 > x0 else float("inf"), x1 - x0, y1 - y0, t1)
                for (x0, y0, _), (x1, y1, t1) in zip(hull, hull[1:])]

    def budget(self, pages: int) -> int:
        """A pool of ``pages`` pages in the model's units (names held x new names)."""
        return pages * self.new_names

    def best(self, key, budget, keep=None) -> float:
        """The most lookups hit for ``budget`` by keep times per class ``key(features)``; ``keep``: filled with each
        class's T (in new names; the class split at random left at the T it had)."""
        groups: dict = {}
        for i, f in enumerate(self.features):
            groups.setdefault(key(f), []).append(i)
        hits = 0.0
        for _, held, hit, t, g in sorted(((*s, g) for g, idx in groups.items()
                                          for s in self.segments(self.distance[idx])), key=lambda s: -s[0]):
            if held > budget:
                return hits + hit * budget / held
            hits, budget = hits + hit, budget - held
            if keep is not None:
                keep[g] = t
        return hits

    def one_t(self, budget) -> int:
        """One T for every lookup, none split: what ``lru`` does."""
        _, hit, held = self.curve(self.distance)
        return hit[np.searchsorted(held, budget, side="right") - 1]


class FixedKeepTimes:
    """The model's best keep times for this pool by one of ``--bound``'s columns (``KeepTimeModel.best``, chosen with
    the whole trace known) as a replay's policy: key = new names seen so far + T of the name's class at its last
    lookup (a page never looked up, a request's output, as a new name extending nothing). What a column of
    ``--bound`` is worth in the replay, with its chains and requests in flight, to a policy that knew the best keep
    times from the start."""

    name = "fixed-keep-times"
    monotone = True

    def __init__(self, num_pages: int, model: KeepTimeModel, column: str):
        self.keep: dict = {}
        self.column = COLUMNS[column]
        model.best(self.column, model.budget(num_pages), self.keep)
        self.count: Counter = Counter()
        self.kept: dict = {}  # name -> T of its class at its last lookup
        self.unseen = int(self.keep.get(self.column((1, 0, 0, 0, 0)), 0))  # a page never looked up: as a new one
        self.new_names = 0

    def looked_up(self, names) -> None:
        fresh, seen = lookup_features(names, self.count)
        self.new_names += fresh
        self.kept.update((n, int(self.keep.get(self.column(f), 0))) for n, f in zip(names, seen))

    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        k = self.new_names + self.kept.get(name, self.unseen)
        return k if k > floor else floor

    def keys(self, names, ticks, floors, cost=None, chain=False):
        return keys_one_by_one(self.key, names, ticks, floors)

    def evicted(self, keys, ticks) -> None:
        pass


def bound(lookups, page: int, sizes) -> None:
    """Print ``--bound`` (module docstring)."""
    model = KeepTimeModel(lookups)
    distance, best, one_t = model.distance, model.best, model.one_t
    classes = COLUMNS
    total = len(distance)
    print(f"\n{total} pages looked up, {model.new_names} new. Hit share (%) at most, by what the keep time depends on:")
    print(f"{'pool':>6} | {'one T':>7} | " + " | ".join(f"{c:>10}" for c in classes) + f" | {'oracle':>7}")
    kept = {}
    for size in sizes:
        budget = model.budget(size // page)
        back = np.cumsum(np.sort(distance[distance < model.NEVER]))
        oracle = np.searchsorted(back, budget, side="right")
        best(classes["count"], budget, kept.setdefault(size, {}))
        print(f"{format_size(size):>6} | {100 * one_t(budget) / total:7.2f} | "
              + " | ".join(f"{100 * best(k, budget) / total:10.2f}" for k in classes.values())
              + f" | {100 * oracle / total:7.2f}")
    print("keep time by lookup count in the 'count' column, in turnovers (the pool's pages of new names):")
    for size, keep in kept.items():
        print(f"{format_size(size):>6} | " + ", ".join(f"{c}: {keep.get(c, 0) / (size // page):.1f}"
                                                  for c in range(1, COUNT_CLASSES + 1)))

def differing_requests(trace, page: int, order: str, in_flight: int, size: int, lookups) -> None:
    """Print ``--requests`` (module docstring)."""
    from unittest import mock

    from workloads.sizing import replay

    matched: dict = {}
    events: list = []  # ("admit" | "finish", rid), the default's replay
    step, finish = replay.Replayer.step, replay.Replayer.finish
    calls: dict = {}   # session -> its rids in admission order

    def traced_step(self, req):
        m = step(self, req)
        matched.setdefault(self.run.eviction, {})[req.rid] = m
        if self.run.eviction == eviction.DEFAULT_POLICY:
            events.append(("admit", req.rid))
            calls.setdefault(req.session, []).append(req.rid)
        return m

    def traced_finish(self, rid):
        if self.run.eviction == eviction.DEFAULT_POLICY:
            events.append(("finish", rid))
        return finish(self, rid)

    with mock.patch.object(replay.Replayer, "step", traced_step), \
            mock.patch.object(replay.Replayer, "finish", traced_finish):
        for policy in ("lru", eviction.DEFAULT_POLICY, "optimal"):
            replay_trace(trace, page_size=page, pool_tokens=size, order=order, in_flight=in_flight, eviction=policy,
                         lookups=lookups)
    first_calls = {rids[0] for rids in calls.values()}
    previous = {rid: rids[i - 1] for rids in calls.values() for i, rid in enumerate(rids) if i}
    lru, default, best = (matched[p] for p in ("lru", eviction.DEFAULT_POLICY, "optimal"))
    print(f"\nrequests whose matched tokens differ at {format_size(size)} (lru / {eviction.DEFAULT_POLICY} / optimal):")
    for rid in lru:
        if not lru[rid] == default[rid] == best[rid]:
            before = ""
            if rid in previous:
                done = events.index(("finish", previous[rid]))
                returns = sum(1 for kind, r in events[:done] if kind == "admit" and r not in first_calls)
                before = f"; {returns} returns admitted when its previous call finished"
            print(f"  {rid}: {lru[rid]} / {default[rid]} / {best[rid]}{before}")


def by_quarter(trace, page: int, order: str, in_flight: int, size: int, lookups, variants) -> None:
    """Print ``--quarters`` (module docstring)."""
    from unittest import mock

    from workloads.sizing import replay

    step, rows = replay.Replayer.step, []

    def traced_step(self, req):
        m = step(self, req)
        rows.append((req.prompt_len, m or 0))
        return m

    rates = {}
    with mock.patch.object(replay.Replayer, "step", traced_step):
        for policy in ["lru", *variants, "optimal"]:
            rows.clear()
            replay_trace(trace, page_size=page, pool_tokens=size, order=order, in_flight=in_flight, eviction=policy,
                         lookups=lookups)
            parts = np.array_split(np.array(rows), 4)
            rates[policy] = [100 * q[:, 1].sum() / q[:, 0].sum() for q in parts]
    print(f"\nhit share (%) by quarter of the requests at {format_size(size)} (share of the lru -> optimal gap):")
    for policy, r in rates.items():
        print(f"{policy:>17} | " + " | ".join(
            f"{x:6.2f} ({100 * (x - lo) / (hi - lo) if hi - lo > 1e-9 else 0:+4.0f}%)"
            for x, lo, hi in zip(r, rates["lru"], rates["optimal"])))


def learned_durations(trace, page: int, order: str, in_flight: int, size: int) -> None:
    """Print ``--durations`` (module docstring)."""
    from unittest import mock

    solve, seen = KeepDurations._solve, []

    def recorded_solve(self):
        solve(self)
        seen.append(self.ticks[1:].copy())

    with mock.patch.object(KeepDurations, "_solve", recorded_solve):
        replay_trace(trace, page_size=page, pool_tokens=size, order=order, in_flight=in_flight,
                     eviction=eviction.DEFAULT_POLICY)
    ticks = np.array(seen)
    print(f"\nthe default's keep durations at {format_size(size)} over its {len(ticks)} solves, by lookup count "
          "(mean ticks; share of solves that kept the class at all):")
    print("  " + ", ".join(f"{c}: {t:.0f} ({k:.0%})" for c, (t, k) in
                           enumerate(zip(ticks.mean(axis=0), (ticks > 0).mean(axis=0)), start=1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--variants", default="lfu:2,lfu:4,log:4,odds:2,odds:2:cold")
    ap.add_argument("--pools", help="pool sizes (default: each trace's own)")
    ap.add_argument("--why", type=int, metavar="PAGES", help="explain the optimum's gain at PAGES pages instead")
    ap.add_argument("--bound", action="store_true", help="print what keep times chosen by class can hit at most")
    ap.add_argument("--requests", metavar="POOL", help="list the requests lru, the default and the optimum differ on")
    ap.add_argument("--quarters", metavar="POOL", help="hit share by quarter of the requests at one pool size")
    ap.add_argument("--durations", metavar="POOL", help="the default's learned keep durations at one pool size")
    args = ap.parse_args()
    variants = args.variants.split(",")
    for spec in variants:
        if not spec.startswith("fixed:"):  # made per trace, from its lookups
            eviction.POLICIES[spec] = variant_factory(spec)  # this process only: a name the replay's pool can make
    for trace_name in args.traces.split(","):
        _, page, order, in_flight, pools = TRACES[trace_name]
        trace = load(trace_name)
        recorder = eviction.LookupRecorder()
        replay_trace(trace, page_size=page, pool_tokens=None, order=order, in_flight=in_flight, eviction=recorder)
        fixed = [v for v in variants if v.startswith("fixed:")]
        model = KeepTimeModel(recorder.lookups) if fixed else None
        for spec in fixed:
            column = spec.split(":", 1)[1]
            eviction.POLICIES[spec] = lambda num_pages, clock, column=column: FixedKeepTimes(num_pages, model, column)
        if args.why:
            print(f"\n{trace_name}: {len(recorder.lookups)} lookups")
            why(recorder.lookups, args.why)
            continue
        if args.requests:
            print(f"\n{trace_name}: page {page}")
            differing_requests(trace, page, order, in_flight, parse_sizes(args.requests)[0], recorder.lookups)
            continue
        if args.durations:
            print(f"\n{trace_name}: page {page}")
            learned_durations(trace, page, order, in_flight, parse_sizes(args.durations)[0])
            continue
        if args.quarters:
            print(f"\n{trace_name}: page {page}")
            by_quarter(trace, page, order, in_flight, parse_sizes(args.quarters)[0], recorder.lookups,
                       [eviction.DEFAULT_POLICY, *variants])
            continue
        if args.bound:
            print(f"\n{trace_name}: {len(recorder.lookups)} lookups, page {page}")
            bound(recorder.lookups, page, parse_sizes(args.pools or pools))
            continue
        print(f"\n{trace_name}: page {page}, order {order} (in parentheses: share of the lru -> optimal gap closed)")
        print(f"{'pool':>6} | {'lru':>7} | " + " | ".join(f"{v:>17}" for v in variants) + f" | {'optimal':>7}")
        for size in parse_sizes(args.pools or pools):
            rate = {p: 100 * replay_trace(trace, page_size=page, pool_tokens=size, order=order, in_flight=in_flight,
                                          eviction=p, lookups=recorder.lookups).hit_rate
                    for p in ["lru", *variants, "optimal"]}
            gap = rate["optimal"] - rate["lru"]
            cells = [f"{rate[v]:6.2f}" + (f" ({100 * (rate[v] - rate['lru']) / gap:+4.0f}%)" if gap > 1e-9 else "")
                     for v in variants]
            print(f"{format_size(size):>6} | {rate['lru']:7.2f} | " + " | ".join(f"{c:>17}" for c in cells)
                  + f" | {rate['optimal']:7.2f}")


if __name__ == "__main__":
    main()
