"""PrefixIndex: full, written KV pages by page name, each confirmed by its verifying ids, with cold-tail eviction.

The index holds one owner on each indexed page; the pool frees a page when its count reaches 0, and this module
never frees pages any other way. It takes no lock of its own: its one user (``PrefixCache``) calls every method under
its lock, so the index and the live table change together.

Chain invariants the eviction order relies on (the caller keeps the first, ``touch`` the second):
- a live request holds index pages only as a prefix 0..k-1 of its chain, so a page only the index owns (count 1)
  has no live holder below it either;
- every touch of a page touches all its ancestors with the same tick, so ticks never increase along a chain, and
  ordering by (tick, -depth) puts every page after all of its descendants: any prefix of that order is a set of
  whole cold tails.
"""

from __future__ import annotations

from itertools import repeat
from typing import Callable, Sequence

import numpy as np

from mmcache.pool import PagePool
from mmcache.reclaim import Clock, make_room

COUNTERS = ("queries", "hits", "queried_tokens", "hit_tokens", "evicted_pages", "eviction_batches",
            "shortfall_pages", "stalls", "collisions")


class PrefixIndex:
    """Page name -> page, plus per-page verifying ids (tokens, 128-bit media id, parent page, salt) and LRU ticks.

    ``evict_batch_pages``: the least number of cached pages one eviction frees, so a saturated pool evicts in
    batches instead of once per allocation. ``counters`` are the cache's counters (see ``COUNTERS``); the index
    advances the eviction and collision ones, its user the query ones.
    """

    def __init__(self, pool: PagePool, page_size: int, evict_batch_pages: int, clock: Clock | None = None):
        self.pool = pool
        self.clock = clock or pool.clock  # shared by every cache on the pool, so their ticks compare
        pool.register(self)
        self.page_size = P = page_size
        self.evict_batch_pages = evict_batch_pages
        n = pool.num_pages
        # Verifying ids and chain metadata, preallocated and indexed by page id (valid where _indexed).
        self._name = np.zeros(n, dtype=np.uint64)
        self._tokens = np.zeros((n, P), dtype=np.int32)
        self._media_lo = np.zeros(n, dtype=np.uint64)   # 128-bit media verifying id, split for 1-D gathers
        self._media_hi = np.zeros(n, dtype=np.uint64)
        self._parent = np.full(n, -1, dtype=np.int32)
        self._salt = np.zeros(n, dtype=np.int32)
        self._depth = np.zeros(n, dtype=np.int32)
        self._tick = np.zeros(n, dtype=np.int64)
        self._indexed = np.zeros(n, dtype=bool)
        self._pages: dict[int, int] = {}
        self._salt_ids: dict[bytes, int] = {b"": 0}
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Tiers (mmcache.tiers): called with (index, pages) by ``evict`` while the pages still hold their bytes and ids.
        self.spill: Callable[[PrefixIndex, np.ndarray], None] | None = None

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def indexed(self) -> np.ndarray:
        """A read-only bool view: whether each page id is indexed (holds one index owner)."""
        view = self._indexed.view()
        view.flags.writeable = False
        return view

    def salt_id(self, salt: bytes) -> int:
        """A small integer per distinct salt, stored per page in place of the salt's bytes."""
        return self._salt_ids.setdefault(bytes(salt), len(self._salt_ids))

    def match(self, names: Sequence[int], tokens: np.ndarray, mids: np.ndarray, salt_id: int) -> np.ndarray:
        """Pages nominated by walking ``names`` to the first miss, cut at the first that fails verification.

        Verification is one vectorized comparison of every nominated page's tokens, media, parent and salt; a page
        is accepted only if its whole chain back to page 0 is the request's own, so a hash collision costs a miss.
        """
        # Probing past the first miss in C is cheaper than stopping there in a Python loop.
        idx = np.fromiter(map(self._pages.get, names, repeat(-1)), dtype=np.int64, count=len(names))
        miss = np.flatnonzero(idx < 0)
        if miss.size:
            idx = idx[:miss[0]]
        k, P = idx.size, self.page_size
        if k == 0:
            return idx
        rows = self._tokens[idx]
        expected = tokens[:k * P].reshape(k, P)
        parents = np.empty(k, dtype=np.int32)
        parents[0], parents[1:] = -1, idx[:-1]
        ok = (self._parent[idx] == parents) & (self._salt[idx] == salt_id)
        ok &= (self._media_lo[idx] == mids[:k, 0]) & (self._media_hi[idx] == mids[:k, 1])
        if not (ok.all() and (rows == expected).all()):  # the common all-equal case skips the per-row reduction
            ok &= (rows == expected).all(axis=1)
            self.counters["collisions"] += 1
            idx = idx[:int(np.argmin(ok))]
        return idx

    def touch(self, pages) -> None:
        """Mark a chain prefix used now (one tick for the whole prefix keeps ticks non-increasing along chains)."""
        if len(pages):
            self._tick[pages] = self.clock.tick()

    def insert(self, pages: list[int], names: list[int], page_tokens: np.ndarray, mids: np.ndarray,
               salt_id: int) -> list[int]:
        """Index the chain ``pages[j]`` named ``names[j]`` (``pages`` may run past ``names``; the rest are ignored).

        A name already indexed with equal verifying ids is not duplicated (the chain continues from the indexed
        page); a name held by different ids stops indexing there. Returns the positions ``j`` whose page the index
        adopted: the caller's owner on each becomes the index's, and the caller releases every other page it holds.
        """
        chain_pages, new = [], []
        parent = -1
        for j, name in enumerate(names):
            page = pages[j]
            if not self._indexed[page]:
                other = self._pages.get(name)
                if other is None:
                    self._pages[name] = page
                    new.append(j)
                elif self._same(other, page_tokens[j], mids[j], parent, salt_id):
                    page = other
                else:
                    self.counters["collisions"] += 1
                    break
            chain_pages.append(parent := page)
        if new:
            adopted = [pages[j] for j in new]
            self._name[adopted] = np.array([names[j] for j in new], dtype=np.uint64)
            self._tokens[adopted] = page_tokens[new]
            self._media_lo[adopted], self._media_hi[adopted] = mids[new, 0], mids[new, 1]
            self._parent[adopted] = [chain_pages[j - 1] if j else -1 for j in new]
            self._salt[adopted] = salt_id
            self._depth[adopted] = new
            self._indexed[adopted] = True
        self.touch(chain_pages)
        return new

    def _same(self, page: int, tokens: np.ndarray, mid: np.ndarray, parent: int, salt_id: int) -> bool:
        return bool(self._parent[page] == parent and self._salt[page] == salt_id
                    and self._media_lo[page] == mid[0] and self._media_hi[page] == mid[1]
                    and (self._tokens[page] == tokens).all())

    def make_room(self, need: int) -> None:
        """Ensure ``need`` free pages by evicting whole cold tails in one batch; raise ``OutOfPages`` (evicting
        nothing) when even every cached page on the pool would not cover the shortfall. The choice of what to
        evict lives in ``mmcache.reclaim``, across every cache on the pool (other labels' indexes, an encoder store)."""
        make_room(self.pool, need, self.evict_batch_pages, self.counters)

    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pages only the index holds (count 1) and their eviction keys: lower goes first.

        Key = (tick, -depth) folded into one int64: coldest first, deeper first among equal ticks, so any prefix of
        the order is a set of whole cold tails (see the module docstring)."""
        cands = np.flatnonzero(self._indexed & (self.pool.counts == 1))
        return cands, self._tick[cands] * (self.pool.num_pages + 1) - self._depth[cands]

    def evict(self, pages: np.ndarray) -> None:
        """Drop ``pages`` (a prefix of the candidate order, all held only by the index) and release them."""
        if not len(pages):
            return
        if self.spill is not None:
            self.spill(self, pages)
        for name in self._name[pages].tolist():
            del self._pages[name]
        self._indexed[pages] = False
        self.pool.release(pages)
        self.counters["evicted_pages"] += len(pages)

    def clear(self) -> int:
        """Drop every entry and release the index's owner on its pages; returns how many were dropped."""
        pages = np.flatnonzero(self._indexed)
        self._pages.clear()
        self._indexed[:] = False
        self.pool.release(pages)
        return int(pages.size)

    # ----------------------------------------------------------------- read access for the tiers (mmcache.tiers)
    def tier_view(self) -> "TierView":
        """Read-only access to the verifying ids of indexed pages, by page id (valid where ``indexed``)."""
        return TierView(self)


class TierView:
    """The arrays a tier reads when pages leave the index: ``name``, ``tokens``, ``media_lo``/``media_hi`` (the
    128-bit media id's halves; ``media`` gives pairs), ``parent`` (page id, -1 at depth 0), ``salt`` (salt id;
    ``salt_bytes`` maps it back) and ``depth``."""

    def __init__(self, index: PrefixIndex):
        self.name, self.tokens, self.parent = index._name, index._tokens, index._parent
        self.salt, self.depth = index._salt, index._depth
        self.media_lo, self.media_hi = index._media_lo, index._media_hi
        self._salts = index._salt_ids

    def media(self, pages) -> np.ndarray:
        return np.stack((self.media_lo[pages], self.media_hi[pages]), axis=-1)

    def salt_bytes(self, salt_id: int) -> bytes:
        return next(s for s, i in self._salts.items() if i == salt_id)
