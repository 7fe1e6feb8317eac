"""PrefixCache: the table of live requests over one PrefixIndex: token-verified prefix reuse of KV pages (RFC phase 2).

One PrefixCache per pool (node × label × rank); labels never share pages. Every method that changes state validates
its arguments first and holds ``self._lock`` while it mutates, so an error leaves the cache as it was. The index
(``mmcache.prefix_index``) has no lock of its own and is driven only under this one, so a request's pages and the
index change together. Names are computed outside the lock.

Ownership: the index holds one owner on each indexed page, a live request one on each page it holds. The pool frees
a page when its count reaches 0; this module never frees pages any other way. A live request holds index pages only
as a prefix of its chain (the index's eviction order relies on it): a lookup retains a verified chain prefix, and
every page after it is fresh.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from mmcache.checks import as_int
from mmcache.errors import DuplicateRequest, InvalidRequest, OutOfPages, UnknownRequest
from mmcache.names import Fingerprint, NamedPrompt, as_tokens
from mmcache.pool import PagePool
from mmcache.prefix_index import PrefixIndex
from mmcache.stats import PrefixCacheStats

if TYPE_CHECKING:
    from mmcache.tiers.stack import PageFetch, TierStack

_FINISHED_MEMORY = 65536  # ended ids remembered only to say "already finished" rather than "unknown"


@dataclasses.dataclass(frozen=True, slots=True)
class RequestState:
    """What an engine needs to run a request: its pages in position order and how far they hold KV.

    ``page_indices[i]`` holds tokens ``position_id_start + i·page_size`` onward; ``seq_len`` tokens are held and the
    KV of the first ``computed_tokens`` is written; the first ``matched_tokens`` came from the cache. A windowed
    request keeps its first ``protected_tokens`` and has released the ``released_tokens`` after them: its pages past
    the protected run hold tokens from ``(i·page_size + released_tokens)`` onward.
    """

    rid: Hashable
    page_indices: tuple[int, ...]
    seq_len: int
    position_id_start: int
    matched_tokens: int
    computed_tokens: int
    protected_tokens: int | None = None
    released_tokens: int = 0
    fetch: "PageFetch | None" = None  # tiers: pages copied up from host/store; read none before ``fetch.ready``


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    rid: Hashable
    prompt: NamedPrompt | None  # None: admitted without a prompt (``admit_unnamed``); never matched nor indexed
    salt_id: int
    pages: list[int]            # pages held, in position order from first_page (less the released window)
    seq_len: int
    computed: int
    matched: int
    first_page: int = 0         # while suspended: how many leading (shared) pages were released
    suspended: bool = False
    offloaded: int = 0          # while suspended: own pages handed back after the engine copied them out
    protected: int | None = None  # windowed label: tokens kept at the start; only their full pages are indexed
    released: int = 0           # windowed label: pages released after the protected run
    fetch: "PageFetch | None" = None  # tiers: the copy-up of the pages the lookup found below the device

    def state(self, page_size: int) -> RequestState:
        return RequestState(self.rid, tuple(self.pages), self.seq_len, self.first_page * page_size,
                            self.matched, self.computed, self.protected, self.released * page_size, self.fetch)

    def pages_spanned(self) -> int:
        """Page positions covered, released window included."""
        return self.first_page + self.offloaded + len(self.pages) + self.released


class PrefixCache:
    """Live requests plus an index of full, written pages keyed by page name and confirmed by verifying ids.

    ``evict_batch_pages``: the least number of cached pages one eviction frees (default 1/64 of the pool), so a
    saturated pool evicts in batches instead of once per allocation.
    ``vocab_size``: if given, token ids must lie below it.
    ``index``: the ``PrefixIndex`` of this cache's pool; read it, never drive it (its lock is this cache's).
    """

    def __init__(self, pool: PagePool, fingerprint: Fingerprint, *, evict_batch_pages: int | None = None,
                 vocab_size: int | None = None, tiers: "TierStack | None" = None):
        self.pool = pool
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self._vocab_limit = int(vocab_size) if vocab_size else np.iinfo(np.int32).max
        self.index = PrefixIndex(pool, self.page_size, max(1, evict_batch_pages or pool.num_pages // 64))
        self._live: dict[Hashable, _Request] = {}
        self._ended: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = pool.cache_lock  # one lock for every cache on the pool: eviction crosses them (mmcache.reclaim)
        self.tiers: TierStack | None = None
        if tiers is not None:
            self.attach_tiers(tiers)

    @property
    def vocab_size(self) -> int:
        """Token ids must lie below this (the int32 maximum when no vocabulary size was given)."""
        return self._vocab_limit

    @property
    def evict_batch_pages(self) -> int:
        return self.index.evict_batch_pages

    def attach_tiers(self, tiers: "TierStack | None") -> None:
        """Put ``tiers`` (``mmcache.tiers.TierStack``: host tier and/or shared store) under this cache's pool, or
        take them away (None): evicted pages then move down to them, and lookups continue there."""
        with self._lock:
            self.tiers = tiers
            self.index.spill = tiers.spill if tiers is not None else None

    # ----------------------------------------------------------------- engine contract
    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None) -> RequestState:
        """Start a request: match the longest verified prefix of full pages and retain those pages.

        At most ``(n-1) // page_size`` pages match, so the last prompt token is always computed. The state's
        ``seq_len == computed_tokens == matched_tokens``; ``grow`` adds pages for the rest.
        """
        P = self.page_size
        # Names are checked here, not at finish: a name that cannot be stored must not leave a request live.
        prompt = NamedPrompt.build(self.fingerprint, token_ids, media, salt, names, vocab_limit=self._vocab_limit,
                                   what=f"request {rid!r}")
        tokens, names, limit = prompt.tokens, prompt.names, prompt.matchable
        mids = prompt.media_ids(limit)
        with self._lock:
            if rid in self._live:
                raise DuplicateRequest(f"request {rid!r} is already live")
            salt_id = self.index.salt_id(salt)
            idx = self.index.match(names[:limit], tokens, mids, salt_id)
            self.pool.retain(idx, distinct=True)
            self.index.touch(idx)
            pages, fetch = idx.tolist(), None
            if self.tiers is not None and idx.size < limit and self.tiers.nominates(names[idx.size]):  # tiers
                pages, fetch = self.tiers.extend(self.index, idx, names[:limit], tokens, mids, salt, salt_id)
            k = len(pages) * P
            rec = _Request(rid, prompt, salt_id, pages, k, k, k, fetch=fetch)
            self._live[rid] = rec
            self._ended.pop(rid, None)
            c = self.index.counters
            c["queries"] += 1
            c["hits"] += bool(k)
            c["queried_tokens"] += int(tokens.size)
            c["hit_tokens"] += k
            return rec.state(P)

    def admit_unnamed(self, rid: Hashable) -> RequestState:
        """Start a request whose KV no token ids describe (e.g. a label fed by another model's hidden states): it
        matches nothing, holds fresh pages from position 0 as it grows, and ``finish`` indexes none of them."""
        with self._lock:
            if rid in self._live:
                raise DuplicateRequest(f"request {rid!r} is already live")
            rec = self._live[rid] = _Request(rid, None, 0, [], 0, 0, 0)
            self._ended.pop(rid, None)
            return rec.state(self.page_size)

    def grow(self, rid: Hashable, total_tokens: int) -> RequestState:
        """Hold pages for ``total_tokens``; evicts cold cached pages if needed and raises ``OutOfPages`` only when
        live requests alone need more than the pool (nothing changes then)."""
        total_tokens = as_int(total_tokens, "total_tokens")
        with self._lock:
            rec = self._get(rid, live=True)
            if total_tokens < rec.seq_len:
                raise InvalidRequest(f"request {rid!r}: grow to {total_tokens} tokens is below the "
                                     f"{rec.seq_len} it already holds")
            need = -(-total_tokens // self.page_size) - rec.pages_spanned()
            if need > 0:
                self.index.make_room(need)
                rec.pages += self.pool.alloc(need)
            rec.seq_len = total_tokens
            return rec.state(self.page_size)

    def mark_computed(self, rid: Hashable, total_tokens: int) -> RequestState:
        """Record that the KV of the first ``total_tokens`` tokens is written (never decreases, never past seq_len)."""
        total_tokens = as_int(total_tokens, "total_tokens")
        with self._lock:
            rec = self._get(rid, live=True)
            if not rec.computed <= total_tokens <= rec.seq_len:
                raise InvalidRequest(f"request {rid!r}: computed tokens must stay within "
                                     f"[{rec.computed}, {rec.seq_len}], got {total_tokens}")
            rec.computed = total_tokens
            return rec.state(self.page_size)

    def state(self, rid: Hashable) -> RequestState:
        with self._lock:
            return self._get(rid).state(self.page_size)

    def finish(self, rid: Hashable, output_ids=()) -> int:
        """Tear a request down: every full, written page of prompt + output moves to the index; the rest is released.

        A page whose name is already indexed with equal verifying ids is not duplicated (the request's copy is
        released and the chain continues from the indexed one); a name held by different ids stops indexing there.
        Returns the number of pages newly indexed.
        """
        with self._lock:
            rec = self._get(rid, live=True)
        out = as_tokens(output_ids, self._vocab_limit)
        written = rec.computed if rec.protected is None else min(rec.computed, rec.protected)  # windowed: the run
        if rec.prompt is None:  # admitted unnamed: nothing to index
            names, page_tokens, mids = [], out[:0].reshape(0, self.page_size), None
        else:
            names, page_tokens, mids = rec.prompt.written_pages(out, written)
        with self._lock:
            if self._live.get(rid) is not rec:
                raise UnknownRequest(f"request {rid!r} ended while finishing")
            adopted = self.index.insert(rec.pages, names, page_tokens, mids, rec.salt_id)
            kept = set(adopted)
            if self.tiers is not None and adopted:  # write-through of newly indexed pages to the shared store
                self.tiers.published(self.pool, rec.pages, adopted, names, page_tokens.reshape(-1), mids,
                                     rec.prompt.salt)
            self.pool.release([p for j, p in enumerate(rec.pages) if j not in kept])  # the rest stay the index's
            self._end(rid)
            return len(kept)

    def abort(self, rid: Hashable) -> None:
        """End a request without indexing anything (its KV may be unusable); all its pages are released."""
        with self._lock:
            rec = self._get(rid)
            self.pool.release(rec.pages)
            self._end(rid)

    def suspend(self, rid: Hashable) -> list[int]:
        """Prepare a request for offload: release its shared pages (they stay resident for their other owners) and
        return the pages it owns exclusively, which it keeps until ``resume`` or ``abort``."""
        with self._lock:
            rec = self._get(rid, live=True)
            if rec.protected is not None or rec.released:
                raise InvalidRequest(f"request {rid!r} is windowed; windowed requests are not suspended")
            shared = self.pool.counts[rec.pages] > 1
            j0 = int(np.argmin(shared)) if not shared.all() else len(rec.pages)
            assert not shared[j0:].any(), "shared pages of a live request form a prefix"
            self.pool.release(rec.pages[:j0])
            rec.pages, rec.first_page, rec.suspended = rec.pages[j0:], j0, True
            return list(rec.pages)

    def resume(self, rid: Hashable) -> RequestState:
        """Bring a suspended request back: its released prefix comes back through a normal verified lookup; pages
        the lookup cannot supply are allocated and ``computed_tokens`` drops to what is held contiguously."""
        P = self.page_size
        with self._lock:
            rec = self._get(rid)
            if not rec.suspended:
                raise InvalidRequest(f"request {rid!r} is not suspended")
            j0 = rec.first_page
            idx = (np.empty(0, dtype=np.int64) if rec.prompt is None  # unnamed: shares nothing, so j0 == 0
                   else self.index.match(rec.prompt.names[:j0], rec.prompt.tokens, rec.prompt.media_ids(j0),
                                         rec.salt_id))
            self.pool.retain(idx, distinct=True)
            gap = j0 - idx.size
            try:
                self.index.make_room(gap + rec.offloaded)
            except OutOfPages:
                self.pool.release(idx)
                raise
            self.index.touch(idx)
            fresh = self.pool.alloc(gap + rec.offloaded)
            rec.pages = idx.tolist() + fresh + rec.pages  # the gap, then the offloaded positions, then kept pages
            rec.first_page, rec.suspended, rec.offloaded = 0, False, 0
            rec.matched = idx.size * P
            if gap:
                rec.computed = min(rec.computed, rec.matched)
            return rec.state(P)

    def release_suspended(self, rid: Hashable) -> int:
        """The engine has copied a suspended request's own pages out (offload): release them. ``resume`` then gives
        fresh pages at the same positions, into which the engine copies the data back. Returns the pages released."""
        with self._lock:
            rec = self._get(rid)
            if not rec.suspended:
                raise InvalidRequest(f"request {rid!r} is not suspended")
            self.pool.release(rec.pages)
            rec.offloaded += len(rec.pages)
            n, rec.pages = len(rec.pages), []
            return n

    def protect_prefix(self, rid: Hashable, tokens: int) -> RequestState:
        """Make the request windowed: its first ``tokens`` are never released, and at teardown only their full pages
        are indexed (the KV after a released window is not what a fresh prefill would write)."""
        tokens = as_int(tokens, "tokens")
        with self._lock:
            rec = self._get(rid, live=True)
            if not 0 <= tokens <= rec.seq_len or rec.released and tokens != rec.protected:
                raise InvalidRequest(f"request {rid!r}: cannot protect {tokens} tokens (holds {rec.seq_len}, "
                                     f"released {rec.released} pages)")
            rec.protected = tokens
            return rec.state(self.page_size)

    def release_oldest(self, rid: Hashable, pages: int) -> RequestState:
        """Release the ``pages`` oldest pages after the protected run (sliding window). Each goes through the
        counted release: a page the index or another request also holds is decremented, never freed under them.
        The page being appended into is never released."""
        P = self.page_size
        pages = as_int(pages, "pages")
        with self._lock:
            rec = self._get(rid, live=True)
            keep = -(-(rec.protected or 0) // P)
            tail = max(0, (rec.seq_len - 1) // P - rec.released)  # held-list index of the page appended into
            written = rec.computed // P - rec.released  # held-list index of the first page not fully written
            if pages < 0 or keep + pages > min(tail, written):
                raise InvalidRequest(f"request {rid!r}: cannot release {pages} page(s); "
                                     f"{max(0, min(tail, written) - keep)} written page(s) lie between the protected "
                                     f"run and the tail page")
            if rec.protected is None:
                rec.protected = 0
            self.pool.release(rec.pages[keep:keep + pages])
            del rec.pages[keep:keep + pages]
            rec.released += pages
            return rec.state(P)

    # ----------------------------------------------------------------- TP agreement hook (mmcache.tp)
    def trim_match(self, rid: Hashable, pages: int) -> RequestState:
        """Keep only the first ``pages`` matched pages of a request that has not grown past its match (just
        admitted): the rest are released (they stay the index's) and the counters count only what is kept."""
        pages = as_int(pages, "pages")
        P = self.page_size
        with self._lock:
            rec = self._get(rid, live=True)
            k = rec.matched // P
            if rec.seq_len != rec.matched or not 0 <= pages <= k:
                raise InvalidRequest(f"request {rid!r}: can trim its match of {k} page(s) to [0, {k}] only before "
                                     f"it grows, got {pages}")
            if pages < k:
                self.pool.release(rec.pages[pages:])
                del rec.pages[pages:]
                rec.seq_len = rec.computed = rec.matched = pages * P
                self.index.counters["hit_tokens"] -= (k - pages) * P
                self.index.counters["hits"] -= pages == 0
            return rec.state(P)

    def clear(self) -> int:
        """Drop every index entry (live requests keep their pages); returns how many entries were dropped."""
        with self._lock:
            return self.index.clear()

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            counts = self.pool.counts
            return PrefixCacheStats(**self.index.counters, pages_free=self.pool.num_free,
                                    pages_live=int(np.count_nonzero(counts > self.index.indexed)),
                                    pages_cached=len(self.index), requests_live=len(self._live))

    # ----------------------------------------------------------------- internals (callers hold the lock)
    def _get(self, rid: Hashable, live: bool = False) -> _Request:
        rec = self._live.get(rid)
        if rec is None:
            why = "has already ended" if rid in self._ended else "was never admitted"
            raise UnknownRequest(f"request {rid!r} {why}")
        if live and rec.suspended:
            raise InvalidRequest(f"request {rid!r} is suspended; resume it first")
        return rec

    def _end(self, rid: Hashable) -> None:
        del self._live[rid]
        self._ended[rid] = None
        if len(self._ended) > _FINISHED_MEMORY:
            self._ended.popitem(last=False)
