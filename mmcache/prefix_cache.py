"""PrefixCache: the table of live requests over one ``PrefixLifecycle``: token-verified prefix reuse of KV pages.

One PrefixCache per pool (node × label × rank); labels never share pages. Every method that changes state validates
its arguments first and holds the pool's ``cache_lock`` while it mutates, so an error leaves the cache as it was.
Names are computed outside the lock. Match, page taking, commit-as-written, release and stats are the lifecycle's
(``mmcache.lifecycle``, shared with M*'s KV resource); this module keeps only the live requests and their pages.

Ownership: a live request holds one owner on each page it lists, the index one on each indexed page. The pool frees a
page when its count reaches 0; this module never frees pages any other way.

Commit as written: ``mark_computed`` indexes every full page whose KV is now written (with ``output_ids``, generated
pages too), so a request admitted meanwhile shares them. ``finish`` commits what is left and releases the request's
pages (the index keeps its own); ``abort`` releases without committing more, and ``abort(rid, discard=True)`` also
unindexes what the request committed, for KV that turned out bad.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, NamedTuple, Sequence

import numpy as np

from mmcache.checks import as_int, require
from mmcache.errors import DuplicateRequest, InvalidRequest, OutOfPages, RefusedByGroup, UnknownRequest
from mmcache.index_types import IndexObserver
from mmcache.lifecycle import Claim, GroupAgreement, LowerTier, PrefixLifecycle, Readiness, Written
from mmcache.names import Fingerprint, as_tokens
from mmcache.pool import PagePool
from mmcache.stats import PrefixCacheStats

_NO_TOKENS = np.zeros(0, dtype=np.int32)
_FINISHED_MEMORY = 65536  # ended ids remembered only to say "already finished" rather than "unknown"


class RequestState(NamedTuple):
    """What an engine needs to run a request: its pages in position order and how far they hold KV.

    ``page_indices[i]`` holds tokens ``position_id_start + i·page_size`` onward; ``seq_len`` tokens are held and the
    KV of the first ``computed_tokens`` is written; the first ``matched_tokens`` came from the cache. A windowed
    request keeps its first ``protected_tokens`` and has released the ``released_tokens`` after them: its pages past
    the protected run hold tokens from ``(i·page_size + released_tokens)`` onward.

    An immutable snapshot, a NamedTuple rather than a frozen dataclass: one is built on every grow, which an engine
    calls between forwards, and a frozen dataclass sets each of its fields through ``object.__setattr__`` (a sixth
    to a quarter of a cold grow).
    """

    rid: Hashable
    page_indices: tuple[int, ...]
    seq_len: int
    position_id_start: int
    matched_tokens: int
    computed_tokens: int
    protected_tokens: int | None = None
    released_tokens: int = 0
    fetch: Readiness | None = None  # pages copied up from a lower tier: read none before ``fetch.ready``


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    rid: Hashable
    claim: Claim | None         # None: admitted without a prompt (``admit_unnamed``); never matched nor indexed
    pages: list[int]            # pages held, in position order from first_page (less the released window)
    seq_len: int
    computed: int
    matched: int
    first_page: int = 0         # while suspended: how many leading (shared) pages were released
    suspended: bool = False
    offloaded: int = 0          # while suspended: own pages handed back after the engine copied them out
    protected: int | None = None  # windowed label: tokens kept at the start; only their full pages are indexed
    released: int = 0           # windowed label: pages released after the protected run
    fetch: Readiness | None = None  # the copy-up of the pages the lookup found below the device
    generated: np.ndarray = dataclasses.field(default_factory=lambda: _NO_TOKENS)  # latest output ids (resume's)

    def state(self, page_size: int) -> RequestState:
        return RequestState(self.rid, tuple(self.pages), self.seq_len, self.first_page * page_size,
                            self.matched, self.computed, self.protected, self.released * page_size, self.fetch)

    def pages_spanned(self) -> int:
        """Page positions covered, released window included."""
        return self.first_page + self.offloaded + len(self.pages) + self.released


class PrefixCache:
    """Live requests plus the lifecycle of their prefix: full, written pages indexed by page name as they are written,
    confirmed by verifying ids on every match.

    ``evict_batch_pages``: the least number of cached pages one eviction frees (default 1/64 of the pool), so a
    saturated pool evicts in batches instead of once per allocation. ``vocab_size``: if given, token ids must lie
    below it. ``tiers``: a ``LowerTier`` (``mmcache.tiers.TierStack``) under the pool: evicted pages move down to it
    and lookups continue there. ``agreement``: a ``GroupAgreement`` (``mmcache.tp.TPAgreement``) that every admission
    agrees with. ``observer``: an ``IndexObserver`` (``mmcache.kv_events.KVEventPublisher``) told of every page
    indexed and dropped. ``page_seconds``: what a hit on one page saves (its prefill time), the cost a policy that
    weighs costs (``dip-costs``, ``lfu``) weighs against the other caches' entries (an encoder output's forward time
    per page); None: unknown, as the pool's average entry. ``index``: the ``PrefixIndex``; read it, never drive it
    (its lock is the pool's).
    """

    def __init__(self, pool: PagePool, fingerprint: Fingerprint, *, evict_batch_pages: int | None = None,
                 vocab_size: int | None = None, tiers: LowerTier | None = None,
                 agreement: GroupAgreement | None = None, observer: IndexObserver | None = None,
                 page_seconds: float | None = None):
        self.pool = pool
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self.lifecycle = PrefixLifecycle(pool, fingerprint, evict_batch_pages=evict_batch_pages,
                                         vocab_size=vocab_size, tiers=tiers, agreement=agreement, observer=observer,
                                         page_seconds=page_seconds)
        self.index = self.lifecycle.index
        self._live: dict[Hashable, _Request] = {}
        self._ended: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = pool.cache_lock  # one lock for every cache on the pool: eviction crosses them (mmcache.reclaim)

    @property
    def vocab_size(self) -> int:
        """Token ids must lie below this (the int32 maximum when no vocabulary size was given)."""
        return self.lifecycle.vocab_size

    @property
    def evict_batch_pages(self) -> int:
        return self.index.evict_batch_pages

    @property
    def tiers(self) -> LowerTier | None:
        return self.lifecycle.tiers

    # ----------------------------------------------------------------- engine contract
    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None, reserve_tokens: int | None = None) -> RequestState:
        """Start a request: match the longest verified prefix of full pages and retain those pages.

        At most ``(n-1) // page_size`` pages match, so the last prompt token is always computed. The state's
        ``seq_len == computed_tokens == matched_tokens``; ``grow`` adds pages for the rest. Under a group agreement
        every rank keeps the group's minimum; with ``reserve_tokens`` every rank also holds pages for that many tokens,
        or none is admitted (the failing rank raises its own error, the others ``RefusedByGroup``).
        """
        life = self.lifecycle
        try:  # names are checked here: a name that cannot be stored must not leave a request live
            prompt = life.name(token_ids, media, salt, names, what=f"request {rid!r}")
            with self._lock:
                self._not_live(rid)
        except Exception:
            life.refuse()
            raise
        claim, match = life.match(prompt)
        with self._lock:
            if rid in self._live:  # admitted concurrently under the same id while this one matched
                life.release(match.pages)
                self._not_live(rid)
            k = len(match.pages) * self.page_size
            rec = _Request(rid, claim, list(match.pages), k, k, k, fetch=match.fetch)
            self._live[rid] = rec
            self._ended.pop(rid, None)
            state = rec.state(self.page_size)
        if reserve_tokens is None:
            return state
        error = None
        try:
            state = self.grow(rid, reserve_tokens)
        except Exception as e:  # OutOfPages, or a bad length: the group undoes the admission either way
            error = e
        if not life.agree(error is None):
            self.abort(rid)
            raise error if error is not None else RefusedByGroup(
                f"request {rid!r}: another rank could not hold {reserve_tokens} tokens")
        return state

    def admit_unnamed(self, rid: Hashable) -> RequestState:
        """Start a request whose KV no token ids describe (e.g. a label fed by another model's hidden states): it
        matches nothing, holds fresh pages from position 0 as it grows, and none of them is ever indexed."""
        with self._lock:
            self._not_live(rid)
            rec = self._live[rid] = _Request(rid, None, [], 0, 0, 0)
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
                rec.pages += self.lifecycle.take(need)
            rec.seq_len = total_tokens
            return rec.state(self.page_size)

    def mark_computed(self, rid: Hashable, total_tokens: int, output_ids=None) -> RequestState:
        """Record that the KV of the first ``total_tokens`` tokens is written (never decreases, never past seq_len),
        and index the full pages that are now written: the prompt's, and with ``output_ids`` (every id generated so
        far) the generated pages too. A windowed request indexes only its protected run."""
        with self._lock:
            self.mark_computed_many([(rid, total_tokens, output_ids)])
            return self._live[rid].state(self.page_size)

    def mark_computed_many(self, marks: Sequence[tuple[Hashable, int, object]]) -> None:
        """``mark_computed`` of several requests, each ``(rid, total_tokens, output_ids)``, in one lock hold and one
        index update (``PrefixLifecycle.commit_many``). Every mark is checked before anything changes; a request
        appears at most once."""
        with self._lock:
            checked = []
            for rid, total_tokens, output_ids in marks:
                rec = self._get(rid, live=True)
                checked.append((rec, self._computed(rec, total_tokens), self._generated(rec, output_ids)))
            if len({id(rec) for rec, _, _ in checked}) < len(checked):
                raise InvalidRequest("mark_computed_many: a request is marked more than once")
            for rec, total_tokens, generated in checked:
                rec.computed = total_tokens
                if generated.size:  # every id generated so far: covers what earlier ones named
                    rec.generated = generated
            self._commit([(rec, generated) for rec, _, generated in checked])

    def state(self, rid: Hashable) -> RequestState:
        with self._lock:
            return self._get(rid).state(self.page_size)

    def finish(self, rid: Hashable, output_ids=(), computed_tokens: int | None = None) -> int:
        """Tear a request down: commit every full, written page of prompt + ``output_ids`` not yet indexed, then
        release the request's pages (indexed ones stay the index's). Returns the pages the request indexed over its
        life. A page whose name another request indexed first with equal verifying ids is not duplicated; a name
        held by different ids stops indexing there. ``computed_tokens``: first record that the KV of that many tokens
        is written, as ``mark_computed`` does (one call for a request's last pages and its teardown)."""
        with self._lock:
            rec = self._get(rid, live=True)
            computed = rec.computed if computed_tokens is None else self._computed(rec, computed_tokens)
            generated = self._generated(rec, output_ids)
            rec.computed = computed
            self._commit([(rec, generated)])
            if rec.claim is not None:
                self.lifecycle.touch(rec.claim)
            self.lifecycle.release(rec.pages)
            self._end(rid)
            return len(rec.claim.adopted) if rec.claim is not None else 0

    def abort(self, rid: Hashable, discard: bool = False) -> None:
        """End a request without indexing anything more; all its pages are released. Pages it already committed stay
        indexed (their KV was written), unless ``discard``: then they leave the index too (its KV may be bad)."""
        with self._lock:
            rec = self._get(rid)
            if discard and rec.claim is not None:
                self.lifecycle.discard(rec.claim)
            elif rec.claim is not None:
                self.lifecycle.touch(rec.claim)
            self.lifecycle.release(rec.pages)
            self._end(rid)

    def suspend(self, rid: Hashable) -> list[int]:
        """Prepare a request for offload: release the leading run of its pages that other owners also hold (they stay
        resident for them; ``resume`` looks them up again) and return the rest, from its first page it owns alone,
        which it keeps until ``resume`` or ``abort``. A page after that one may be shared too (committed into the
        index after the request's own copy of an equal page): it is copied out with the rest, and its other owners
        keep it resident."""
        with self._lock:
            rec = self._get(rid, live=True)
            if rec.protected is not None or rec.released:
                raise InvalidRequest(f"request {rid!r} is windowed; windowed requests are not suspended")
            # The leading run of pages another owner also holds (matched, or committed into the index) stays resident
            # for them; the rest is copied out, including a committed page after a copy of the request's own.
            shared = self.pool.counts[rec.pages] > 1
            j0 = int(np.argmin(shared)) if not shared.all() else len(rec.pages)
            # used until now: ranked as recent as they are, or lru would drop them before older cached pages
            indexed = self.index.indexed[rec.pages[:j0]]
            k = int(np.argmin(indexed)) if not indexed.all() else j0
            if k:
                self.index.touch(rec.pages[:k])
            self.lifecycle.release(rec.pages[:j0])
            rec.pages, rec.first_page, rec.suspended = rec.pages[j0:], j0, True
            return list(rec.pages)

    def resume(self, rid: Hashable) -> RequestState:
        """Bring a suspended request back: its released prefix (prompt pages, then the generated pages it committed)
        comes back through a verified lookup; pages the lookup cannot supply are allocated and ``computed_tokens``
        drops to what is held contiguously."""
        P = self.page_size
        with self._lock:
            rec = self._get(rid)
            if not rec.suspended:
                raise InvalidRequest(f"request {rid!r} is not suspended")
            j0 = rec.first_page
            idx = [] if rec.claim is None else self.lifecycle.rematch(rec.claim, j0, rec.generated)  # unnamed: none
            gap = j0 - len(idx)
            try:
                fresh = self.lifecycle.take(gap + rec.offloaded)
            except OutOfPages:
                self.lifecycle.release(idx)
                raise
            rec.pages = idx + fresh + rec.pages  # the gap, then the offloaded positions, then kept pages
            rec.first_page, rec.suspended, rec.offloaded = 0, False, 0
            rec.matched = len(idx) * P
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

    def clear(self) -> int:
        """Drop every index entry (live requests keep their pages); returns how many entries were dropped."""
        with self._lock:
            return self.index.clear()

    def check(self) -> None:
        """``BrokenInvariant`` naming the first rule that does not hold: the pool's (``PagePool.check``), the index's
        (``PrefixIndex.check``), and the owner count of every page: the index's owner, one per live request that
        lists it, and what every other cache on the pool holds (its ``owners()``), exactly."""
        with self._lock:
            self.pool.check()
            self.index.check()
            held = self.index.owners()
            for rec in self._live.values():
                np.add.at(held, np.asarray(rec.pages, dtype=np.int64), 1)
            for cache in self.pool.evictables:
                if cache is not self.index:
                    held += cache.owners()
            require((self.pool.counts == held).all(), "every page's owner count is the owners that hold it")

    def stats(self) -> PrefixCacheStats:
        """The lifecycle's counters and the pool now; ``pages_live`` counts the distinct pages live requests hold."""
        with self._lock:
            held = [rec.pages for rec in self._live.values() if rec.pages]
            live = int(np.unique(np.concatenate(held)).size) if held else 0
            return self.lifecycle.stats(live, len(self._live))

    # ----------------------------------------------------------------- internals (callers hold the lock)
    def _not_live(self, rid: Hashable) -> None:
        if rid in self._live:
            raise DuplicateRequest(f"request {rid!r} is already live")

    def _computed(self, rec: _Request, total_tokens) -> int:
        """``total_tokens`` checked as a new computed length of ``rec`` (never decreases, never past seq_len)."""
        total_tokens = as_int(total_tokens, "total_tokens")
        if not rec.computed <= total_tokens <= rec.seq_len:
            raise InvalidRequest(f"request {rec.rid!r}: computed tokens must stay within "
                                 f"[{rec.computed}, {rec.seq_len}], got {total_tokens}")
        return total_tokens

    def _generated(self, rec: _Request, output_ids) -> np.ndarray:
        """``output_ids`` checked as token ids (before any state changes); an unnamed request's name nothing."""
        if output_ids is None or (type(output_ids) in (tuple, list) and not output_ids):
            return _NO_TOKENS
        out = as_tokens(output_ids, self.lifecycle.vocab_size)
        return _NO_TOKENS if rec.claim is None else out

    def _commit(self, recs: Sequence[tuple[_Request, np.ndarray]]) -> None:
        """Index what each ``(request, generated ids)`` has written and named, in one index update; a windowed
        request only within its protected run, an unnamed one nothing."""
        self.lifecycle.commit_many([
            Written(rec.claim, rec.pages, rec.computed if rec.protected is None else min(rec.computed, rec.protected),
                    generated) for rec, generated in recs if rec.claim is not None])

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
