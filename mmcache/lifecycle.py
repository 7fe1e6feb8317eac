"""PrefixLifecycle: the one prefix lifecycle every request table drives, per label on a pool.

A request table (``PrefixCache``'s live table, M*'s KV resource) keeps its own requests and pages; for the cached
prefix it calls one lifecycle per label:

- ``name`` a prompt (no lock: do it before entering the table);
- ``match`` it: the longest verified chain prefix on the device, continued through the ``LowerTier`` (host tier,
  shared store), agreed over the ``GroupAgreement`` (the TP minimum), retained for the request and counted; the
  ``Claim`` it returns is the request's standing with the index;
- ``take`` fresh pages (evicting cold cached pages of the pool first, ``mmcache.reclaim``);
- ``commit`` pages as their KV is written: every full page the request's names cover is indexed then, so another
  request with the same prefix shares it while the first still runs (prompt pages, and generated pages as they fill);
- ``touch`` its chain when it is done with it (one tick for the whole chain: pages indexed while it ran took their
  parent's), then ``release`` the request's pages (the index keeps its own owners), or ``discard`` what it indexed
  when its KV turned out bad;
- ``stats``.

Ownership: the table holds one owner per page it lists for a request, the index one per indexed page; the pool frees
a page when its count reaches 0. Every method that reads or changes the index takes the pool's ``cache_lock`` (an
RLock, so a table may hold it around several calls); the group agreement and the lower tier's reads (a shared
store's, bounded by its deadline) run outside it.
"""

from __future__ import annotations

import array
import dataclasses
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from mmcache.checks import as_cost
from mmcache.errors import InvalidRequest, RefusedByGroup
from mmcache.index_types import ChainRun, IndexObserver
from mmcache.names import Fingerprint, NamedPrompt, chain, chain_children, media_by_page, media_ids, token_bytes
from mmcache.pool import PagePool
from mmcache.prefix_index import PrefixIndex
from mmcache.reclaim import take
from mmcache.stats import PrefixCacheStats

_NO_TOKENS = np.zeros(0, dtype=np.int32)


# ----------------------------------------------------------------- the interfaces the lifecycle declares
class Readiness(Protocol):
    """Pages copied up from a lower tier: the request reads none of them before ``ready`` (or ``wait()``)."""

    @property
    def ready(self) -> bool: ...

    def wait(self) -> None: ...


class LowerTier(Protocol):
    """Storage below the device pool (``mmcache.tiers.TierStack``). A tier's failure is a miss: nothing raises."""

    def nominates(self, name: int) -> bool:
        """Whether a lookup that missed on the device at the page named ``name`` should ask the tier."""

    def extend(self, index: PrefixIndex, idx: np.ndarray, names: Sequence[int], tokens: np.ndarray, mids: np.ndarray,
               salt: bytes, salt_id: int, media: dict[int, bytes] | None = None) -> tuple[list[int], Readiness | None]:
        """Continue the device match ``idx`` through the tier: the request's pages (``idx``, then fresh pages holding
        verified tier hits, indexed and owned by the request too) and their readiness (None when nothing was hit).
        Called without the pool's ``cache_lock`` (the request holds ``idx``'s owners): the tier takes it around what
        reads or changes the index, and adopts nothing under a chain that left the index meanwhile. ``media``: the
        prompt's media blobs by page, passed on to ``PrefixIndex.insert`` for its observer."""

    def spill(self, index: PrefixIndex, pages: np.ndarray) -> None:
        """``index`` evicts ``pages``, whose bytes and verifying ids are still intact: take what the tier keeps."""

    def publish(self, pool: PagePool, pages: Sequence[int], positions: Sequence[int], names: Sequence[int],
                seq: np.ndarray, mids: np.ndarray, salt: bytes) -> None:
        """Pages ``pages[j]`` (chain position ``j`` for ``j`` in ``positions``) were just indexed: share them."""


class GroupAgreement(Protocol):
    """Ranks that must agree on a matched length (``mmcache.tp.TPAgreement``: MIN over the TP process group). Every
    rank calls ``agree`` for the same requests in the same order."""

    def agree(self, pages: int, ok: bool) -> tuple[int, bool]:
        """The group's minimum of ``pages`` and whether every rank is ``ok``."""


# ----------------------------------------------------------------- a request's standing with the index
@dataclasses.dataclass(slots=True, eq=False)
class Claim:
    """One (request, label)'s named prompt and how far its chain is indexed.

    Invariant: positions ``0..indexed-1`` of the request's chain are indexed as ``chain`` (page ids; a position where
    another request indexed an equal page first names that page, not the request's own copy), the last of them
    with serial ``parent_serial`` at the time. ``open`` is False once a collision or a lost parent stopped indexing:
    nothing of this request is indexed past that point. ``adopted`` are the pages the index took from the request,
    ``adopted_serials`` the serial of each one's indexing: a page whose serial changed since left the index, and its
    id may stand for another request's page now.
    """

    prompt: NamedPrompt
    salt_id: int
    matched: int                                        # pages matched at admission (a prefix of ``chain``)
    chain: list[int] = dataclasses.field(default_factory=list)
    parent_serial: int = 0
    open: bool = True
    adopted: list[int] = dataclasses.field(default_factory=list)
    adopted_serials: list[int] = dataclasses.field(default_factory=list)
    names: list[int] = dataclasses.field(default_factory=list)   # its own: the prompt's, then generated pages'
    media: dict[int, bytes] = dataclasses.field(default_factory=dict)  # page -> media blob: the prompt's, then walks'

    @property
    def indexed(self) -> int:
        return len(self.chain)

    def add_media(self, marks: Sequence, page_size: int) -> None:
        """Media marks ``(offset, digest)`` of positions fed after the prompt (a walk of embeddings a media item
        describes), at or after every position already named: their digests enter the names of their pages.
        ``InvalidRequest`` for a malformed mark, before anything changes."""
        if not marks:
            return
        first = min(int(o) for o, _ in marks)
        if first < len(self.names) * page_size:
            raise InvalidRequest(f"media marks at {first} fall on pages already named")
        for page, blob in media_by_page(marks, page_size, 1 << 62).items():
            self.media[page] = self.media.get(page, b"") + blob  # later offsets: the page's blob stays sorted


class Written(NamedTuple):
    """One request's pages to index as written (``PrefixLifecycle.commit_many``): its claim, its pages in chain
    order, how many leading tokens their KV holds, its int32 ids after the prompt, and how many leading positions its
    names cover (None: prompt + ``generated``)."""

    claim: Claim
    pages: Sequence[int]
    written_tokens: int
    generated: np.ndarray = _NO_TOKENS
    tokens_named: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    """What ``match`` retained for a request: its first pages in position order and their readiness (pages copied up
    from a lower tier; None when all were on the device)."""

    pages: list[int]
    fetch: Readiness | None


class PrefixLifecycle:
    """Match, take, commit, release and stats for one label's prefix index on ``pool`` (see the module docstring).

    ``evict_batch_pages``: the least cached pages one eviction frees (default 1/64 of the pool). ``vocab_size``: token
    ids must lie below it. ``tiers``: a ``LowerTier`` under the pool. ``agreement``: a ``GroupAgreement`` over ranks.
    ``observer``: an ``IndexObserver`` told of every page indexed and dropped (``mmcache.kv_events``).
    """

    def __init__(self, pool: PagePool, fingerprint: Fingerprint, *, evict_batch_pages: int | None = None,
                 vocab_size: int | None = None, tiers: LowerTier | None = None,
                 agreement: GroupAgreement | None = None, observer: IndexObserver | None = None,
                 page_seconds: float | None = None):
        page_seconds = as_cost(page_seconds, "page_seconds")  # before the index joins the pool
        self.pool = pool
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self.vocab_size = int(vocab_size) if vocab_size else np.iinfo(np.int32).max
        self.tiers = tiers
        self.agreement = agreement
        self.lock = pool.cache_lock
        self.index = PrefixIndex(pool, self.page_size, max(1, evict_batch_pages or pool.num_pages // 64),
                                 spill=tiers.spill if tiers is not None else None, observer=observer,
                                 page_seconds=page_seconds)

    # ----------------------------------------------------------------- admission
    def name(self, token_ids, media: Sequence = (), salt: bytes = b"", names: Sequence[int] | None = None,
             what: str = "request") -> NamedPrompt:
        """The prompt checked and named (``InvalidRequest`` naming ``what``); takes no lock."""
        return NamedPrompt.build(self.fingerprint, token_ids, media, salt, names, vocab_limit=self.vocab_size,
                                 what=what)

    def match(self, prompt: NamedPrompt, rows_left: int = 1,
              servable: Callable[[np.ndarray], int] | None = None) -> tuple[Claim, Match]:
        """Retain the longest verified prefix of ``prompt``'s full pages that leaves at least ``rows_left`` tokens to
        compute (never the page of its last token): device pages, then pages a lower tier verified and copied up;
        under a group agreement, the group's minimum, so no rank keeps a page another did not match. Counted once,
        after the agreement, when the pool's policy hears of the lookup too. ``RefusedByGroup`` (nothing held) when
        another rank could not admit the request.
        ``servable(pages)``: how many leading device pages of the verified prefix this request may be served (the
        match stops there, and no lower tier continues it)."""
        limit = prompt.matchable(rows_left)
        mids = prompt.media_ids(limit)
        with self.lock:
            salt_id = self.index.salt_id(prompt.salt)
            pages = self.index.match(prompt.names[:limit], prompt.tokens, mids, salt_id)
            n = servable(np.asarray(pages, dtype=np.int64)) if servable is not None and pages else len(pages)
            stopped, pages, fetch = n < len(pages), pages[:n], None
            found = n  # pages this pool held (a lower tier's hits are copied into fresh ones)
            if pages:  # lists: counted and touched one by one (the scalar paths); a new prompt holds nothing
                self.pool.retain(pages, distinct=True)
                self.index.touch(pages, rekey=False)
            guard = self.index.guard  # a tier that raises is a miss (mmcache.guard)
            lower = (self.tiers is not None and not stopped and len(pages) < limit
                     and guard.call("lower tier", self.tiers.nominates, prompt.names[len(pages)], default=False))
        if lower:  # outside the lock: a store read may take up to its deadline (the tier locks what it mutates)
            pages, fetch = guard.call("lower tier", self.tiers.extend, self.index, np.asarray(pages, dtype=np.int64),
                                      prompt.names[:limit], prompt.tokens, mids, prompt.salt, salt_id, prompt.media,
                                      default=(pages, None))
        if self.agreement is not None:
            agreed, all_ok = self.agreement.agree(len(pages), True)
            if not all_ok:
                self.pool.release(pages)
                raise RefusedByGroup("another rank could not admit this request")
            if agreed < len(pages):
                self.pool.release(pages[agreed:])
                pages = pages[:agreed]
        with self.lock:
            self.index.looked_up(prompt.names[:limit], min(found, len(pages)))
            c = self.index.counters
            c["queries"] += 1
            c["hits"] += bool(pages)
            c["queried_tokens"] += int(prompt.tokens.size)
            c["hit_tokens"] += len(pages) * self.page_size
            claim = Claim(prompt, salt_id, len(pages), list(pages), self.index.serial(pages[-1]) if pages else 0,
                          names=list(prompt.names), media=dict(prompt.media))
        return claim, Match(pages, fetch)

    def refuse(self) -> None:
        """This rank cannot admit the request it was about to match (bad input, a duplicate): tell the group, whose
        other ranks then raise ``RefusedByGroup`` from ``match``. A no-op without a group."""
        if self.agreement is not None:
            self.agreement.agree(0, False)

    def agree(self, ok: bool) -> bool:
        """Whether every rank of the group is ``ok`` (True without a group): for a step that all ranks take or none."""
        return self.agreement is None or self.agreement.agree(0, ok)[1]

    def rematch(self, claim: Claim, pages: int, generated: np.ndarray = _NO_TOKENS) -> list[int]:
        """The verified part of the first ``pages`` pages of ``claim``'s chain, retained (a suspended request coming
        back); not counted as a query. The chain runs through ``claim.names``, the prompt's pages' then the generated
        pages' it committed, whose ids ``generated`` holds (int32, every id after the prompt); each page is verified
        against them, as at admission."""
        tokens = np.concatenate((claim.prompt.tokens, generated)) if generated.size else claim.prompt.tokens
        pages = min(pages, len(claim.names), tokens.size // self.page_size)
        with self.lock:
            idx = self.index.match(claim.names[:pages], tokens, media_ids(claim.media, range(pages)), claim.salt_id)
            self.pool.retain(idx, distinct=True)
            self.index.touch(idx, rekey=False)
            return idx

    def extend_match(self, claim: Claim, tokens: np.ndarray, rows_left: int = 1, written: int = 0,
                     servable: Callable[[np.ndarray], int] | None = None) -> list[int]:
        """Continue ``claim``'s match into ``tokens`` (int32 ids of the positions right after the chain, whose names
        are not yet computed; media marks of theirs added to ``claim`` first): the verified cached pages that follow,
        leaving at least ``rows_left`` of ``tokens`` to compute (never the page of the last token), retained, agreed
        over the group and counted as hit tokens, less the ``written`` leading ids the request computed already (a
        part-filled page of its own that the first page found stands in for); ``claim``'s chain and names grow by
        them. Only with every earlier position indexed (``len(claim.names) == claim.indexed``); else nothing.
        ``servable``: as for ``match``."""
        P = self.page_size
        m = (tokens.size - max(1, rows_left)) // P
        if not claim.open or m <= 0 or len(claim.names) != claim.indexed:
            return []
        with self.lock:
            if claim.indexed and self.index.serial(claim.chain[-1]) != claim.parent_serial:
                return []
            start = claim.indexed
            names = chain(claim.names[-1] if start else claim.prompt.root, tokens[:m * P], P, start, claim.media)
            idx = self.index.match(names, tokens, media_ids(claim.media, range(start, start + m)), claim.salt_id,
                                   claim.chain[-1] if start else -1)
            if servable is not None and idx:
                idx = idx[:servable(np.asarray(idx, dtype=np.int64))]
            self.pool.retain(idx, distinct=True)
            if idx:  # the chain before them too: one tick for a whole prefix keeps ticks from rising along it
                self.index.touch(claim.chain + idx, rekey=False)
            pages = idx
        if self.agreement is not None:
            agreed, _ = self.agreement.agree(len(pages), True)
            if agreed < len(pages):
                self.pool.release(pages[agreed:])
                pages = pages[:agreed]
        with self.lock:
            if pages:
                claim.chain += pages
                claim.names += names[:len(pages)]
                claim.parent_serial = self.index.serial(pages[-1])
                self.index.counters["hit_tokens"] += len(pages) * P - written
            return pages

    # ----------------------------------------------------------------- pages
    def take(self, n: int) -> list[int]:
        """``n`` fresh pages with one owner each, evicting the pool's coldest cached pages first (one batch);
        ``OutOfPages`` and nothing changed when live owners alone hold too much."""
        return take(self.pool, n, self.index.evict_batch_pages, self.index.counters)

    def release(self, pages) -> list[int]:
        """Drop one owner from each of a request's pages (the table's; a request lists a page once); returns the
        pages freed."""
        return self.pool.release(pages, distinct=True)

    # ----------------------------------------------------------------- commit as pages fill
    def commit(self, claim: Claim, pages: Sequence[int], written_tokens: int, generated: np.ndarray = _NO_TOKENS,
               tokens_named: int | None = None) -> int:
        """``commit_many`` of one request: the pages newly indexed."""
        return self.commit_many([Written(claim, pages, written_tokens, generated, tokens_named)])[0]

    def commit_many(self, written: Sequence[Written]) -> list[int]:
        """For each ``Written``: index the request's full pages whose KV is written (the first ``written_tokens``
        tokens) and whose names cover every position they hold: the prompt's, then ``generated`` (int32 ids after the
        prompt) as they fill; ``tokens_named`` (default: prompt + generated) caps what the names cover. ``pages[j]``
        holds chain position ``j``. Returns the pages newly indexed per request. Nothing is indexed past a collision
        or a lost parent. One lock and one index update for all (a decode step's pages that filled); no chain is
        touched here (``touch`` when a request is done)."""
        P, serial = self.page_size, self.index.serial
        out = [0] * len(written)
        with self.lock:
            runs, kept, children = [], [], []
            for i, w in enumerate(written):
                claim = w.claim
                if not claim.open:
                    continue
                prompt, lo = claim.prompt, len(claim.chain)
                n = prompt.tokens.size + w.generated.size
                m = min(w.written_tokens, n if w.tokens_named is None else w.tokens_named, n, len(w.pages) * P) // P
                if m <= lo:
                    continue
                if lo and serial(claim.chain[-1]) != claim.parent_serial:
                    claim.open = False  # the parent left the index (evicted or discarded): no child may hang on it
                    continue
                if (m == lo + 1 == len(claim.names) + 1 and lo and (lo + 1) * P > prompt.tokens.size
                        and lo not in claim.media and self.tiers is None):
                    children.append((i, w, lo))  # a decode step's page that filled: indexed with the others at once
                    continue
                rows = _rows(prompt, w.generated, lo, m)
                if m > len(claim.names):  # generated pages: their names continue the prompt's chain (lo <= names)
                    start = len(claim.names)
                    claim.names += chain(claim.names[-1] if start else prompt.root, rows[start - lo:].ravel(), P,
                                         start, claim.media)
                runs.append(ChainRun(w.pages[lo:m], claim.names[lo:m], rows, media_ids(claim.media, range(lo, m)),
                                     claim.salt_id, lo, claim.chain[-1] if lo else -1, claim.media))
                kept.append((i, w, lo, m))
            if children:
                for i, w, lo in self._commit_children(children, out):  # those the index left to a run of their own
                    claim = w.claim
                    rows = _rows(claim.prompt, w.generated, lo, lo + 1)
                    runs.append(ChainRun(w.pages[lo:lo + 1], claim.names[lo:lo + 1], rows, media_ids(claim.media,
                                         range(lo, lo + 1)), claim.salt_id, lo, claim.chain[-1], claim.media))
                    kept.append((i, w, lo, lo + 1))
            for (i, w, lo, m), (new, walked, ok) in zip(kept, self.index.insert_runs(runs)):
                claim = w.claim
                claim.open = ok
                if walked:
                    claim.chain += walked
                    claim.parent_serial = self.index.serial(walked[-1])
                adopted = [int(w.pages[lo + j]) for j in new]
                claim.adopted += adopted
                claim.adopted_serials += self.index.serials(adopted)
                out[i] = len(adopted)
                if self.tiers is not None and new:
                    prompt = claim.prompt
                    seq = np.concatenate((prompt.tokens, w.generated))[:m * P]
                    self.index.guard.call("lower tier", self.tiers.publish, self.pool, list(w.pages[:m]),
                                          [lo + j for j in new], claim.names[:m], seq,
                                          media_ids(claim.media, range(m)), prompt.salt)
            return out

    def _commit_children(self, children: list, out: list[int]) -> list:
        """Index, as arrays, one page per request that generated ids filled (the prompt's last, part-filled page or
        a wholly generated one) continuing its chain (``children``: ``(i, Written, position)``, every position before
        it indexed and named, no media on it): their names from their parents', then ``PrefixIndex.insert_children``;
        each adopted page joins its claim's chain (``out[i]`` = 1). Returns those the index left (a name or page it
        holds already), their names computed, for a run of their own. Under the lock."""
        P, n = self.page_size, len(children)
        ids = array.array("i", bytes(4 * n * P))  # the rows, filled as bytes: no numpy call per request
        buf = memoryview(ids).cast("B")
        last_names, pages, parents, salt_ids, depths = [], [], [], [], []
        for j, (_, w, lo) in enumerate(children):
            claim = w.claim
            at, start = 4 * j * P, 4 * (lo * P - claim.prompt.tokens.size)  # in bytes
            out_ids = token_bytes(w.generated)
            if start >= 0:
                buf[at:at + 4 * P] = out_ids[start:start + 4 * P]
            else:  # the prompt's last, part-filled page, filled by what was generated after it
                buf[at:at - start] = token_bytes(claim.prompt.tokens)[4 * lo * P:]
                buf[at - start:at + 4 * P] = out_ids[:4 * P + start]
            last_names.append(claim.names[-1])
            pages.append(int(w.pages[lo]))
            parents.append(claim.chain[-1])
            salt_ids.append(claim.salt_id)
            depths.append(lo)
        rows = np.frombuffer(ids, dtype=np.int32).reshape(n, P)
        names = chain_children(last_names, rows)
        handled = self.index.insert_children(pages, names, rows, parents, salt_ids, depths)
        serials = self.index.serials(pages)
        left, done = [], set(handled)
        for j, (i, w, lo) in enumerate(children):
            claim = w.claim
            claim.names.append(names[j])
            if j in done:
                claim.chain.append(pages[j])
                claim.parent_serial = serials[j]
                claim.adopted.append(pages[j])
                claim.adopted_serials.append(serials[j])
                out[i] = 1
            else:
                left.append((i, w, lo))
        return left

    def touch(self, claim: Claim) -> None:
        """The request is done with its chain: the pool's policy hears it, and the chain is marked used now (one
        tick for the whole chain), so its pages rank by their last use as they become evictable. Pages indexed while
        it ran took their parent's tick. A chain whose last page left the index meanwhile is not touched: its page ids
        may stand for other chains' pages now (the index is closed under parents, so the last page's serial vouches
        for the whole chain)."""
        with self.lock:
            self.index.released(claim.names[:claim.indexed])
            if claim.chain and self.index.serial(claim.chain[-1]) == claim.parent_serial:
                self.index.touch(claim.chain)

    def discard(self, claim: Claim) -> int:
        """Unindex every page ``claim``'s request indexed, with the descendants other requests indexed under them
        (its KV is bad); holders keep their own owners. Only a page still indexed under the serial it was adopted with
        is the request's: one that left the index meanwhile may have been handed out and indexed by another request
        since. Returns the pages unindexed."""
        with self.lock:
            claim.open = False
            now = self.index.serials(claim.adopted)
            n = self.index.remove([p for p, s, t in zip(claim.adopted, claim.adopted_serials, now) if s == t])
            claim.adopted, claim.adopted_serials = [], []
            return n

    # ----------------------------------------------------------------- stats
    def stats(self, pages_live: int, requests_live: int) -> PrefixCacheStats:
        """The index counters since creation, the pool's free pages, the pages and requests the table holds live
        (``pages_live``: distinct pages its live requests hold), and the indexed pages."""
        with self.lock:
            return PrefixCacheStats(**self.index.counters, pages_free=self.pool.num_free, pages_live=pages_live,
                                    pages_cached=len(self.index), requests_live=requests_live)


def _rows(prompt: NamedPrompt, generated: np.ndarray, lo: int, m: int) -> np.ndarray:
    """Token ids of chain positions ``lo..m-1`` of prompt + ``generated`` as rows of one page each."""
    P = prompt.page_size
    n = prompt.tokens.size
    if m * P <= n:
        flat = prompt.tokens[lo * P:m * P]
    elif lo * P >= n:
        flat = generated[lo * P - n:m * P - n]
    else:
        flat = np.concatenate((prompt.tokens[lo * P:], generated[:m * P - n]))
    return flat.reshape(m - lo, P)
