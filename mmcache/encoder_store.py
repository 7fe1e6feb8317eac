"""EncoderStore: digest-keyed encoder outputs in pages of a PagePool, owned and evicted like KV pages (RFC phase 3a).

An output (a tensor, or a tuple/list/dict of tensors) is laid out as bytes over ceil(nbytes / page_bytes) pages of a
pool and gathered back into fresh tensors on a hit, so no tensor a caller holds ever aliases stored bytes
(sglang-omni #258: encoder state leaking between requests).

Page shape: the store views any pool's pages as bytes (``mmcache.encoder_layout``), so KV pages and encoder outputs
share one pool (one pool per node); ``page_data``/``page_dim`` serve a tensor whose pages lie in another dimension
(M*'s KV tensor, page in dim 1).

Ownership: the store holds one owner on each indexed entry's pages, a pin one more, a hit one more while it copies
out. The pool frees a page when its count reaches 0; this module never frees pages any other way. Eviction
(``mmcache.reclaim``) runs only when an owner of the pool needs pages (a put here, a live request's growth in a prefix
cache on the same pool), takes only entries whose pages the store alone owns (count 1), whole entries, and orders them
with the prefix indexes' pages by the key the pool's policy gave each at its last put, hit or pin (``StoredEntry.rank``,
``mmcache.eviction``). The lowest come off a heap (``_cold``: ``(key when pushed, serial, entry)``, one per stored
entry with pages, pushed when it is stored): a key only grows, so an entry whose key grew is pushed again at its key
when it reaches the top, and the top entry with a current key is the one to go; no pass over the entries per
eviction.

Tiers (an ``EncoderLowerTier``, ``mmcache.encoder_protocols``): an evicted entry is spilled with its bytes intact, a
stored value published after the put, and a device miss fetched (outside the lock, one bounded wait) before the
encoder runs, a tier hit stored on the device again. The tier verifies what it hands back against the full key and the
store checks ``expect`` on it; whatever fails, is slow, down or raises is a miss, never an error (``mmcache.guard``).

Locking: the pool's ``cache_lock`` (shared with every cache on the pool: eviction across kinds is atomic) guards the
index, the in-flight table and the counters, taken before the pool's page lock, never after. Byte copies run outside
it: a put fills pages it alone owns, then publishes them; a hit retains its entry's pages under it, gathers without.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from mmcache.checks import as_cost, as_int, require
from mmcache.encoder_flights import Flights
from mmcache.encoder_key import EncoderKey
from mmcache.encoder_layout import PageBytes, StoredBytes, entry_bytes, entry_layout, flatten, tensor_views, unflatten
from mmcache.encoder_pin import EncoderPin, Lent, Lookup, StoredEntry
from mmcache.encoder_protocols import EncoderLowerTier, EncoderObserver
from mmcache.errors import EncoderOutputError, InvalidRequest, OutOfPages
from mmcache.eviction import entry_name
from mmcache.guard import Guard
from mmcache.pool import SCALAR_PAGES, PagePool
from mmcache.reclaim import coldest_of, coldest_off_heap, eviction_key, heap_covers, take
from mmcache.stats import EncoderCounters, EncoderStoreStats, EncoderTally

logger = logging.getLogger(__name__)


def _check_key(key) -> None:
    if not isinstance(key, EncoderKey):
        raise InvalidRequest(f"the encoder store is keyed by EncoderKey(digest, fingerprint, modality, ...), got "
                             f"{type(key).__name__}")


class EncoderStore:
    """Encoder outputs by ``EncoderKey``, in pages of one ``PagePool`` viewed as bytes (see the module docstring).

    Invariants, kept under ``self._lock``:
    - each indexed entry holds exactly one store owner on each of its pages, and no two entries share a page;
    - a page's count is 1 + pins + hits copying out of its entry, so eviction, which takes only entries whose pages
      all have count 1, never takes a pinned entry or one being read;
    - ``bytes_stored`` is the sum of the indexed entries' bytes, in total and per modality;
    - concurrent misses on one key (name and verifying ids), through ``get_or_compute`` or ``get_or_compute_many``,
      compute once (``_flights``, the one in-flight table: ``mmcache.encoder_flights``);
    - values go in and come out as copies: nothing returned aliases the pool, nothing passed in is kept.

    ``pool``: a pool with data (any page shape and dtype) or, with ``page_data``, a metadata-only pool whose page ids
    index ``page_data`` along ``page_dim`` (M*'s KV tensor: ``page_dim=1``). Hits come back on the pool's device.
    ``expect=(shape or shape_fn(key), dtype)`` refuses other outputs (a list of shapes and a list of dtypes for a
    tuple/list/dict of tensors; ``None`` in a shape matches any size). ``tiers``: an ``EncoderLowerTier`` under the
    pool (see the module docstring); its keys' fingerprints must have a stable byte form
    (``EncoderKey.stable_name``), else ``InvalidRequest`` before anything changes. ``eviction``: the policy of the
    store's own pool (a name in ``mmcache.eviction.POLICIES``, None for the default; ``InvalidConfig`` for an unknown
    one); a given ``pool`` evicts by its own, so not with ``pool``. ``observer``: an ``EncoderObserver`` told of
    every output stored and dropped (``mmcache.kv_events``).
    """

    def __init__(self, capacity_bytes: int | None = None, page_bytes: int = 65536, device: str | torch.device = "cpu",
                 *, pool: PagePool | None = None, expect: tuple | None = None,
                 page_data: torch.Tensor | None = None, page_dim: int = 0, tiers: EncoderLowerTier | None = None,
                 eviction: str | None = None, observer: EncoderObserver | None = None):
        if pool is None:
            if capacity_bytes is None:
                raise InvalidRequest("an encoder store needs capacity_bytes or a pool")
            capacity, page = as_int(capacity_bytes, "capacity_bytes"), as_int(page_bytes, "page_bytes")
            if page <= 0 or capacity < page:
                raise InvalidRequest(f"capacity_bytes ({capacity_bytes}) must hold at least one page of {page_bytes} "
                                     f"bytes")
            pool = PagePool(capacity // page, (page,), torch.uint8, device, eviction)
        elif capacity_bytes is not None:
            raise InvalidRequest("give capacity_bytes or pool, not both")
        elif eviction is not None:
            raise InvalidRequest("a store on a given pool evicts by the pool's policy: give eviction or pool, not both")
        if page_data is None:
            if pool.data is None:
                raise InvalidRequest(f"an encoder store needs a pool with data (or page_data), got {pool!r}")
            page_data, page_dim = pool.data, 0
        self._bytes = PageBytes(page_data, as_int(page_dim, "page_dim"), pool.num_pages)
        self.pool = pool
        self.page_bytes = self._bytes.page_bytes
        self.capacity_bytes = pool.num_pages * self.page_bytes
        self.expect = expect
        self.tiers = tiers
        self.observer = observer
        self._lock = pool.cache_lock
        self._entries: dict[tuple, StoredEntry] = {}
        self._holder: dict[int, StoredEntry] = {}  # page -> the stored entry holding it
        self._cold: list[tuple[int, int, StoredEntry]] = []  # see the module docstring (Ownership)
        self._serial = itertools.count()  # ties between equal ticks: the earlier push first; entries never compared
        self._flights = Flights()
        self._lent = Lent(pool, self._lock)  # owners lent to hits copying out and to pins
        self._errors = {"listener_errors": 0}
        self.guard = Guard(self._errors)
        self._tally = EncoderTally()
        self._count = self._tally.count
        pool.register(self)

    # -- public API ---------------------------------------------------------------------------------------------------

    def get(self, key: EncoderKey):
        """A fresh copy of the value stored under ``key``, or None; one query, a hit or a miss (+ a collision when the
        name matches but the verifying ids do not). A device miss asks the tiers; their hit is stored again."""
        self._check(key)
        with self._lock:
            entry = self._lookup(key)
        if entry is not None:
            return self._gather(entry)
        found = self._from_tiers([key])[0]
        return None if found is None else found[0]

    def get_pinned(self, key: EncoderKey):
        """``(value, pin)``: ``get`` and ``pin`` in one lookup (the owner taken to read the value becomes the pin's);
        None on a miss. Counted as ``get`` counts."""
        self._check(key)
        with self._lock:
            entry = self._lookup(key)
        if entry is None:
            found = self._from_tiers([key])[0]
            pin = None if found is None else self.pin(key)
            return None if pin is None else (found[0], pin)
        try:
            return self._read(entry), self._lent.pin(entry, self._read)
        except BaseException:
            self._lent.give_back(entry.pages)
            raise

    def put(self, key: EncoderKey, value, compute_s: float = 0.0) -> bool:
        """Store a copy of ``value`` under ``key``, replacing any entry of that name; False when bypassed.

        Raises ``EncoderOutputError`` before any state changes for non-tensor values, values unlike ``expect``, or a
        shape/dtype unlike the entry stored for the same key and verifying ids. A bypass (larger than the pool, or no
        room because everything left is pinned) stores nothing and drops the replaced entry, so a get never returns
        anything but the last value put. ``compute_s`` is the encoder time each later hit saves (weighed by a
        policy that weighs costs: ``dip-costs``, ``lfu``). A stored value is handed to the tiers (``publish``) after
        the put.
        """
        self._check(key)
        return self._put(key, value, as_cost(compute_s, "compute_s"), publish=True)

    def _put(self, key: EncoderKey, value, compute_s: float, publish: bool) -> bool:
        """``put`` of a checked key; ``publish``: hand the stored value to the tiers (not for a value a tier gave)."""
        leaves: list[torch.Tensor] = []
        tree = flatten(value, leaves)
        if self.expect is not None:
            self._check_expect(key, [(tuple(t.shape), t.dtype) for t in leaves])
        layout, nbytes = entry_layout((t.shape, t.dtype) for t in leaves)
        n = -(-nbytes // self.page_bytes)
        with self._lock:
            self._check_replace(key, tree, layout)
            self._remove(key.name)
            if publish and self.tiers is not None:
                self.guard.call("tier", self.tiers.replaced, key)
            if n > self.pool.num_pages:
                self._count(key.modality, bypasses=1)
                logger.warning("encoder store: %s output of %d bytes exceeds the whole pool (%d bytes); not cached",
                               key.modality, nbytes, self.capacity_bytes)
                return False
            pages = self._take(n)
            if pages is None:
                self._count(key.modality, bypasses=1)
                return False
        try:  # the pages are ours alone and not yet indexed: no lock needed to fill them
            entry = StoredEntry(key, pages, self._write(pages, leaves, layout), tree, layout, nbytes, float(compute_s))
            with self._lock:
                self._check_replace(key, tree, layout)  # a concurrent put of this key may have published meanwhile
                self._remove(key.name)
                self._used(entry)
                self._entries[key.name] = entry
                self._enqueue(entry)
                self._count(key.modality, bytes_stored=nbytes)
                if self.observer is not None:
                    self.guard.call("observer", self.observer.encoder_stored, key, nbytes)
        except BaseException:
            self.pool.release(pages)
            raise
        if publish and self.tiers is not None:
            stored = StoredBytes(key, tree, layout, nbytes, float(compute_s),
                                 entry_bytes(leaves, layout, nbytes, torch.device("cpu")))
            self.guard.call("tier", self.tiers.publish, stored)
        return True

    def get_or_compute(self, key: EncoderKey, fn: Callable[[], Any]) -> Lookup:
        """The stored value for ``key``, else ``fn()`` stored and returned, as a ``Lookup`` that says which; one
        query either way. ``get_or_compute_many`` with one key: the same single-flight table.

        Concurrent misses on one key run ``fn`` once: the first caller computes, the others wait (each counted as a
        join) and get private copies of its result, or the same exception re-raised; a failure stores nothing, so a
        later call retries. A caller never shares a tensor with the store or with another caller.
        """
        return self.get_or_compute_many([key], lambda indices: [fn()])[0]

    def get_or_compute_many(self, keys: list[EncoderKey], compute_missing: Callable[[list[int]], list],
                            *, pin: bool = False) -> list[Lookup]:
        """One ``Lookup`` per key, in order: hits from the store, the misses this call leads computed by ONE
        ``compute_missing(indices)`` (``indices`` into ``keys``, the first use of each led key; it returns their values
        in that order), misses another caller (of either form) is computing joined.

        With tiers, the misses this call leads ask them first, all in one ``fetch`` (one bounded wait), and only what
        no tier holds is computed. One query per distinct key (name and verifying ids); a later use of a key in
        ``keys`` is a copy of the first (``"joined"`` when the first was computed, counted as a join). A name in
        flight with other verifying ids is computed here, uncoordinated (a collision). ``pin``: each Lookup also holds
        an ``EncoderPin`` on its entry (None when the value could not be stored), one per use, released by the
        caller. On any failure (of ``compute_missing``, of a joined computation, of a put) the exception is raised
        after every owner this call took is dropped; nothing of the failed keys is stored and their joiners get the
        same exception.
        """
        keys = list(keys)
        for key in keys:
            self._check(key)
        firsts, plan = {}, []  # identity -> index of first use; per distinct key: (index, entry, flight, lead)
        with self._lock:
            for i, key in enumerate(keys):
                ident = (key.name, key.verify_ids)
                if ident in firsts:
                    continue
                firsts[ident] = i
                entry, flight, lead = self._lookup(key), None, False
                if entry is None:
                    flight, lead = self._flights.take(key)
                    if not lead or flight is None:
                        self._count(key.modality, **({"joins": 1} if flight is not None else {"collisions": 1}))
                plan.append((i, entry, flight, lead))
        found, pins = {}, {}  # index of first use -> (value, source); -> its pin
        unread = {i: entry for i, entry, _, _ in plan if entry is not None}  # hits still holding their lookup's owner
        try:
            self._compute_led(keys, plan, compute_missing, found)  # first: it always resolves the flights it leads
            self._serve_hits(unread, found, pins, pin)
            for i, entry, flight, lead in plan:
                if flight is not None and not lead:
                    found[i] = (flight.result(), "joined")
            return self._hand_out(keys, firsts, found, pins, pin)
        except BaseException:
            for p in pins.values():
                p.release()
            self._lent.give_back([p for entry in unread.values() for p in entry.pages])
            raise

    def _serve_hits(self, unread: dict, found: dict, pins: dict, pin: bool) -> None:
        """Copy out every hit in ``unread`` (no lock held), taking each out once its owner is a pin (``pin``) or
        released."""
        for i in list(unread):
            found[i] = (self._read(unread[i]), "store")
            entry = unread.pop(i)
            if pin:
                pins[i] = self._lent.pin(entry, self._read)
            else:
                self._lent.give_back(entry.pages)

    def _compute_led(self, keys: list, plan: list, compute_missing: Callable, found: dict) -> None:
        """Resolve the misses this call leads: from the tiers first (one fetch for all of them), then the rest by
        ONE ``compute_missing``, each value stored; publish each to joiners (no lock held)."""
        led = [(i, flight) for i, entry, flight, lead in plan if lead]
        if not led:
            return
        try:
            todo = led
            if self.tiers is not None:
                for (i, _), got in zip(led, self._from_tiers([keys[i] for i, _ in led])):
                    if got is not None:
                        found[i] = got[0], got[1]
                todo = [(i, flight) for i, flight in led if i not in found]
            if todo:
                start = time.perf_counter()
                values = list(compute_missing([i for i, _ in todo]))
                if len(values) != len(todo):
                    raise EncoderOutputError(f"compute_missing returned {len(values)} values for {len(todo)} keys")
                share = (time.perf_counter() - start) / len(todo)
                for (i, _), value in zip(todo, values):
                    self._put(keys[i], value, share, publish=True)
                    found[i] = (value, "computed")
        except BaseException as exc:
            for _, flight in led:
                if flight is not None:
                    flight.error = exc
            raise
        finally:
            with self._lock:
                for i, flight in led:
                    if flight is not None:
                        self._flights.close(keys[i], flight)
            for i, flight in led:
                if flight is not None:
                    flight.land(*(found[i][0], True) if i in found else ())

    def _hand_out(self, keys: list, firsts: dict, found: dict, pins: dict, pin: bool) -> list[Lookup]:
        """A Lookup per key: the first use of a key takes its value (and its hit's pin), each later use a clone
        (and a pin of its own); repeats of a computed key count as joins."""
        out, used = [], set()
        for key in keys:
            first = firsts[(key.name, key.verify_ids)]
            value, source = found[first]
            if first in used:
                value = unflatten(flatten(value, leaves := []), (t.clone() for t in leaves))
                if source == "computed":
                    source = "joined"
                    with self._lock:
                        self._count(key.modality, joins=1)
            held = pins.pop(first, None) if first not in used else None
            if pin and held is None:
                held = self.pin(key)
            if held is not None:
                pins[("out", len(out))] = held  # released by the caller from here on, unless we fail
            used.add(first)
            out.append(Lookup(value, source, held))
        pins.clear()
        return out

    def pin(self, key: EncoderKey) -> EncoderPin | None:
        """Add one owner to ``key``'s entry so it cannot be evicted while a request uses it; None when not stored.

        Marks the entry recently used; not counted as a query (a collision still counts).
        """
        _check_key(key)
        with self._lock:
            entry = self._match(key)
            if entry is None:
                return None
            self._used(entry)
            self._lent.lend(entry)
            return self._lent.pin(entry, self._read)

    def clear(self) -> None:
        """Drop every entry's store owner; pinned pages stay with their pins. Counters other than bytes_stored stay."""
        with self._lock:
            self._drop(list(self._entries.values()))
            self._cold = []

    def stats(self) -> EncoderStoreStats:
        """Counter ``totals``, ``entries`` and ``capacity_bytes``, and ``by_modality: {modality: counters}``."""
        with self._lock:
            return EncoderStoreStats(EncoderCounters(**self._tally.totals), len(self._entries), self.capacity_bytes,
                                     {m: EncoderCounters(**c) for m, c in self._tally.by_modality.items()},
                                     **(self.tiers.stats() if self.tiers is not None else {}),
                                     listener_errors=self._errors["listener_errors"])

    def owners(self) -> np.ndarray:
        """Owners per page of the pool (int32): the store's on its entries' pages, and those lent to hits and pins."""
        with self._lock:
            held = np.zeros(self.pool.num_pages, dtype=np.int32)
            held[list(self._holder)] = 1
            np.add.at(held, list(self._lent.pages.elements()), 1)
            return held

    def check(self) -> None:
        """``BrokenInvariant`` naming the first rule of the class docstring that does not hold (each entry's pages its
        own, counted by the pool; ``bytes_stored`` the entries'; the heap holds every entry at no more than its key)."""
        with self._lock:
            pages = [p for e in self._entries.values() for p in e.pages]
            require(len(pages) == len(set(pages)) == len(self._holder) and set(pages) == set(self._holder),
                    "each page of a stored entry is that entry's alone")
            require(all(self.pool.owners(p) >= 1 + self._lent.pages[p] for p in pages),
                    "the pool counts every stored entry's owners")
            require(sum(e.nbytes for e in self._entries.values()) == self._tally.totals["bytes_stored"],
                    "bytes_stored is the stored entries' bytes")
            covered = heap_covers(self._cold, self._current, lambda item: id(item[2]))
            require({id(e) for e in self._entries.values() if e.pages} <= covered,
                    "the heap holds every stored entry at no more than its key")

    def __contains__(self, key: EncoderKey) -> bool:
        _check_key(key)
        with self._lock:
            entry = self._entries.get(key.name)
            return entry is not None and entry.key.verify_ids == key.verify_ids

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"EncoderStore({len(self)} entries, {self._tally.totals['bytes_stored']} bytes in {self.pool!r})"

    # -- internals (``_lock`` held unless stated) ---------------------------------------------------------------------

    def _check(self, key) -> None:
        """``InvalidRequest`` unless ``key`` is an EncoderKey this store can file (with tiers: under a stable name)."""
        _check_key(key)
        if self.tiers is not None:
            key.stable_name  # InvalidRequest when the fingerprint has no form outside this process

    def _from_tiers(self, keys: list[EncoderKey]) -> list[tuple[Any, str] | None]:
        """Per key (each a device miss): ``(value, source)`` of a verified tier hit, stored on the device again, or
        None (no tier, a miss in every tier, a rejection, a tier down or late). No lock held; counted."""
        if self.tiers is None:
            return [None] * len(keys)
        reads = self.guard.call("tier", self.tiers.fetch, keys, self._accepts)  # a tier that raises: a miss
        if reads is None:
            return [None] * len(keys)
        out = []
        for key, read in zip(keys, reads):
            got = None
            if read.entry is not None:
                e = read.entry
                value = unflatten(e.tree, tensor_views(e.data.to(self._bytes.device), e.layout))
                try:
                    self._put(key, value, e.compute_s, publish=False)
                except EncoderOutputError:  # a concurrent put stored another layout for this key: serve, keep it
                    pass
                got = value, read.source
            with self._lock:
                self._count(key.modality, time_saved_s=read.entry.compute_s if got else 0.0, **read.counts)
            out.append(got)
        return out

    def _accepts(self, key: EncoderKey, layout: tuple) -> bool:
        """Whether an entry of ``layout`` read from a tier may be stored under ``key`` (``expect``)."""
        if self.expect is None:
            return True
        try:
            self._check_expect(key, [(s, d) for s, d, _ in layout])
        except EncoderOutputError:
            return False
        return True

    def _match(self, key: EncoderKey) -> StoredEntry | None:
        """The entry named like ``key`` if its verifying ids agree; a disagreement counts a collision."""
        entry = self._entries.get(key.name)
        if entry is not None and entry.key.verify_ids != key.verify_ids:
            self._count(key.modality, collisions=1)
            return None
        return entry

    def _lookup(self, key: EncoderKey) -> StoredEntry | None:
        """``_match`` counted as a query (and as a use by the pool's policy); a hit is marked recently used and
        retained until ``_gather`` releases it."""
        entry = self._match(key)
        self.guard.call("eviction policy", self.pool.policy.looked_up, (entry_name(key.name),), int(entry is not None))
        if entry is None:
            self._count(key.modality, queries=1, misses=1)
            return None
        self._used(entry)
        self._lent.lend(entry)
        self._count(key.modality, queries=1, hits=1, time_saved_s=entry.compute_s)
        return entry



    def _check_expect(self, key: EncoderKey, got: list[tuple]) -> None:
        """``EncoderOutputError`` unless tensors of ``got`` ((shape, dtype) each) are what ``expect`` allows."""
        shape, dtype = self.expect
        shape = shape(key) if callable(shape) else shape
        want = [(shape, dtype)] if isinstance(dtype, torch.dtype) else list(zip(shape, dtype))
        if len(want) != len(got) or any(
                d != gd or len(s) != len(gs) or any(w is not None and w != g for w, g in zip(s, gs))
                for (s, d), (gs, gd) in zip(want, got)):
            raise EncoderOutputError(f"{key.modality} output {got} does not match the expected {want}")

    def _check_replace(self, key: EncoderKey, tree, layout: tuple) -> None:
        old = self._entries.get(key.name)
        if old is not None and old.key.verify_ids == key.verify_ids and (old.tree, old.layout) != (tree, layout):
            raise EncoderOutputError(
                f"{key.modality} output {[(s, d) for s, d, _ in layout]} differs from the one stored for this key "
                f"{[(s, d) for s, d, _ in old.layout]}")

    def _take(self, n: int) -> list[int] | None:
        """``n`` pages, evicting the coldest cached pages of the pool (entries of this store, or KV pages of a prefix
        index on the same pool) as one batch if the free ones fall short; None, with nothing evicted, when even that
        is not enough."""
        try:
            return take(self.pool, n)
        except OutOfPages:  # live requests and pins hold the rest
            return None

    # -- the pool's reclaim protocol (``mmcache.reclaim``; called under ``cache_lock``) -------------------------------

    def eviction_candidates(self):
        """Pages of entries only the store holds (no pin, no hit copying out), keyed by ``eviction_key`` of the
        entry's last-use tick on the pool clock (depth 0), so keys compare with the prefix indexes' on the pool."""
        owners, pages, ranks = self.pool.owners, [], []
        for e in self._entries.values():
            if e.pages and all(owners(p) == 1 for p in e.pages):
                pages += e.pages
                ranks += [e.rank] * len(e.pages)
        return np.asarray(pages, dtype=np.int64), eviction_key(self.pool, ranks)

    def _enqueue(self, entry: StoredEntry) -> None:
        """A heap entry for ``entry``, just stored with its tick set (none for an entry without pages: it frees
        nothing). The heap is rebuilt from the stored entries when those gone since outnumber them, so it holds at
        most twice the entries plus ``4 * SCALAR_PAGES``."""
        if not entry.pages:
            return
        if len(self._cold) >= 2 * len(self._entries) + 4 * SCALAR_PAGES:
            self._cold = [(e.rank, next(self._serial), e) for e in self._entries.values() if e.pages]
            heapq.heapify(self._cold)
        else:
            heapq.heappush(self._cold, (entry.rank, next(self._serial), entry))
        for p in entry.pages:
            self._holder[p] = entry

    def coldest(self, n: int) -> tuple[list[int], list[int]]:
        """``Evictable.coldest``: the pages of the coldest whole entries only the store holds, entry by entry until
        they reach ``n`` pages (all of them when fewer), and their keys. Off the heap (``reclaim.coldest_off_heap``):
        an entry gone is dropped, one whose tick grew is pushed again at its tick, one pinned or being read is set
        aside and put back; the pass over the entries (``eviction_candidates``) when more than ``SCALAR_PAGES`` such
        are colder than what is asked."""
        owners = self.pool.owners
        chosen = coldest_off_heap(self._cold, n, self._current,
                                  lambda item: all(owners(p) == 1 for p in item[2].pages),
                                  lambda item: len(item[2].pages), ident=lambda item: id(item[2]))
        if chosen is None:
            return coldest_of(self.eviction_candidates(), n)
        W = self.pool.num_pages + 1  # eviction_key of depth 0
        return [p for _, _, e in chosen for p in e.pages], [t * W for t, _, e in chosen for _ in e.pages]

    def _current(self, item: tuple) -> int | None:
        """The key now of a heap item's entry; None when the entry is gone (evicted, removed or replaced since)."""
        e = item[2]
        return e.rank if self._entries.get(e.key.name) is e else None

    def _used(self, entry: StoredEntry) -> None:
        """``entry`` is stored or used now: its tick and its policy key (the pool's policy counts the use); a policy
        whose keys may fall gets a fresh heap item."""
        policy = self.pool.policy
        entry.tick = self.pool.clock.tick()
        cost = entry.compute_s / len(entry.pages) if entry.pages and entry.compute_s > 0 else None  # saved per page
        entry.rank = self.guard.key(policy, entry_name(entry.key.name), entry.tick, entry.rank, cost)
        if not policy.monotone and entry.pages and self._entries.get(entry.key.name) is entry:
            heapq.heappush(self._cold, (entry.rank, next(self._serial), entry))

    def evict(self, pages) -> None:
        """Drop every entry holding one of ``pages`` (whole entries: a partial one frees its other pages too)."""
        holder = self._holder
        chosen = {id(e): e for p in (pages if type(pages) is list else np.asarray(pages).tolist())
                  if (e := holder.get(p)) is not None}
        if chosen:
            gone = list(chosen.values())
            self._drop(gone, evicted=True)
            self.guard.call("eviction policy", self.pool.policy.evicted, [entry_name(e.key.name) for e in gone],
                            [e.rank for e in gone], [e.tick for e in gone])

    def _remove(self, name: tuple) -> None:
        if (entry := self._entries.get(name)) is not None:
            self._drop([entry])

    def _drop(self, entries: list[StoredEntry], evicted: bool = False) -> None:
        """Unindex ``entries`` and release the store's owner on all their pages in one call; evicted ones are spilled
        to the tiers first, while their bytes are intact."""
        spilled = [False] * len(entries)
        if evicted and self.tiers is not None and entries:  # a tier that raises keeps nothing
            spilled = self.guard.call("tier", self.tiers.spill, [
                StoredBytes(e.key, e.tree, e.layout, e.nbytes, e.compute_s, self._bytes.read(e.index)[:e.nbytes])
                for e in entries], default=spilled)
        for e in entries:
            del self._entries[e.key.name]
            for p in e.pages:
                del self._holder[p]
        freed = set(self.pool.release([p for e in entries for p in e.pages]))
        if self.observer is not None and entries:
            self.guard.call("observer", self.observer.encoder_removed, [e.key for e in entries])
        for e, spill in zip(entries, spilled):
            self._count(e.key.modality, bytes_stored=-e.nbytes, evictions=int(evicted),
                        evicted_bytes=e.nbytes if evicted else 0, host_spilled=int(spill),
                        evicted_pages=len(e.pages) if evicted else 0,
                        freed_pages=sum(p in freed for p in e.pages) if evicted else 0)

    def _write(self, pages: list[int], leaves: list[torch.Tensor], layout: tuple) -> torch.Tensor:
        """Copy ``leaves`` into ``pages`` (no lock held; the caller owns the pages alone); returns the page index."""
        index = torch.tensor(pages, dtype=torch.int64, device=self._bytes.device)
        self._bytes.write_entry(index, leaves, layout)
        return index

    def _read(self, entry: StoredEntry):
        """A fresh copy of ``entry``'s value (no lock held; the caller holds an owner on its pages)."""
        buf = self._bytes.read(entry.index)  # new memory: never aliases a page
        return unflatten(entry.tree, tensor_views(buf, entry.layout))

    def _gather(self, entry: StoredEntry):
        """``_read``, then drop the owner ``_lookup`` added (no lock held)."""
        try:
            return self._read(entry)
        finally:
            self._lent.give_back(entry.pages)
