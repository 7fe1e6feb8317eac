"""The extension point of eviction: what a pool's caches tell its policy, and what the policy answers.

A policy only orders. The caches on a pool (prefix indexes, the encoder store, host tiers) keep every invariant: they
offer only entries no live owner holds, an indexed page leaves with its indexed descendants, and every hit is
verified. They tell the pool's policy what happens to their entries (the hooks) and ask it for an entry's **eviction
key** whenever the entry is stored or used (``key``, or ``keys`` for many at once); ``mmcache.reclaim`` evicts the
lowest keys first, across every cache of the pool. Keys are ticks of the pool's one clock, plus or minus a shift in
ticks, so the keys of every cache on one pool compare.

What the caches call, under the pool's ``cache_lock``:

- ``looked_up(names, hits, held)``: a request looked up ``names`` (a chain of page names in order, or an encoder
  output's one name) and found the first ``hits`` cached. ``held``: the request now holds those pages, computes the
  rest, and holds them all until it calls ``released`` (the prefix caches' requests); False for a lookup whose
  entries are only read (the encoder store, host tiers).
- ``released(names)``: a request is done with the chain ``names`` (its prompt's pages, then any it generated); its
  pages are cached from now on, and keyed right after.
- ``evicted(names, keys, ticks)``: these entries left the pool.

The base keeps the one rule every cache's lazy eviction heap relies on, for every policy: an entry's key never falls
below the key it holds (its ``floor``) while it stays, unless the policy says its keys may fall (``monotone =
False``; the caches then push a fresh heap item at every change). A policy implements ``rank`` (one entry's key
before that rule) and, where many entries at once are faster as arrays, ``ranks``; ``key`` and ``keys`` apply the
floor to them, so the two always agree (a test checks it for every registered policy and every prototype).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

Clock = Callable[[], int]  # the pool's current tick


class EvictionPolicy:
    """Orders a pool's cached entries (see the module docstring). ``num_pages``: the pool's size; ``clock``: its
    current tick. Lower keys are evicted first."""

    name = ""
    monotone = True         # keys never fall while an entry stays (the base's floor rule)
    tier_policy: str | None = None  # the policy a host tier under this pool evicts by (None: this one)

    def __init__(self, num_pages: int, clock: Clock):
        self.num_pages = max(1, int(num_pages))
        self.clock = clock

    # -- what the caches tell the policy (no-ops here) -----------------------------------------------------------------
    def looked_up(self, names: Sequence[int], hits: int, held: bool = False) -> None:
        """A request looked up ``names`` and found the first ``hits`` cached (see the module docstring)."""

    def released(self, names: Sequence[int]) -> None:
        """A request that ``looked_up`` with ``held`` is done with its chain ``names``."""

    def evicted(self, names: Sequence[int], keys: Sequence[int], ticks: Sequence[int]) -> None:
        """Entries ``names``, with these keys and last-use ticks, left the pool at its current tick."""

    # -- what a policy decides ----------------------------------------------------------------------------------------
    def rank(self, name: int, tick: int, cost: float | None) -> int:
        """The key of the entry ``name`` used (or stored) at ``tick``, before the floor rule. ``cost``: the seconds of
        recompute a hit on it saves per page it holds (None: unknown, as an average entry's)."""
        raise NotImplementedError

    def ranks(self, names: np.ndarray, ticks, cost: float | None, chain: bool) -> np.ndarray:
        """``rank`` of many entries (uint64 ``names``; ``ticks`` one for all or one each; one ``cost`` for all), as
        int64. ``chain``: the names are one chain in order. One by one unless a policy does better."""
        ticks = np.broadcast_to(np.asarray(ticks, dtype=np.int64), names.shape)
        return np.fromiter(map(self.rank, names.tolist(), ticks.tolist(), [cost] * len(names)), dtype=np.int64,
                           count=len(names))

    # -- the floor rule, kept here for every policy -------------------------------------------------------------------
    def key(self, name: int, tick: int, floor: int = 0, cost: float | None = None) -> int:
        """The eviction key of the entry ``name`` used (or stored) at ``tick``: ``rank``, and never below ``floor``
        (the key it holds) for a monotone policy."""
        k = self.rank(name, tick, cost)
        return k if not self.monotone or k > floor else floor

    def keys(self, names: np.ndarray, ticks, floors: np.ndarray, cost: float | None = None,
             chain: bool = False) -> np.ndarray:
        """``key`` of many entries at once (int64 ``floors``, one each)."""
        k = self.ranks(names, ticks, cost, chain)
        return np.maximum(floors, k) if self.monotone else k


def entry_name(key) -> int:
    """The 64-bit name a policy knows a cache entry with no page name by (an encoder output's key: its hash in this
    process, so it lives as long as the process does)."""
    return hash(key) & 0xFFFFFFFFFFFFFFFF
