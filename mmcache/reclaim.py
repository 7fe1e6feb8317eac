"""The one place that chooses what cached data to evict from a pool when a live owner needs pages.

One pool per node: the prefix index of every label and the encoder store of a node are caches on one ``PagePool``,
registered on it (``pool.evictables``), ordered by its one ``pool.clock`` and driven under its one ``pool.cache_lock``
(an RLock every cache on the pool takes for the state eviction reads or changes, so a put that evicts KV pages and a
grow that evicts encoder entries never race or deadlock). A host tier is the one evictable owner of its host pool,
driven the same way. Every such cache is an ``Evictable``: it offers ``eviction_candidates() -> (pages, keys)``
(pages only it holds, keyed by ``eviction_key``; lower is evicted first), ``coldest(n)`` (the ``n`` of them with the
lowest keys) and ``evict(pages)``. ``reclaim`` merges the coldest candidates of all owners on the pool and evicts the
lowest keys as one batch, so one kind of cached data can never starve another, and a live request fails only when
every cached page together would not cover its shortfall.

What goes first is the pool's policy's to say (``mmcache.eviction``, ``pool.policy``): every cache keeps, per entry,
the key the policy gave it at its last use, and ``reclaim`` only compares keys. The policy may weigh recency,
frequency or the future (the offline optimum of a replay); the caches keep every invariant whatever it says.
"""

from __future__ import annotations

import heapq
import os
from typing import Callable, Protocol, Sequence

import numpy as np

from mmcache.errors import OutOfPages
from mmcache.pool import SCALAR_PAGES, PagePool

# The debug switch: MMCACHE_CHECK=1 runs every check() of a pool and its caches after each reclaim (slow: a pass over
# the pool each time; for tests and bug hunts).
CHECK_AFTER_RECLAIM = os.environ.get("MMCACHE_CHECK") == "1"


class Evictable(Protocol):
    """A cache whose pages a shortfall on its pool may take (registered with ``pool.register``)."""

    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pages only this cache holds (owner count 1) and their ``eviction_key``s."""

    def coldest(self, n: int) -> tuple[Sequence[int], Sequence[int]]:
        """``n`` of ``eviction_candidates`` with the lowest keys (all of them when fewer), and those keys, as arrays
        or lists: what ``reclaim`` asks for (``coldest_of`` computes it from the candidates)."""

    def evict(self, pages: Sequence[int]) -> None:
        """Drop the entries holding ``pages`` (what its ``coldest`` gave, or a part of it; a cache may drop more:
        whole entries, descendants) and release them."""

    def check(self) -> None:
        """``BrokenInvariant`` naming the first of the cache's rules that does not hold."""


def eviction_key(pool: PagePool, keys, depths=0) -> np.ndarray:
    """The one eviction order: the lowest policy key first (``pool.policy``) and, among equal keys, the deepest page
    of a chain first (so under ``lru`` any prefix of the order is a set of whole cold tails). Policy keys are ticks of
    ``pool.clock`` plus a bonus in ticks, so keys of every cache on one pool compare; entries with no chain (encoder
    outputs) have depth 0."""
    return np.asarray(keys, dtype=np.int64) * (pool.num_pages + 1) - depths


def coldest_of(candidates: tuple[np.ndarray, np.ndarray], n: int) -> tuple[np.ndarray, np.ndarray]:
    """``Evictable.coldest`` from ``eviction_candidates``' ``(pages, keys)``: the ``n`` with the lowest keys (a whole
    pass over them)."""
    pages, keys = candidates
    if n >= len(pages):
        return pages, keys
    pick = keys.argmin() if n == 1 else np.argpartition(keys, n - 1)[:n]
    return pages[pick].reshape(-1), keys[pick].reshape(-1)


def coldest_off_heap(heap: list, n: int, current: Callable[[tuple], int | None], alone: Callable[[tuple], bool],
                     size: Callable[[tuple], int] | None = None, limit: int = SCALAR_PAGES,
                     ident: Callable[[tuple], object] = lambda item: item) -> list[tuple] | None:
    """The items at the top of a cache's lazy eviction heap whose sizes reach ``n``: what ``Evictable.coldest`` takes
    off a heap instead of a pass over the cache. The cache keeps, for every entry it may evict, an item ``(key,
    ...)`` whose key is at most the entry's current key (pushed when the entry is stored; keys only grow after).
    ``current(item)``: the entry's key now, None when the entry is gone (the item is dropped); an item whose key grew
    is pushed again at its key, so the top item whose key is current is the coldest entry. ``alone(item)``: only the
    cache holds the entry's pages (else it is set aside and put back); ``size(item)``: its pages (default 1);
    ``ident(item)``: the entry an item stands for (a policy whose keys fall leaves several items of one entry, and
    an entry is chosen once: the others are dropped). Returns the items chosen, coldest first (every item stays in
    the heap), or None when more than ``limit`` held entries come first: the caller then makes its pass. Callers
    hold the pool's ``cache_lock``."""
    chosen, held, found, seen = [], [], 0, set()
    while heap and found < n:
        top = heap[0]
        now = current(top)
        if now is None:
            heapq.heappop(heap)
            continue
        if now != top[0]:
            heapq.heapreplace(heap, (now, *top[1:]))
            continue
        heapq.heappop(heap)
        if (entry := ident(top)) in seen:  # a second item of one entry: dropped
            continue
        seen.add(entry)
        if alone(top):
            chosen.append(top)
            found += 1 if size is None else size(top)
        else:
            held.append(top)
            if len(held) > limit:
                break
    for item in chosen + held:
        heapq.heappush(heap, item)
    return None if len(held) > limit else chosen


def heap_covers(heap: list, current: Callable[[tuple], int | None], ident: Callable[[tuple], object]) -> set:
    """The entries (``ident(item)``) that a cache's lazy eviction heap holds at no more than their current key
    (``current``, as ``coldest_off_heap`` reads it): every entry the cache may evict must be among them, or its
    ``coldest`` could pass it over. What a cache's ``check()`` reads."""
    return {ident(item) for item in heap if (now := current(item)) is not None and item[0] <= now}


def reclaimable(owners: Sequence[Evictable]) -> int:
    """How many pages evicting every candidate of ``owners`` would free."""
    return sum(len(o.eviction_candidates()[0]) for o in owners)


def reclaim(pool: PagePool, need: int, owners: Sequence[Evictable] | None = None, batch: int = 1) -> int:
    """Make ``need`` pages free on ``pool`` by evicting at least ``max(shortfall, batch)`` of the coldest candidate
    pages across ``owners`` (default: every cache registered on the pool; all candidates if fewer); returns the pages
    chosen (an owner evicting whole entries may free more). Raises ``OutOfPages`` and evicts nothing when all
    candidates together cannot cover the shortfall. Callers hold ``pool.cache_lock``."""
    if owners is None:
        owners = pool.evictables
    short = need - pool.num_free
    if short <= 0:
        return 0
    want = max(short, batch)
    # An owner returns fewer than ``want`` only when that is all it has: a total short of ``short`` is every candidate.
    found = [o.coldest(want) for o in owners]
    total = sum(len(pages) for pages, _ in found)
    if total < short:
        raise OutOfPages(short - total, requested=need)
    n = min(total, want)
    if len(owners) == 1:
        owners[0].evict(found[0][0])
    else:
        which = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, (p, _) in enumerate(found)])
        pages = np.concatenate([p for p, _ in found])
        keys = np.concatenate([k for _, k in found])
        if n < total:
            pick = np.argpartition(keys, n - 1)[:n]
            pages, which = pages[pick], which[pick]
        for i, owner in enumerate(owners):
            owner.evict(pages[which == i])
    if CHECK_AFTER_RECLAIM:
        check_pool(pool)
    return n


def check_pool(pool: PagePool) -> None:
    """Every rule of ``pool`` and of each cache registered on it (``PagePool.check``, each ``Evictable.check``)."""
    pool.check()
    for cache in pool.evictables:
        cache.check()


def make_room(pool: PagePool, need: int, batch: int = 1, counters: dict | None = None) -> None:
    """The one way an owner makes ``need`` pages free before taking them: ``reclaim`` under ``pool.cache_lock``,
    counted on the asking owner's ``counters`` (when given): a covered shortfall as one eviction batch and its
    ``shortfall_pages``, a refusal (``OutOfPages``, nothing evicted) as a stall. The evicted pages are counted by the
    caches they left, so on a shared pool each cache's counters say what happened to it."""
    with pool.cache_lock:
        short = need - pool.num_free
        if short <= 0:
            return
        try:
            reclaim(pool, need, None, batch)
        except OutOfPages:
            if counters is not None:
                counters["stalls"] += 1
            raise
        if counters is not None:
            counters["eviction_batches"] += 1
            counters["shortfall_pages"] += short


def take(pool: PagePool, n: int, batch: int = 1, counters: dict | None = None) -> list[int]:
    """``make_room`` then ``pool.alloc(n)`` atomically (under ``pool.cache_lock``): ``n`` fresh pages, evicting cold
    cached pages first; ``OutOfPages`` and nothing changed when live owners alone hold too much."""
    with pool.cache_lock:
        make_room(pool, n, batch, counters)
        return pool.alloc(n)
