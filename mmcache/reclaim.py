"""The one place that chooses what cached data to evict from a pool when a live owner needs pages.

One pool per node: the prefix index of every label and the encoder store of a node are caches on one ``PagePool``,
registered on it (``pool.evictables``), ordered by its one ``pool.clock`` and driven under its one ``pool.cache_lock``
(an RLock every cache on the pool takes for the state eviction reads or changes, so a put that evicts KV pages and a
grow that evicts encoder entries never race or deadlock). Every cache on a pool (the prefix index of each label, the
encoder store) is an *evictable owner*: it offers ``eviction_candidates() -> (pages, keys)`` (pages only it holds, with
an int64 key; lower is evicted first) and ``evict(pages, short)``. ``reclaim`` merges the candidates of all owners on
the pool and evicts the lowest keys as one batch, so one kind of cached data can never starve another, and a live
request fails only when every cached page together would not cover its shortfall. Keys are recency ticks from one
``Clock`` shared by the owners of a pool (an owner may fold a tie-breaker into its key, as the prefix index folds chain
depth), so they compare across kinds.

Why recency alone, and not recompute cost per byte: the encoder store knows each entry's measured encoder time, but
a KV page has no such figure (its cost depends on its position, the attention backend and the batch it was prefilled
in), so a cost-weighted key would rank one kind by measurement and the other by a model of the engine. One clock keeps
the order exact and explainable: the least recently used cached bytes go first, whichever kind they are.
A later tier (host memory) hooks in here: whatever leaves the pool leaves through ``evict``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np

from mmcache.errors import OutOfPages

if TYPE_CHECKING:  # pool.py makes each pool's Clock: no import cycle at runtime
    from mmcache.pool import PagePool


class Clock:
    """A monotonic tick shared by the owners of one pool (``itertools.count`` is atomic under the GIL)."""

    def __init__(self):
        self._count = itertools.count(1)

    def tick(self) -> int:
        return next(self._count)


class Evictable(Protocol):
    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]: ...

    def evict(self, pages: np.ndarray) -> None: ...


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
    found = [o.eviction_candidates() for o in owners]
    total = sum(len(pages) for pages, _ in found)
    if total < short:
        raise OutOfPages(short - total, requested=need)
    n = min(total, max(short, batch))
    if len(owners) == 1:
        pages, keys = found[0]
        if n < total:
            pages = pages[np.argpartition(keys, n - 1)[:n]]
        owners[0].evict(pages)
        return n
    which = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, (p, _) in enumerate(found)])
    pages = np.concatenate([p for p, _ in found])
    keys = np.concatenate([k for _, k in found])
    if n < total:
        pick = np.argpartition(keys, n - 1)[:n]
        pages, which = pages[pick], which[pick]
    for i, owner in enumerate(owners):
        owner.evict(pages[which == i])
    return n


def make_room(pool: PagePool, need: int, batch: int, counters: dict | None) -> None:
    """``reclaim`` for one owner's request, counted on that owner's ``counters`` (when given): a covered shortfall
    as one eviction batch and its ``shortfall_pages``, a refusal as a stall. The evicted pages are counted by the
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
