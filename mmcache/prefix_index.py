"""PrefixIndex: full, written KV pages by page name, each confirmed by its verifying ids, with cold-tail eviction.

The index holds one owner on each indexed page; the pool frees a page when its count reaches 0, and this module
never frees pages any other way. It takes no lock of its own: its one user (``PrefixLifecycle``) calls every method
under the pool's ``cache_lock``, so the index and the request tables change together.

Invariants:
- closed under parents: an indexed page's parent is indexed and is the very page it was indexed under. ``evict`` and
  ``remove`` take every indexed descendant of a page with it, so a page id the pool hands out again can never stand
  as the parent of a stale child (the parent page id is a verifying id, and a reused id must not satisfy it);
- a page indexed takes its parent's tick, and every touch touches a whole chain prefix with one tick, so ticks never
  increase along a chain, and the ``eviction_key`` order (tick, then deeper first) evicts cold tails from their ends;
- ``_cold`` (a heap of ``(key, page, serial)``) holds an entry for every indexed page, keyed at most its current
  ``eviction_key``: an entry is pushed when the page is indexed, after its tick is set, and a key only grows while the
  page stays indexed (ticks come from the pool's clock, never lowered: a page walked takes its parent's tick, which is
  at least its own; depth is fixed). ``coldest`` refreshes an entry whose key grew when it reaches the top, so the
  top entry whose key is current is the coldest candidate without a pass over the pool;
- ``serial[page]`` is unique per indexing of a page: a request table that remembers (page, serial) of a chain page it
  did not retain can tell later whether that page is still the one it saw;
- an ``IndexObserver`` hears of every page the index adopts (``stored``, in chain order, each run after its parent)
  and of every page it drops (``removed``, ``cleared``), so what it hears rebuilds exactly the set of indexed names.
"""

from __future__ import annotations

import array
import heapq
from itertools import repeat
from typing import Callable, Sequence

import numpy as np

from mmcache.checks import require
from mmcache.guard import Guard
from mmcache.index_types import ChainRun, IndexObserver, Inserted, TierView
from mmcache.names import token_bytes
from mmcache.pool import SCALAR_PAGES, PagePool
from mmcache.reclaim import coldest_of, coldest_off_heap, eviction_key, heap_covers

COUNTERS = ("queries", "hits", "queried_tokens", "hit_tokens", "evicted_pages", "freed_pages", "eviction_batches",
            "shortfall_pages", "stalls", "collisions", "listener_errors")


class PrefixIndex:
    """Page name -> page, plus per-page verifying ids (tokens, 128-bit media id, parent page, salt) and LRU ticks.

    ``evict_batch_pages``: the least number of cached pages one eviction frees, so a saturated pool evicts in
    batches instead of once per allocation. ``spill(index, pages)``: called by ``evict`` while the evicted pages still
    hold their bytes and ids (a lower tier's write-back). ``observer``: an ``IndexObserver``. ``counters`` are the
    lifecycle's counters (``COUNTERS``); the index advances the eviction and collision ones, the lifecycle the query
    ones.
    """

    def __init__(self, pool: PagePool, page_size: int, evict_batch_pages: int,
                 spill: Callable[[PrefixIndex, np.ndarray], None] | None = None,
                 observer: IndexObserver | None = None, page_seconds: float | None = None):
        self.pool = pool
        self.page_seconds = page_seconds  # what a hit on one page saves: its prefill (the policy's cost), or unknown
        pool.register(self)
        self.page_size = P = page_size
        self.evict_batch_pages = evict_batch_pages
        self._spill = spill
        self._observer = observer
        n = pool.num_pages
        # Per page id (valid where indexed): the verifying ids (name, token row, 128-bit media id as two halves,
        # parent page, salt id), depth, tick, serial and the indexed flag. Each lives in one array of the ``array``
        # module (never resized) that a numpy view shares: a request's few pages (up to ``SCALAR_PAGES``) are read
        # and written one by one on the arrays, whole-pool work (eviction, tiers, events, ``insert_children``) goes
        # through the views. An engine calls between forwards, when every numpy call runs cold (~20-50 us each).
        self._names = array.array("Q", bytes(8 * n))
        self._token_ids = array.array("i", bytes(4 * n * P))   # page p's row: [p * P, (p + 1) * P)
        self._media_los = array.array("Q", bytes(8 * n))
        self._media_his = array.array("Q", bytes(8 * n))
        self._parents = array.array("i", [-1]) * n
        self._page_salts = array.array("i", bytes(4 * n))
        self._depths = array.array("i", bytes(4 * n))
        self._ticks = array.array("q", bytes(8 * n))
        self._keys = array.array("q", bytes(8 * n))  # the pool policy's eviction key at the last use
        self._serials = array.array("q", bytes(8 * n))
        self._flags = array.array("b", bytes(n))
        # Indexed children of each page: a set of pages whose counts add up to the children it holds itself has no
        # descendant outside it (``_with_descendants`` then needs no pass over the pool).
        self._kid_counts = array.array("i", bytes(4 * n))
        self._row_bytes = memoryview(self._token_ids).cast("B")  # page p's row: bytes [p * step, (p + 1) * step)
        self._step = 4 * P
        self._name = np.frombuffer(self._names, dtype=np.uint64)
        self._tokens = np.frombuffer(self._token_ids, dtype=np.int32).reshape(n, P)
        self._media_lo = np.frombuffer(self._media_los, dtype=np.uint64)
        self._media_hi = np.frombuffer(self._media_his, dtype=np.uint64)
        self._parent = np.frombuffer(self._parents, dtype=np.int32)
        self._salt = np.frombuffer(self._page_salts, dtype=np.int32)
        self._depth = np.frombuffer(self._depths, dtype=np.int32)
        self._tick = np.frombuffer(self._ticks, dtype=np.int64)
        self._key = np.frombuffer(self._keys, dtype=np.int64)
        self._serial = np.frombuffer(self._serials, dtype=np.int64)
        self._indexed = np.frombuffer(self._flags, dtype=bool)
        self._kids = np.frombuffer(self._kid_counts, dtype=np.int32)
        self._next_serial = 1
        self._cold: list[tuple[int, int, int]] = []  # (eviction key when pushed, page, serial): see the invariants
        self._pages: dict[int, int] = {}
        self._salt_ids: dict[bytes, int] = {b"": 0}
        self._salts: list[bytes] = [b""]  # salt id -> salt
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.guard = Guard(self.counters)

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
        salt = bytes(salt)
        sid = self._salt_ids.setdefault(salt, len(self._salt_ids))
        if sid == len(self._salts):
            self._salts.append(salt)
        return sid

    def serial(self, page: int) -> int:
        """The serial of ``page``'s current indexing (0 when not indexed)."""
        return self._serials[page] if self._flags[page] else 0

    def match(self, names: Sequence[int], tokens: np.ndarray, mids: np.ndarray, salt_id: int,
              parent: int = -1) -> list[int]:
        """Pages nominated by walking ``names`` to the first miss, cut at the first that fails verification.

        Every nominated page is verified (``_same``: its tokens, media, parent and salt) before it is accepted; a page
        is accepted only if its whole chain back to page 0 is the request's own, so a hash collision costs a miss.
        ``parent``: the indexed page the first name continues (-1: the chain starts here); ``tokens`` (int32) and
        ``mids`` (``media_ids``) start at the first name's page. Up to ``SCALAR_PAGES`` names, page by page on the
        arrays; more, as one vectorized comparison.
        """
        if not len(names) or names[0] not in self._pages:  # a miss at the first page (a new prompt): no arrays built
            return []
        if len(names) <= SCALAR_PAGES:
            rows = token_bytes(tokens)
            idx, get, m, step = [], self._pages.get, memoryview(mids), self._step
            for i, name in enumerate(names):
                page = get(name)
                if page is None:
                    break
                if not self._same(page, rows[i * step:(i + 1) * step], m[i, 0], m[i, 1], parent, salt_id):
                    self.counters["collisions"] += 1
                    break
                idx.append(parent := page)
            return idx
        # Probing past the first miss in C is cheaper than stopping there in a Python loop.
        idx = np.fromiter(map(self._pages.get, names, repeat(-1)), dtype=np.int64, count=len(names))
        miss = np.flatnonzero(idx < 0)
        if miss.size:
            idx = idx[:miss[0]]
        k, P = idx.size, self.page_size
        if k == 0:
            return []
        # ``_same`` for every nominated page at once
        rows = self._tokens[idx]
        expected = tokens[:k * P].reshape(k, P)
        parents = np.empty(k, dtype=np.int32)
        parents[0], parents[1:] = parent, idx[:-1]
        ok = (self._parent[idx] == parents) & (self._salt[idx] == salt_id)
        ok &= (self._media_lo[idx] == mids[:k, 0]) & (self._media_hi[idx] == mids[:k, 1])
        if not (ok.all() and (rows == expected).all()):  # the common all-equal case skips the per-row reduction
            ok &= (rows == expected).all(axis=1)
            self.counters["collisions"] += 1
            idx = idx[:int(np.argmin(ok))]
        return idx.tolist()

    def touch(self, pages, rekey: bool = True) -> None:
        """Mark a chain prefix used now (one tick for the whole prefix keeps ticks non-increasing along chains) and
        take each page's eviction key from the pool's policy. ``rekey=False``, ticks only: for a request that just
        retained the pages it matched, which no eviction can take while it holds them, and which it rekeys when it
        is done with them (``PrefixLifecycle.touch``); a lookup of a long prefix then asks the policy nothing."""
        if not len(pages):
            return
        if rekey:
            self._stamp(pages, self.pool.clock.tick())
        elif type(pages) is list and len(pages) <= SCALAR_PAGES:
            tick, ticks = self.pool.clock.tick(), self._ticks
            for page in pages:
                ticks[page] = tick
        else:
            self._tick[pages] = self.pool.clock.tick()

    def looked_up(self, names: Sequence[int], hits: int) -> None:
        """A request looked up ``names`` (its matchable chain) and holds the first ``hits`` pages, then the rest as
        it computes them, until it releases the chain: told to the pool's policy."""
        self.guard.call("eviction policy", self.pool.policy.looked_up, names, hits, True)

    def released(self, names: Sequence[int]) -> None:
        """A request is done with the chain ``names`` (the positions it indexed or walked): told to the pool's policy
        (before the chain is touched)."""
        self.guard.call("eviction policy", self.pool.policy.released, names)

    def _stamp(self, pages, tick, chain: bool = True) -> None:
        """Indexed ``pages`` used at ``tick`` (one for all; an array of one per page for many pages): their ticks and
        their policy keys. Two rules, kept here: a page's key is never above its parent's (a page is matched only
        with its prefix, so it is worth no more; eviction then takes chains from their tails), and a monotone
        policy's key is never lowered (a fresh heap entry at every change for one that is not). ``chain``: the pages
        are one chain in order (each page's parent is the one before it, or indexed before the call); else each
        page's parent is outside the call. A few one by one on the arrays, more through the views. The policy's keys
        are asked before anything changes; a policy that raises gives way to the LRU key (``mmcache.guard``)."""
        policy, keys = self.pool.policy, self._keys
        monotone = policy.monotone
        if len(pages) <= SCALAR_PAGES:
            pages = pages if type(pages) is list else pages.tolist()
            ticks, names, parents, cost = self._ticks, self._names, self._parents, self.page_seconds
            key = self.guard.key
            wanted = [key(policy, names[page], tick, keys[page], cost) for page in pages]
            for page, k in zip(pages, wanted):
                ticks[page] = tick
                old, up = keys[page], parents[page]
                if up >= 0 and k > keys[up]:
                    k = keys[up] if not monotone or keys[up] > old else old
                keys[page] = k
        else:
            idx = np.asarray(pages, dtype=np.int64)
            old = self._key[idx]
            k = self.guard.keys(policy, self._name[idx], tick, old, self.page_seconds, chain)
            self._tick[idx] = tick
            up = self._parent[idx]
            limit = np.where(up >= 0, self._key[np.maximum(up, 0)], np.iinfo(np.int64).max)
            if chain:  # the first page's parent, then each page's: the keys so far
                k = np.minimum.accumulate(np.minimum(k, limit[0]))
            else:
                k = np.minimum(k, limit)
            self._key[idx] = np.maximum(k, old) if monotone else k
            pages = idx.tolist()
        if not monotone:
            W, depths, serials = self.pool.num_pages + 1, self._depths, self._serials
            for page in pages:
                heapq.heappush(self._cold, (keys[page] * W - depths[page], page, serials[page]))

    def insert(self, pages: Sequence[int], names: Sequence[int], page_tokens: np.ndarray, mids: np.ndarray,
               salt_id: int, depth: int = 0, parent: int = -1,
               media: dict[int, bytes] | None = None) -> tuple[list[int], list[int], bool]:
        """Index one run of chain positions (``insert_runs`` of one ``ChainRun``); returns its ``Inserted``."""
        return self.insert_runs([ChainRun(pages, names, page_tokens, mids, salt_id, depth, parent, media)])[0]

    def insert_runs(self, runs: Sequence[ChainRun]) -> list[Inserted]:
        """Index each run's chain positions ``depth, depth+1, ...``: ``pages[j]`` named ``names[j]`` with verifying
        ids ``rows[j]``/``mids[j]``, under the indexed page ``parent`` (-1 at depth 0; a caller that did not retain it
        checks first, by ``serial``, that it is still the page it saw). Each page adopted gets an owner of the index's
        own; a page that is already indexed is the caller's own matched page and continues the chain.

        A name already indexed with equal verifying ids is not duplicated: the chain continues from the indexed page
        (the caller's copy stays the caller's), also when an earlier run of the same call indexed it. A name held by
        different ids stops that run there. Per run: the positions ``j`` adopted, the chain pages walked (position
        ``depth + i`` is ``chain[i]``; the last is the parent of the next position) and whether the chain may go on.
        The pages walked take their parent's tick (a chain from depth 0 a new one), so an insert never touches the
        chain before it: a request table touches its whole chain once, when the request is done with it
        (``PrefixLifecycle.touch``). One owner update for all runs. ``media`` (a run's media blobs by chain position)
        only tells the observer which media each page holds.
        """
        out, adopted_all, told, fresh, flags, ticks = [], [], [], None, self._flags, self._ticks
        for run in runs:
            new, chain_pages, parent, ok = [], [], run.parent, True
            pages, rows, mids, step = run.pages, token_bytes(run.rows), memoryview(run.mids), self._step
            few = len(run.names) <= SCALAR_PAGES  # written one by one as adopted; a longer run at once (_record)
            for j, name in enumerate(run.names):
                page = pages[j]
                if not flags[page]:
                    other = self._pages.get(name)
                    if other is None:
                        self._pages[name] = page
                        new.append(j)
                        if few:
                            self._put(page, name, rows[j * step:(j + 1) * step], mids[j, 0], mids[j, 1], parent,
                                      run.salt_id, run.depth + j, self._next_serial)
                            self._next_serial += 1
                    elif self._same(other, rows[j * step:(j + 1) * step], mids[j, 0], mids[j, 1], parent,
                                    run.salt_id):
                        page = other
                    else:
                        self.counters["collisions"] += 1
                        ok = False
                        break
                chain_pages.append(parent := page)
            if new:
                adopted = [pages[j] for j in new]
                if not few:
                    self._record(adopted, [run.names[j] for j in new], run.rows, run.mids, new,
                                 [chain_pages[j - 1] if j else run.parent for j in new], run.salt_id, run.depth)
                adopted_all += adopted
                if self._observer is not None:  # told once the index holds them (mmcache.guard)
                    told.append((new, run.names, chain_pages, run.parent, run.rows, run.salt_id, run.depth,
                                 run.media or {}))
            if chain_pages:  # the parent's tick: ticks never increase along the chain, and no prefix is touched
                if run.parent >= 0:
                    tick = ticks[run.parent]
                else:
                    tick = fresh = self.pool.clock.tick() if fresh is None else fresh
                self._stamp(chain_pages, tick)
            if new:
                self._enqueue([pages[j] for j in new])
            out.append(Inserted(new, chain_pages, ok))
        if adopted_all:
            self.pool.retain(adopted_all, distinct=True)
        for what in told:
            self._tell_stored(*what)
        return out

    def insert_children(self, pages: Sequence[int], names: Sequence[int], rows: np.ndarray, parents: Sequence[int],
                        salt_ids: Sequence[int], depths: Sequence[int]) -> list[int]:
        """Index ``pages[j]`` (named ``names[j]``, verifying ids ``rows[j]``, no media) as the child of the indexed page
        ``parents[j]`` at chain position ``depths[j]``, for each ``j`` whose page is not indexed and whose name is
        not: what ``insert_runs`` does for runs of one such page, written as arrays (a decode step's pages that
        filled). The others are left to ``insert_runs`` (an equal page to continue from, or a collision), and all of
        them when an observer listens. Returns the ``j`` indexed; each takes an owner of the index's and its parent's
        tick. Callers checked each parent is still the page they saw (``serial``)."""
        if self._observer is not None:
            return []
        handled, index_of, flags = [], self._pages, self._flags
        for j, name in enumerate(names):
            page = pages[j]
            if not flags[page] and name not in index_of:
                index_of[name] = page
                handled.append(j)
        if not handled:
            return handled
        if len(handled) <= SCALAR_PAGES:  # a few requests' pages: one by one on the arrays
            by_row, step, ticks = token_bytes(rows), self._step, self._ticks
            for j in handled:
                page, up = pages[j], parents[j]
                self._put(page, names[j], by_row[j * step:(j + 1) * step], 0, 0, up, salt_ids[j], depths[j],
                          self._next_serial)
                self._next_serial += 1
                self._stamp([page], ticks[up])  # the parent's tick: ticks never increase along a chain
            adopted = [pages[j] for j in handled]
            self._enqueue(adopted)
            self.pool.retain(adopted, distinct=True)
            return handled
        at = np.asarray(handled, dtype=np.int64)
        idx = np.asarray(pages, dtype=np.int64)[at]
        up = np.asarray(parents, dtype=np.int64)[at]
        serial = self._next_serial
        self._next_serial += idx.size
        self._write(idx, np.asarray(names, dtype=np.uint64)[at], rows[at], 0, 0, up,
                    np.asarray(salt_ids, dtype=np.int32)[at], np.asarray(depths, dtype=np.int32)[at], serial)
        self._stamp(idx, self._tick[up], chain=False)  # the parent's tick: ticks never increase along a chain
        self._enqueue(idx.tolist())
        self.pool.retain(idx, distinct=True)
        return handled

    def serials(self, pages: Sequence[int]) -> list[int]:
        """``serial`` of each of ``pages``."""
        if len(pages) <= SCALAR_PAGES:
            return [self.serial(page) for page in pages]
        idx = np.asarray(pages, dtype=np.int64)
        return np.where(self._indexed[idx], self._serial[idx], 0).tolist()

    def _record(self, adopted: list[int], names: list[int], rows: np.ndarray, mids: np.ndarray, new: list[int],
                parents: list[int], salt_id: int, depth: int) -> None:
        """Write the verifying ids and chain metadata of the pages ``adopted`` (run positions ``new``) of a run longer
        than ``SCALAR_PAGES`` at once, as arrays (``_write``), so a later run of the same ``insert_runs`` compares
        against them."""
        serial = self._next_serial
        self._next_serial += len(adopted)
        if len(new) == len(rows):  # every position of the run adopted (fresh pages): no gathers
            self._write(np.asarray(adopted, dtype=np.int64), names, rows, mids[:, 0], mids[:, 1], parents, salt_id,
                        np.arange(depth, depth + len(new), dtype=np.int32), serial)
            return
        self._write(np.asarray(adopted, dtype=np.int64), names, rows[new], mids[new, 0], mids[new, 1], parents,
                    salt_id, np.asarray(new, dtype=np.int32) + depth, serial)

    def _put(self, page: int, name: int, row: memoryview, media_lo: int, media_hi: int, parent: int, salt_id: int,
             depth: int, serial: int) -> None:
        """``_write`` of one page, on the arrays (``row``: its token ids as bytes, ``token_bytes``)."""
        step = self._step
        self._names[page] = name
        self._row_bytes[page * step:(page + 1) * step] = row
        self._media_los[page], self._media_his[page] = media_lo, media_hi
        self._parents[page] = parent
        if parent >= 0:
            self._kid_counts[parent] += 1
        self._page_salts[page] = salt_id
        self._depths[page] = depth
        self._serials[page] = serial
        self._keys[page] = 0  # a new indexing's key starts from nothing (the slot may hold an old one's)
        self._flags[page] = 1

    def _write(self, idx: np.ndarray, names, rows: np.ndarray, media_lo, media_hi, parents, salt_ids, depths,
               serial: int) -> None:
        """The verifying ids and chain metadata of the pages ``idx`` as arrays (each argument one value a page, or one
        for all), serials from ``serial`` on, and the pages marked indexed."""
        self._name[idx] = np.asarray(names, dtype=np.uint64)
        self._tokens[idx] = rows
        self._media_lo[idx], self._media_hi[idx] = media_lo, media_hi
        self._parent[idx] = parents
        up = self._parent[idx]
        np.add.at(self._kids, up[up >= 0], 1)
        self._salt[idx] = salt_ids
        self._depth[idx] = depths
        self._serial[idx] = np.arange(serial, serial + idx.size)
        self._key[idx] = 0
        self._indexed[idx] = True

    def _tell_stored(self, new, names, chain_pages, first_parent, page_tokens, salt_id, depth, media) -> None:
        """One ``stored`` per run of consecutive adopted positions, each under the page before it."""
        start = 0
        for i in range(1, len(new) + 1):
            if i < len(new) and new[i] == new[i - 1] + 1:
                continue
            run = new[start:i]
            j = run[0]
            parent = chain_pages[j - 1] if j else first_parent
            self.guard.call("observer", self._observer.stored, [int(names[q]) for q in run],
                            int(self._name[parent]) if parent >= 0 else None, np.array(page_tokens[run[0]:run[-1] + 1]),
                            [media.get(depth + q, b"") for q in run], self._salts[salt_id], depth + j)
            start = i

    def _same(self, page: int, row: memoryview, media_lo: int, media_hi: int, parent: int, salt_id: int) -> bool:
        """The verification rule: indexed ``page`` holds the request's page when its parent page, salt id, both media
        id halves and every token id (``row``: the request's page as bytes, ``token_bytes``) equal the request's.
        ``match`` applies it to many pages at once as arrays; a page is used only after it passed."""
        step = self._step
        return (self._parents[page] == parent and self._page_salts[page] == salt_id
                and self._media_los[page] == media_lo and self._media_his[page] == media_hi
                and self._row_bytes[page * step:(page + 1) * step] == row)

    def _enqueue(self, pages: list[int]) -> None:
        """Heap entries for ``pages``, just indexed with their ticks set. Entries of pages gone (evicted, removed) are
        dropped as they reach the top; when they outnumber the indexed pages the heap is rebuilt from those, so it
        never holds more than twice the pool's pages plus ``4 * SCALAR_PAGES``."""
        heap, W = self._cold, self.pool.num_pages + 1
        keys, depths, serials = self._keys, self._depths, self._serials
        entries = [(keys[p] * W - depths[p], int(p), serials[p]) for p in pages]
        if len(heap) + len(entries) > 2 * len(self._pages) + 4 * SCALAR_PAGES:
            self._rebuild_cold()
        elif len(entries) > len(heap):  # heapify is linear in the whole heap: worth it only past that many pushes
            heap += entries
            heapq.heapify(heap)
        else:
            for e in entries:
                heapq.heappush(heap, e)

    def _rebuild_cold(self) -> None:
        """``_cold`` anew: one entry per indexed page, at its current key."""
        idx = np.flatnonzero(self._indexed)
        keys = eviction_key(self.pool, self._key[idx], self._depth[idx])
        self._cold = list(zip(keys.tolist(), idx.tolist(), self._serial[idx].tolist()))
        heapq.heapify(self._cold)

    def coldest(self, n: int) -> tuple[Sequence[int], Sequence[int]]:
        """``Evictable.coldest``: ``n`` candidates with the lowest ``eviction_key``s (all when fewer; lowest page id
        first among equal keys), and their keys. Up to ``SCALAR_PAGES``, from the top of ``_cold``
        (``reclaim.coldest_off_heap``), as lists (what ``evict`` takes one by one, no numpy call): entries of pages
        gone are dropped, those whose key grew are pushed again at their key, those a live owner holds are set aside
        and put back; as arrays from a pass over the pool (``eviction_candidates``) for more, or when more than
        ``SCALAR_PAGES`` held pages are colder than what is asked (a pool whose cold pages are mostly live)."""
        if n > SCALAR_PAGES:
            return coldest_of(self.eviction_candidates(), n)
        owners = self.pool.owners
        chosen = coldest_off_heap(self._cold, n, self._current, lambda item: owners(item[1]) == 1,
                                  ident=lambda item: item[1])
        if chosen is None:
            return coldest_of(self.eviction_candidates(), n)
        return [item[1] for item in chosen], [item[0] for item in chosen]

    def _current(self, item: tuple) -> int | None:
        """The ``eviction_key`` now of a heap item's page; None when it is gone (unindexed, or indexed again: that
        indexing has its own item)."""
        _, page, serial = item
        if not self._flags[page] or self._serials[page] != serial:
            return None
        return self._keys[page] * (self.pool.num_pages + 1) - self._depths[page]

    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pages only the index holds (count 1) and their ``eviction_key``s: coldest first, deeper first among equal
        ticks, so any prefix of the order is a set of whole cold tails (see the module docstring)."""
        cands = np.flatnonzero(self._indexed & (self.pool.counts == 1))
        return cands, eviction_key(self.pool, self._key[cands], self._depth[cands])

    def evict(self, pages) -> None:
        """Drop ``pages`` (held only by the index; a list of a few, as ``coldest`` gives them, or an array) and every
        indexed descendant of theirs, after the lower tier took their bytes: counted as evicted (unindexed), and as
        freed those the index alone held (a descendant a live request holds stays with it)."""
        pages = self._with_descendants(pages if type(pages) is list else np.asarray(pages, dtype=np.int64))
        if not len(pages):
            return
        if self._spill is not None:  # a tier that raises keeps nothing (mmcache.guard)
            self.guard.call("lower tier", self._spill, self, np.asarray(pages, dtype=np.int64))
        listed = pages if type(pages) is list else pages.tolist()
        gone = ([self._names[p] for p in listed], [self._keys[p] for p in listed], [self._ticks[p] for p in listed])
        counts = self.pool.counts
        freed = sum(counts[p] == 1 for p in listed) if len(listed) <= SCALAR_PAGES else int((counts[pages] == 1).sum())
        self._drop(pages)
        self.counters["evicted_pages"] += len(pages)
        self.counters["freed_pages"] += int(freed)
        self.guard.call("eviction policy", self.pool.policy.evicted, *gone)

    def remove(self, pages) -> int:
        """Unindex ``pages`` that are indexed, with their indexed descendants (not spilled, not counted as evicted:
        the caller says their KV is bad). Live holders keep their own owners. Returns the pages unindexed."""
        pages = np.asarray(pages, dtype=np.int64)
        pages = self._with_descendants(pages[self._indexed[pages]] if pages.size else pages)
        self._drop(pages)
        return int(pages.size)

    def _with_descendants(self, pages):
        """``pages`` (a list of Python ints, or an array) and every indexed page whose chain runs through one of them,
        each once. A few pages whose child counts are all children among themselves (the common cold-tail batch) need
        no more, checked one by one (a list stays a list); otherwise one pass over the pool per level (an array)."""
        if not len(pages):
            return pages
        if len(pages) <= SCALAR_PAGES:
            listed = pages if type(pages) is list else pages.tolist()
            inside, kids, parents = set(listed), self._kid_counts, self._parents
            if sum(kids[p] for p in inside) == sum(parents[p] in inside for p in inside):
                if len(inside) == len(listed):
                    return pages
                return sorted(inside) if type(pages) is list else np.asarray(sorted(inside), dtype=np.int64)
        pages = np.asarray(pages, dtype=np.int64)
        out = np.zeros(self.pool.num_pages, dtype=bool)
        out[pages] = True
        frontier = pages
        while True:
            kids = np.flatnonzero(self._indexed & ~out & np.isin(self._parent, frontier))
            if not kids.size:
                return np.flatnonzero(out)
            out[kids] = True
            frontier = kids

    def _drop(self, pages) -> None:
        """Unindex ``pages`` (distinct, closed under descendants: ``_with_descendants``; a list or an array) and
        release the index's owner on them; a few one by one on the arrays."""
        if not len(pages):
            return
        if len(pages) <= SCALAR_PAGES:
            pages = pages if type(pages) is list else pages.tolist()
            names, flags, parents, kids = [], self._flags, self._parents, self._kid_counts
            for p in pages:
                names.append(self._names[p])
                flags[p] = 0
                if parents[p] >= 0:
                    kids[parents[p]] -= 1
        else:
            names = self._name[pages].tolist()
            self._indexed[pages] = False
            up = self._parent[pages]
            np.add.at(self._kids, up[up >= 0], -1)
        for name in names:
            del self._pages[name]
        self.pool.release(pages, distinct=True)
        if self._observer is not None:
            self.guard.call("observer", self._observer.removed, names)

    def clear(self) -> int:
        """Drop every entry and release the index's owner on its pages; returns how many were dropped."""
        pages = np.flatnonzero(self._indexed)
        self._pages.clear()
        self._cold = []
        self._indexed[:] = False
        self._kids[:] = 0
        self.pool.release(pages)
        if self._observer is not None:
            self.guard.call("observer", self._observer.cleared)
        return int(pages.size)

    def owners(self) -> np.ndarray:
        """The owners the index holds on each page of the pool (one on each indexed page), as int32."""
        return self._indexed.astype(np.int32)

    def check(self) -> None:
        """``BrokenInvariant`` naming the first rule of the module docstring that does not hold: the name table is the
        indexed set and the arrays agree with it; the index is closed under parents and counts each page's indexed
        children; no tick (nor, under a monotone policy, key) rises from a page to its child; the heap holds an item
        of every indexed page's current indexing at no more than its ``eviction_key``; the pool counts the index's
        owner on every one."""
        idx = np.flatnonzero(self._indexed)
        require(sorted(self._pages.values()) == idx.tolist(), "the name table is the indexed set")
        require(all(int(self._name[p]) == n for n, p in self._pages.items()), "a page holds the name it is indexed by")
        parents = self._parent[idx]
        up, child = parents[parents >= 0], idx[parents >= 0]
        require(self._indexed[up].all(), "an indexed page's parent is indexed")
        require((self._kids == np.bincount(up, minlength=self.pool.num_pages)).all(),
                "each page counts its indexed children")
        require((self._tick[up] >= self._tick[child]).all(), "ticks never rise from a page to its child")
        # a policy whose keys fall (the replay's optimum) lowers a used parent's key and leaves its children's
        require(not self.pool.policy.monotone or (self._key[up] >= self._key[child]).all(),
                "keys never rise from a page to its child")
        require((self.pool.counts[idx] >= 1).all(), "the pool counts the index's owner on every indexed page")
        require(set(idx.tolist()) <= heap_covers(self._cold, self._current, lambda item: item[1]),
                "the heap holds every indexed page at no more than its key")

    # ----------------------------------------------------------------- read access for the tiers (mmcache.tiers)
    def tier_view(self) -> TierView:
        """Read-only access to the verifying ids of indexed pages, by page id (valid where ``indexed``)."""
        return TierView(self._name, self._tokens, self._parent, self._salt, self._depth, self._media_lo,
                        self._media_hi, self._salts)
