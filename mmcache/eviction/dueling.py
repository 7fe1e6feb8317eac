"""Set dueling for a fully associative pool: every insertion rule runs on a sample of the pool's chains, in a pool
of its own that serves them as the real one does, and the real pool takes the rule that would have hit the most.

An **insertion rule** says where the pages a request computed go when it releases them (``RULES``): ``lru`` at the
top (the last use, as LRU keys them); ``victims``, a turnover back, toward the eviction frontier, when the request
lost pages it had held before (a session whose history was evicted between its calls: under a loop larger than the
pool, keeping the others whole beats losing every one; thrash resistance); ``misses``, toward the frontier whatever
the request (bimodal insertion: a page earns its place by a second use); ``newcomers``, the pages seen for the first
time toward the frontier and those evicted lately (ghosts) at the top. The latter rules let one request in
``EPSILON`` through at the top, so what is kept can change; a page found by a later request goes back to the top.

A ``SampledPool`` is a names-only pool of the real pool's pages over ``sampling(num_pages)`` (the names whose bits say
so: a fixed sample of every chain; about ``SAMPLED_PAGES`` pages) under one rule. It sees what the real pool sees, from the policy's hooks: a request
holds the sampled pages it found from its lookup to its release, and the ones it computes take room from its lookup
and are cached at its release; a chain is found to its first sampled page missing; cached pages leave the lowest key
first (deeper first among equal keys), held ones never. ``InsertionDuel`` runs one per rule on the same chains and
scores each by its hits, decayed; the real pool follows the leader, and leaves ``lru`` only for a rule that beats it
by ``MARGIN``: ``lru`` is the guard.
"""

from __future__ import annotations

import heapq
from typing import Sequence

from mmcache.eviction.base import Clock
from mmcache.eviction.memory import NameWindow
from mmcache.eviction.turnover import Turnover

RULES = ("lru", "victims", "misses", "newcomers")
EPSILON = 32         # one request in EPSILON that a rule would demote is inserted at the top instead
SAMPLED_PAGES = 512  # a sampled pool holds about this many pages: the sample is one page name in num_pages / this
HALF_LIFE = 256      # lookups after which a hit weighs half in the score
MARGIN = 0.05        # a rule replaces lru only with this much more (relative) of the score
GHOSTS = 2           # names of evicted pages remembered, per page of a pool


class Lottery:
    """Says yes to one draw in ``EPSILON`` (a counter: deterministic, and fair over any run of draws)."""

    __slots__ = ("_draws",)

    def __init__(self):
        self._draws = 0

    def wins(self) -> bool:
        self._draws += 1
        return self._draws % EPSILON == 0


def demotes(rule: str, victim: bool, lottery: Lottery) -> bool:
    """Whether a request's computed pages go toward the eviction frontier under ``rule``; ``victim``: the request
    lost a page it had held before."""
    if rule == "lru" or (rule == "victims" and not victim):
        return False
    return not lottery.wins()


def sampling(num_pages: int) -> int:
    """One page name in this many is sampled (a power of two; 1 for a pool of at most ``2 * SAMPLED_PAGES``)."""
    return 1 << max(0, (max(1, num_pages) // SAMPLED_PAGES).bit_length() - 1)


class SampledPool:
    """A names-only pool of ``capacity`` sampled pages under ``rule`` (see the module docstring)."""

    def __init__(self, capacity: int, rule: str, clock: Clock, turnover: Turnover):
        self.capacity, self.rule, self._clock, self._turnover = max(1, capacity), rule, clock, turnover
        self._keys: dict[int, tuple[int, int]] = {}  # cached (held or not): name -> (key, depth)
        self._held: dict[int, int] = {}              # name -> requests holding it
        self._pending: dict[int, bool] = {}          # computed by a request in service -> demoted at its release
        self._heap: list[tuple[int, int, int]] = []  # (key, -depth, name), lazy
        self._ghosts = NameWindow(GHOSTS * self.capacity)
        self._lottery = Lottery()

    def __len__(self) -> int:
        return len(self._keys) + len(self._pending)

    def admit(self, sampled: Sequence[tuple[int, int]]) -> int:
        """A request looked up the chain whose sampled pages are ``sampled`` (``(depth, name)`` in order): the pages
        found (to the first missing), now held; the others pending until its release. Returns the pages found."""
        keys, held = self._keys, self._held
        found = 0
        while found < len(sampled) and sampled[found][1] in keys:
            found += 1
        for _, name in sampled[:found]:
            held[name] = held.get(name, 0) + 1
        if found < len(sampled):
            down = demotes(self.rule, sampled[found][1] in self._ghosts, self._lottery)
            ghosts = self._ghosts if self.rule == "newcomers" else ()
            for _, name in sampled[found:]:
                if name not in keys:
                    self._pending.setdefault(name, down and name not in ghosts)
            while len(self._pending) > self.capacity:  # releases that never came (a request cut short): forgotten
                del self._pending[next(iter(self._pending))]
        self._fit()
        return found

    def release(self, sampled: Sequence[tuple[int, int]]) -> None:
        """A request is done with the chain whose sampled pages are ``sampled``: each is cached, keyed by the rule."""
        now = self._clock()
        back = now - self._turnover.ticks
        held = self._held
        for depth, name in sampled:
            n = held.get(name)
            if n:
                if n == 1:
                    del held[name]
                else:
                    held[name] = n - 1
                self._put(name, now, depth)
            else:
                self._put(name, back if self._pending.pop(name, False) else now, depth)
        self._fit()

    def _put(self, name: int, key: int, depth: int) -> None:
        old = self._keys.get(name)
        if old is not None and old[0] >= key:  # keys never fall while a page stays
            return
        self._keys[name] = (key, depth)
        heapq.heappush(self._heap, (key, -depth, name))

    def _fit(self) -> None:
        """Evict the lowest keys until the pool fits (held pages stay; stale heap items are dropped)."""
        keys, held, heap, kept = self._keys, self._held, self._heap, []
        while len(keys) + len(self._pending) > self.capacity and heap:
            key, depth, name = heapq.heappop(heap)
            if keys.get(name) != (key, -depth):
                continue
            if name in held:
                kept.append((key, depth, name))
                continue
            del keys[name]
            self._ghosts.add((name,))
        for item in kept:
            heapq.heappush(heap, item)
        if len(heap) > 2 * (len(keys) + 64):  # stale items outnumber the pages: rebuild (few, so a pop never wades far)
            self._heap = [(k, -d, n) for n, (k, d) in keys.items()]
            heapq.heapify(self._heap)


class InsertionDuel:
    """One ``SampledPool`` per insertion rule on a sample of a pool's chains, and the rule the pool takes now."""

    def __init__(self, num_pages: int, clock: Clock, turnover: Turnover):
        self.every = sampling(num_pages)
        capacity = max(1, num_pages // self.every)
        self.pools = {rule: SampledPool(capacity, rule, clock, turnover) for rule in RULES}
        self.scores = dict.fromkeys(RULES, 0.0)
        self.rule = "lru"
        self._decay = 0.5 ** (1 / HALF_LIFE)

    def sample(self, names: Sequence[int]) -> list[tuple[int, int]]:
        """``(depth, name)`` of the sampled names of a chain (bits 32 and up of a name choose: the low bits of a page
        name are what other samplings and tables read)."""
        if self.every == 1:
            return list(enumerate(names))
        mask = self.every - 1
        return [(d, n) for d, n in enumerate(names) if not (n >> 32) & mask]

    def admitted(self, names: Sequence[int]) -> None:
        sampled = self.sample(names)
        if not sampled:
            return
        scores, decay = self.scores, self._decay
        for rule, pool in self.pools.items():
            scores[rule] = scores[rule] * decay + pool.admit(sampled)
        best = max(RULES, key=scores.__getitem__)
        self.rule = best if scores[best] > scores["lru"] * (1 + MARGIN) else "lru"

    def released(self, names: Sequence[int]) -> None:
        sampled = self.sample(names)
        if sampled:
            for pool in self.pools.values():
                pool.release(sampled)
