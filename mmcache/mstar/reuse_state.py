"""The prefix-reuse state machine of M*'s KV resource, apart from M*: ``ReuseState`` names what the steps of each
(request, label) stream write, matches it against the label's ``PrefixLifecycle`` and indexes its pages as they fill.
It imports nothing of ``mstar``: ``ReuseKVManager`` (``mmcache.mstar.kv_resource``) keeps M*'s hooks and calls it
(the seam's ``feed``/``feed_rows`` before M* admits a step, ``commit`` after M* committed the step's writes, ``forget``
when a request leaves or is reset), and a test drives it on a plain ``PagePool``
(``tests/mmcache/mstar/test_reuse_state.py``).

The table it is handed (``streams``: rid -> label -> stream) is the host's: a stream is anything with M*'s
``CacheStream`` fields this module reads and moves, ``page_indices`` (one owner per page listed, the table's),
``stored_len`` (positions whose KV is written) and ``generation`` (bumped whenever the pages change under the host);
``Stream`` here. ``release(pages)`` gives up a stream's owner of pages (M*'s arena), ``new_stream`` makes one.

A (request, label) stream is in one of these states:

- **Not named** (no ``_Named``). Its first feed of ids (or of a walk of embeddings that media marks name) is named and
  matched (``_match``): the verified prefix becomes the stream's first pages and ``stored_len``, the returned count is
  what the caller cuts off the step's input, and the stream is named from then on. A stream filled another way before
  its first feed (a retrieve, a fork) is never named; neither is a label not reused (``shadowed`` labels are only
  looked up in a ``ShadowIndex``, by ``shadow``, a ``ShadowFeeds``: nothing is cut, shared or indexed).
- **Named** (``_Named``): ``named`` leading positions are covered by names (the prompt's ids, then those fed after
  it: ``generated``, int32, plus ``chunks`` as fed and not yet joined, plus ``in_flight`` ids still on their way to
  the host); ``pending`` is the feed announced for the step in flight, ``(start, ids, n)``; ``due`` is the next
  position whose page, once written and named, is indexed (one integer compare per decode step). A later feed with
  everything before its page indexed continues the match (``_continue``: a chunked prefill, a walk after another,
  from inside a page too, the cached page found standing in for the stream's own). A feed of several ids is never
  cut to fewer than ``_ROWS_LEFT`` rows; ``rows_needed`` feeds are cut only at pages whose row outputs are held
  (``SideRows.servable``), ``whole`` ones never.
- **Settled** (``_settle``, at the stream's next feed, or at ``commit`` for a feed that reaches ``due``): a feed's
  positions count as named once the stream holds exactly them. ``stored_len == start + n``: written, ``named``
  moves there. ``stored_len == start``: not written (the step was refused, ``AllocationFailed``): ``pending`` is
  dropped, and the step fed again is cut at what the stream holds (the prompt again; or, for a feed a continued
  match cut, the same rows again, from ``continued``, none looked up twice). Anything else is a write no feed named
  (embeddings no marks describe, a remote retrieve): ``covered`` turns False and nothing from there on is indexed,
  so a page is never indexed under ids other than those its KV was computed from.
- **Indexed** (``commit``): of the streams in ``due``, those whose announced feed is written and whose names and
  writes both reach ``due`` have their fed ids joined into ``generated`` (``_flush``, one join for all) and their
  full pages indexed in one ``PrefixLifecycle.commit_many`` per label; ``due`` moves to the next page end. Pages that
  decode steps filled (``feed_rows``) wait in ``due_rows`` for a few steps' worth (``_ROWS_BATCH``, ``_ROWS_WAIT``),
  and no longer than the next lookup, read of the index or request leaving. Ids on a
  CUDA device (a decode step's sampled tokens) are never read with a blocking copy: they are parked (``Landing``,
  copied to pinned host memory behind an event, ``ids_to_host``) and their pages indexed at the first commit after
  the copy landed.
- **Stopped**: a fed id that is no token id cuts the names back to the prompt (``_stop_naming``): nothing past it
  is indexed.
- **Forgotten** (``forget``): the names are dropped and the chain touched (the request is done with it); ``live``
  turns False, so a landing still in flight indexes nothing of it (its pages may be gone).

What is held when: a stream holds one owner of every page it lists (taken by the match or by the host's allocator,
given up by the host, or here by ``release`` when a continued match replaces the stream's own part-filled page with
the cached one); the label's index holds one owner of every indexed page (``PrefixLifecycle``); the ``Claim`` is the
stream's standing in the index until ``forget``. Streams, ``due``, ``landing`` and the names change under the pool's
``cache_lock`` (``lock``, an RLock the host may already hold); naming a prompt and the group agreement of a match
(``life.match``, ``extend_match``) run outside it.

How ids reach the host is the host's to say: ``feed_rows(join=)`` turns a step's one-id feeds into ints
(``step_ids``), ``ReuseState(to_host=)`` starts the copy of device ids (``ids_to_host``; both in
``mmcache.mstar.fed_ids``); ``ReuseKVManager`` passes the names of its own module, where M*'s tests stand them in.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Sequence

import numpy as np

from mmcache.errors import InvalidRequest
from mmcache.index_types import IndexObserver
from mmcache.lifecycle import Claim, LowerTier, PrefixLifecycle, Written
from mmcache.mstar.fed_ids import Landing, append_generated, ids_to_host, joined_tokens, step_ids
from mmcache.mstar.row_outputs import RowParts, SideRows
from mmcache.mstar.shadow_feeds import ShadowFeeds
from mmcache.names import Fingerprint, as_tokens
from mmcache.pool import PagePool
from mmcache.tp import TPAgreement

# A step cut to one row for every request looks like a decode step to M*'s attention resource (it picks its decode
# wrapper when the last query offset equals the batch size, attn/flashinfer.py:168), whose plan has no query offsets
# for ``select_last_hidden`` (Orpheus, Higgs Audio, Qwen3-Omni and Whisper call it on every prefill walk): a feed of
# several ids is never cut to fewer than two.
_ROWS_LEFT = 2

# Pages that decode steps fill are indexed together, a few steps' worth at once: indexing costs about as much for two
# pages as for sixty (M*'s default page of 128 fills two pages a step over 256 streams), so a commit leaves them until
# this many streams wait, or for this many steps, or until anything reads the index (a feed's lookup, ``lifecycle``)
# or a request leaves. A page waits only while the stream that wrote it holds it (nothing else may match it yet).
_ROWS_BATCH, _ROWS_WAIT = 256, 16


@dataclasses.dataclass(slots=True, eq=False)
class Stream:
    """What the state machine reads and moves of a stream (the fields of M*'s ``CacheStream`` it uses): its pages,
    one owner each, the positions whose KV is written, and a counter bumped when the pages change under the host."""

    page_indices: list = dataclasses.field(default_factory=list)
    stored_len: int = 0
    generation: int = 0


@dataclasses.dataclass(slots=True, eq=False)
class _Named:
    """What names one (request, label) stream: its claim on the index and its label's lifecycle, the stream itself, the
    ids fed after the prompt (chunks as fed, appended to the int32 ``generated`` when a page fills), how many leading
    positions the names cover (``named``), the feed announced for the step in flight (start, ids, length) and the
    next position whose page, once written and named, is committed (``due``: one integer compare per decode step)."""

    claim: Claim
    life: PrefixLifecycle
    stream: object
    prompt_len: int
    named: int
    due: int
    chunks: list = dataclasses.field(default_factory=list)
    generated: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    spare: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(64, dtype=np.int32))  # ``generated``'s room
    media_upto: int = 0  # positions whose media marks are registered
    pending: tuple | None = None
    continued: tuple | None = None  # (start, rows cut, rows fed) of the last feed a continued match cut
    covered: bool = True  # False once a position was written that no feed named: nothing after it is indexed
    in_flight: int = 0  # fed ids on their way to the host (``Landing``), not yet in ``generated``
    live: bool = True  # False once the request's stream is forgotten: a landing then indexes nothing of it


class ReuseState:
    """The reuse state of one KV resource (see the module docstring), in one object: M*'s ``KVManager`` sets 24
    attributes, and an instance with more than about 28 no longer keeps its attributes inline (CPython's shared-key
    instance values), so every attribute and method lookup on it, M*'s own admit and plan included, once per request
    a step, costs a tenth more. ``ReuseKVManager`` adds three: ``reuse``, ``pool`` and this.

    - ``pool``: the pages; ``page_size`` positions each. ``lock``: the pool's ``cache_lock``.
    - ``streams``, ``new_stream``, ``release``: the host's stream table, how it makes a stream and gives up a stream's
      owner of pages (module docstring).
    - ``root``: the fingerprint every label's is made from (``fingerprint``), or None with nothing reused.
    - ``tiers(fingerprint, pool)``, ``observer(fingerprint, pool)``: a label's ``LowerTier`` and ``IndexObserver``
      (``PrefixReuse``), or None.
    - ``side``: the pages' row outputs (``PrefixReuse.row_outputs``), or None; ``evict_batch``: least pages one
      eviction frees; ``reused``: labels whose pages are shared; ``shadowed``: labels measured in shadow
      (``shadow``, ``mmcache.mstar.shadow_feeds``); ``agreement``: the TP group's, or None.
    """

    __slots__ = ("pool", "page_size", "lock", "streams", "new_stream", "release", "root", "tiers", "observer", "side",
                 "evict_batch", "reused", "shadow", "agreement", "fresh_rows", "watched", "lifecycles", "named",
                 "due", "due_rows", "rows_waited", "to_host", "landing", "observers")

    def __init__(self, pool: PagePool, page_size: int, streams: dict, *, root: Fingerprint | None,
                 new_stream: Callable[[], object] = Stream, release: Callable[[list], None] | None = None,
                 tiers: Callable[[Fingerprint, PagePool], LowerTier | None] | None = None,
                 observer: Callable[[Fingerprint, PagePool], IndexObserver | None] | None = None,
                 side: SideRows | None = None, evict_batch: int = 1, reused: frozenset = frozenset(),
                 shadowed: frozenset = frozenset(), agreement: TPAgreement | None = None,
                 to_host: Callable[[list], tuple | None] = ids_to_host):
        self.pool, self.page_size, self.lock = pool, int(page_size), pool.cache_lock
        self.streams, self.new_stream = streams, new_stream
        self.release = release if release is not None else pool.release
        self.root, self.tiers, self.observer = root, tiers, observer
        self.side, self.evict_batch, self.reused = side, evict_batch, reused
        self.shadow = ShadowFeeds(shadowed, self.fingerprint, self._ensure, self.stored, self.lock, _ROWS_LEFT)
        self.agreement = agreement
        self.fresh_rows: RowParts | None = None  # the last watched forward's rows, until its step commits
        self.watched: set = set()  # ids of the submodules whose forward records row outputs
        self.lifecycles: dict = {}  # label -> PrefixLifecycle
        self.observers: dict = {}  # label -> its IndexObserver (told each media item's length, where it listens)
        self.named: dict = {}  # label -> rid -> its stream's names (_Named)
        self.due: dict = {}  # streams whose announced feed reaches a page end, in order
        self.due_rows: dict = {}  # the same, announced by ``feed_rows``: indexed a few steps' worth at once
        self.rows_waited = 0  # commits ``due_rows`` has waited through
        self.to_host = to_host
        self.landing: collections.deque = collections.deque()  # Landing, oldest first

    def reuses(self, label: str) -> bool:
        """Whether ``label``'s steps are fed here (reused, or measured in shadow)."""
        return label in self.reused or label in self.shadow.labels

    def fingerprint(self, label: str) -> Fingerprint:
        """What roots ``label``'s page names: ``root`` with the label."""
        return dataclasses.replace(self.root, extra=f"{self.root.extra}/{label}")

    def lifecycle(self, label: str) -> PrefixLifecycle:
        """The prefix lifecycle of ``label`` (made on first use), every page that filled indexed."""
        if self.due_rows:
            with self.lock:
                self._commit_due()
        life = self.lifecycles.get(label)
        if life is None:
            fp = self.fingerprint(label)
            tiers = self.tiers(fp, self.pool) if self.tiers is not None else None
            observer = self.observers[label] = self.observer(fp, self.pool) if self.observer is not None else None
            life = self.lifecycles[label] = PrefixLifecycle(
                self.pool, fp, evict_batch_pages=self.evict_batch, tiers=tiers, agreement=self.agreement,
                observer=observer)
        return life

    def _ensure(self, rid: str, label: str):
        """(``rid``, ``label``)'s stream, made when the request has none for the label (M*'s ``_ensure_label``: the
        request must be in the table). Under the lock."""
        of_rid = self.streams[rid]
        stream = of_rid.get(label)
        if stream is None:
            stream = of_rid[label] = self.new_stream()
        return stream

    def feed(self, rid: str, label: str, token_ids, media: Sequence = (), salt: bytes = b"",
             length: int | None = None, rows_needed: bool = False, whole: bool = False) -> int:
        """A step is about to feed ``token_ids`` to (``rid``, ``label``): returns how many leading ids the stream now
        holds already, which the caller cuts off (``stored`` then says where the stream stands). The first feed of a
        stream is matched (its verified prefix becomes the stream's first pages); the same prompt fed again (a retry
        after ``AllocationFailed``) is cut at what the stream holds; a later feed with everything before its page
        indexed continues the match (a prompt prefilled in chunks, a walk after a reused one, ``_continue``), and fed
        again after ``AllocationFailed`` is cut as it was;
        any later feed names the positions it writes. ``media``: ``(offset in the feed, digest)`` marks of the media
        items the fed positions hold; a walk of ``length`` embeddings (``token_ids`` None) is named by its marks (a
        stream's first walk too: Qwen3-TTS's prefill is embeddings only), and one with no marks names nothing, which
        stops the stream's indexing there. ``rows_needed``: the step's outputs carry every fed row
        (``RowOutputs.needed``): it is cut only at pages whose row outputs are all held (``SideRows.servable``;
        ``held_rows`` then reads those of the rows cut), and not at all without ``PrefixReuse.row_outputs``.
        ``whole``: the step is computed in full (``PrefixReuse.needs_every_row``): named and indexed, never cut."""
        if label not in self.reused:
            return self.shadow.feed(rid, label, token_ids, media, salt, length) if label in self.shadow.labels else 0
        if self.due_rows:  # what decode steps filled is indexed before anything is looked up
            with self.lock:
                self._commit_due()
        if token_ids is None and media and length:
            self._describe_media(label, media, int(length))
            token_ids = np.zeros(int(length), dtype=np.int32)  # placeholders: the marks carry what the rows hold
        named = self.named.get(label, {}).get(rid)
        if named is None:
            return self._first_feed(rid, label, token_ids, media, salt, self._servable(rows_needed, whole))
        held = named.stream.stored_len
        pending, continued, named.continued = named.pending, named.continued, None
        self._settle(named, held)  # what the previous feed announced is written now, or was not
        if token_ids is None:
            return 0  # nothing announced: the write stops the names (settled at the next feed or commit)
        n = token_ids.shape[0] if hasattr(token_ids, "shape") else len(token_ids)
        cut, start = 0, held  # start: the first position the step writes
        if held < named.prompt_len == n and np.array_equal(as_tokens(token_ids), named.claim.prompt.tokens):
            cut, token_ids = held, named.claim.prompt.tokens[held:]  # the prefill again: only what is not held is fed
        elif (continued is not None and pending is not None and pending[0] == held
              and continued[0] + continued[1] == held and continued[2] == n):
            # the feed a continued match cut, fed again (its step was refused before it wrote, AllocationFailed):
            # the stream still holds the cached pages found for it, so the same rows are cut, none looked up again
            cut, named.continued = continued[1], continued
            token_ids = token_ids[cut:]
        else:
            if media and not self._marks_taken(named):  # a retried walk announces its marks again: taken once
                named.claim.add_media([(held + int(o), d) for o, d in media], self.page_size)
                named.media_upto = held + n
            if (held >= named.prompt_len and n > 1
                    and (servable := self._servable(rows_needed, whole)) is not False):
                cut = self._continue(named, held, token_ids, servable)
                token_ids, start = (token_ids[cut:] if cut else token_ids), held + cut
                named.continued = (held, cut, n) if cut else None
        named.pending = (start, token_ids, n - cut)
        if named.covered and start + n - cut >= named.due:
            with self.lock:
                self.due[named] = None  # a page fills in this step: commit indexes it
        return cut

    def _describe_media(self, label: str, media: Sequence, length: int) -> None:
        """Tell ``label``'s observer, where it listens for it (``KVEventPublisher.describe_media``), how many rows
        each media item of a walk of ``length`` embeddings holds: the walk's marks partition it (one item from offset
        0, or one per row), each item running to the next mark or the walk's end. A router then finds the item's key
        on every page it overlaps, not only on its first."""
        self.lifecycle(label)  # makes the observer
        describe = getattr(self.observers.get(label), "describe_media", None)
        if describe is None:
            return
        marks = sorted((int(o), d) for o, d in media)
        for (at, digest), end in zip(marks, [o for o, _ in marks[1:]] + [length]):
            if end > at:
                describe(digest, end - at)

    def marks_taken(self, rid: str, label: str) -> bool:
        """Whether (``rid``, ``label``)'s stream stands inside the walk whose media marks it took last (the prompt's,
        for its first feed): that walk is not written (a step that runs writes all it was fed, through where its
        marks end), so a walk fed now is that one again, after ``AllocationFailed``. ``feed`` reads such a walk's
        marks only for being there (the stream's names hold them already), so the caller may hand it the marks it
        announced for the walk instead of naming its rows again. False for a stream not named (none yet, or
        forgotten: a reset request is named afresh, from the marks it is fed), and in shadow."""
        named = self.named.get(label, {}).get(rid)
        return named is not None and self._marks_taken(named)

    @staticmethod
    def _marks_taken(named: _Named) -> bool:
        return named.stream.stored_len < named.media_upto

    def feed_rows(self, label: str, rows: dict, join=step_ids) -> list:
        """The one-row feeds of a step at once (a decode step's): for each ``rid -> ids`` (one id) what
        ``feed(rid, label, ids)`` does for a stream already named, where a one-row feed is never cut (``_ROWS_LEFT``)
        and carries no media. The step's ids are joined into ints at once where they are on the host (``join``,
        ``step_ids``: one ``torch.cat`` a step, where keeping each request's tensor until its page fills costs a join
        of a page of one-element views per stream). Returns the rids left to ``feed`` (a stream not named yet, a label
        in shadow)."""
        if label not in self.reused:
            return list(rows)
        left, due, named_of = [], [], self.named.get(label, {})
        fed = list(rows.values())
        ints = join(fed) if fed else None
        for rid, ids in zip(rows, fed if ints is None else ints):
            named = named_of.get(rid)
            if named is None:
                left.append(rid)
                continue
            held = named.stream.stored_len
            pending = named.pending
            if (pending is not None and pending[2] == 1 and pending[0] == named.named == held - 1 and named.covered
                    and held > named.prompt_len):
                # the last step's one-row feed is written: ``_settle``'s common case, inlined (one call a request
                # a step is a fifth of this loop)
                named.chunks.append(pending[1])
                named.named = held
            else:
                self._settle(named, held)  # what the previous feed announced is written now, or was not
            named.continued = None
            named.pending = (held, ids, 1)
            if held + 1 >= named.due and named.covered:
                due.append(named)
        if due:
            with self.lock:
                for named in due:
                    self.due_rows[named] = None  # a page fills in this step: a commit indexes it
        return left

    def _servable(self, rows_needed: bool, whole: bool = False):
        """What a feed may be served: any verified page (None), pages whose row outputs are all held (a check), or,
        for a step computed in full or needing rows no ``SideRows`` holds, nothing (False)."""
        if whole:
            return False
        if not rows_needed:
            return None
        return self.side.servable if self.side is not None else False

    def _first_feed(self, rid: str, label: str, token_ids, media: Sequence, salt: bytes, servable) -> int:
        if token_ids is None:
            return 0
        ids = as_tokens(token_ids)
        with self.lock:
            stream = self._ensure(rid, label)
            filled = stream.stored_len or stream.page_indices
        if filled or not ids.size:
            return 0  # the stream was filled another way (a retrieve, a fork): nothing of it is named
        if servable is False:
            servable, rows_left = None, int(ids.size)  # named and indexed, nothing matched
        else:
            rows_left = _ROWS_LEFT
        return self._match(rid, label, ids, media, salt, rows_left, servable)

    @staticmethod
    def _settle(named: _Named, held: int, unwritten_stays: bool = False) -> None:
        """The stream holds ``held`` tokens now: the feed announced last (``pending``) was written exactly (the
        names then cover up to ``held``), or not at all (dropped; kept with ``unwritten_stays``, for a step still to
        commit), or the stream moved otherwise (a write no feed named: nothing from there on is indexed)."""
        pending = named.pending
        if pending is None:
            if held != named.named:
                named.covered = False
            return
        start, ids, n = pending
        if held == start and n:
            if not unwritten_stays:
                named.pending = None
            return
        named.pending = None
        if named.covered and start == named.named and held == start + n:
            if held > named.prompt_len:
                named.chunks.append(ids if start >= named.prompt_len else ids[named.prompt_len - start:])
            named.named = held
        else:
            named.covered = False

    def _continue(self, named: _Named, held: int, token_ids, servable=None) -> int:
        """Continue ``named``'s match into a feed at ``held``: how many of its ids cached pages now hold. The feed may
        start inside a page (a walk after a prompt that did not end on a page boundary): the lookup then covers that
        page from its start, with the ids already written on it, and a cached page found for it replaces the
        stream's own (the cached page holds the same KV for those positions: its verifying ids say so)."""
        P, stream, claim = self.page_size, named.stream, named.claim
        base = claim.indexed * P  # positions before ``base`` are indexed; ``held - base`` more are on the own page
        own = held > base
        if not (named.covered and held == named.named and base <= held < base + P
                and len(stream.page_indices) == claim.indexed + own):
            return 0
        ids = as_tokens(token_ids)
        written = self._named_ids(named, base, held) if own else ids[:0]
        if written is None:
            return 0
        pages = named.life.extend_match(claim, np.concatenate((written, ids)) if own else ids, _ROWS_LEFT,
                                        written=written.size, servable=servable)
        if not pages:
            return 0
        k = base + len(pages) * P - held  # of this feed's ids, what the cached pages hold
        with self.lock:
            if own:  # the cached page stands in for the stream's own, whose positions it holds the same way
                self.release(stream.page_indices[-1:])
                stream.page_indices[-1:] = pages[:1]
                pages = pages[1:]
            stream.page_indices += pages
            stream.stored_len += k
            stream.generation += 1
            named.named += k
            named.chunks.append(ids[:k])
            named.due = (named.named // P + 1) * P
        return k

    def _named_ids(self, named: _Named, lo: int, hi: int) -> np.ndarray | None:
        """The ids named for positions ``lo..hi-1`` (the prompt's, then those fed after it); None when a fed id is
        no token id (the stream's naming then stops)."""
        n = named.prompt_len
        if hi <= n:
            return named.claim.prompt.tokens[lo:hi]
        if not self._flush((named,))[0]:
            return None
        head = named.claim.prompt.tokens[lo:n] if lo < n else named.generated[:0]
        return np.concatenate((head, named.generated[max(lo - n, 0):hi - n]))

    def stored(self, rid: str, label: str) -> int:
        """Tokens (``rid``, ``label``)'s stream holds: after a cut, where its next position is."""
        return self.streams[rid][label].stored_len

    def _match(self, rid: str, label: str, ids: np.ndarray, media: Sequence, salt: bytes, rows_left: int,
               servable=None) -> int:
        life = self.lifecycle(label)
        prompt = life.name(ids, media, salt, what=f"request {rid!r} label {label!r}")
        # outside the lock: a group agreement may wait for other ranks
        claim, match = life.match(prompt, rows_left, servable)
        if match.fetch is not None:
            match.fetch.wait()  # pages copied up from a tier: read none before they arrived
        k = len(match.pages) * self.page_size
        with self.lock:
            stream = self._ensure(rid, label)
            stream.page_indices = list(match.pages)
            stream.stored_len = k
            stream.generation += 1
            P = self.page_size
            named = self.named.setdefault(label, {})[rid] = _Named(
                claim, life, stream, int(ids.size), k, (k // P + 1) * P, pending=(k, ids[k:], int(ids.size) - k),
                media_upto=int(ids.size))
            if ids.size >= named.due:
                self.due[named] = None
        return k

    def commit(self) -> None:
        """The host committed a step's writes (its streams' ``stored_len`` moved): index the pages that filled
        (``_commit_due``); those decode steps filled once a few steps' worth wait (``_ROWS_BATCH``, ``_ROWS_WAIT``)."""
        with self.lock:
            if self.due or self.landing:
                self._commit_due()
            elif self.due_rows:
                self.rows_waited += 1
                if self.rows_waited >= _ROWS_WAIT or len(self.due_rows) >= _ROWS_BATCH:
                    self._commit_due()

    def _commit_due(self) -> None:
        """Index the pages that filled: of the streams whose announced feed reaches a page end (``due``, and
        ``due_rows``), those whose feed is now written; their fed ids joined at once (``_flush``), then one
        ``commit_many`` per label. Ids on a CUDA device are copied to the host without waiting (``_park``, through
        ``to_host``) and their pages indexed at a later commit, once the copy has landed (``_land``). A stream whose
        step has not committed yet stays. Under the lock."""
        if self.landing:
            self._land(wait=False)
        if self.due_rows:
            self.due.update(self.due_rows)
            self.due_rows.clear()
        self.rows_waited = 0
        ready = []
        for named in list(self.due):
            stream = named.stream
            self._settle(named, stream.stored_len, unwritten_stays=True)
            if named.pending is not None:
                continue
            del self.due[named]
            if named.covered and min(stream.stored_len, named.named) >= named.due:
                ready.append(named)
        if ready and not self._park(ready):
            self._index_written(ready, self._flush(ready))

    def _index_written(self, streams: Sequence[_Named], joined: Sequence[bool]) -> None:
        """``commit_many`` (one per label) of the pages ``streams`` wrote and named, for each whose ids ``joined``
        into ``generated``; the next page end each is due at."""
        P, written = self.page_size, {}
        for named, ok in zip(streams, joined):
            if ok:
                stream = named.stream
                item = Written(named.claim, stream.page_indices, stream.stored_len, named.generated, named.named)
                written.setdefault(named.life, []).append((named, item))
        for life, items in written.items():
            life.commit_many([item for _, item in items])
            for named, _ in items:
                named.due = (min(named.stream.stored_len, named.named) // P + 1) * P

    def _park(self, streams: list[_Named]) -> bool:
        """Start the host copy of ``streams``' chunks when they are device tensors (``to_host``); their pages are
        indexed when it lands, and each is due at its next page end meanwhile. False (nothing changed) otherwise."""
        first = next((named.chunks[0] for named in streams if named.chunks), None)
        if first is None or type(first) is int:  # ids joined when fed (``step_ids``) are on the host
            return False
        started = self.to_host([named.chunks for named in streams if named.chunks])
        if started is None:
            return False
        sizes = [named.named - named.prompt_len - named.generated.size - named.in_flight for named in streams]
        if started[0].numel() != sum(sizes):
            return False
        P = self.page_size
        for named, size in zip(streams, sizes):
            named.chunks, named.in_flight = [], named.in_flight + size
            named.due = (min(named.stream.stored_len, named.named) // P + 1) * P
        self.landing.append(Landing(streams, sizes, *started))
        return True

    def _land(self, wait: bool) -> None:
        """Index the pages of every parked step whose ids reached the host, oldest first (a stream's ids join its
        ``generated`` in the order it fed them); stop at the first copy still running, or, with ``wait``, wait for
        every one. A stream forgotten meanwhile gets nothing indexed (its pages may be gone); a fed id that is no
        token id stops its own stream's naming, as on the host."""
        with self.lock:
            while self.landing:
                landing = self.landing[0]
                if not wait and not landing.event.query():
                    return
                landing.event.synchronize()
                self.landing.popleft()
                joined, at = [], 0
                for named, size in zip(landing.streams, landing.sizes):
                    part, at = landing.host[at:at + size], at + size
                    named.in_flight -= size
                    # still named: no bad id stopped the stream's names since (``_stop_naming`` cuts them to the prompt)
                    ok = named.live and named.named >= named.prompt_len + named.generated.size + size
                    if ok:
                        try:
                            append_generated(named, as_tokens(part))
                        except InvalidRequest:
                            ok = self._stop_naming(named)
                    joined.append(ok)
                self._index_written(landing.streams, joined)

    def _flush(self, streams: Sequence[_Named]) -> list[bool]:
        """Join each stream's chunks fed since its last flush to its int32 ``generated`` (which then holds the ids of
        positions ``prompt_len..named-1``), after any still on their way to the host (``_land``, waited for): every
        stream's chunks in one join, split by what each stream's names cover; a stream whose chunks do not join so is
        joined alone. Per stream: False (and nothing of it from here on is named) when a fed id is no token id."""
        if self.landing:
            self._land(wait=True)
        todo = [named for named in streams if named.chunks]
        if len(todo) > 1:
            sizes = [named.named - named.prompt_len - named.generated.size for named in todo]
            try:
                joined = joined_tokens(list(itertools.chain.from_iterable(named.chunks for named in todo)))
            except InvalidRequest:
                joined = None
            if joined is not None and joined.size == sum(sizes):
                at = 0
                for named, size in zip(todo, sizes):
                    append_generated(named, joined[at:at + size])
                    named.chunks, at = [], at + size
                return [True] * len(streams)
        out = []
        for named in streams:
            chunks, named.chunks = named.chunks, []
            if chunks:
                try:
                    append_generated(named, joined_tokens(chunks))
                except InvalidRequest:
                    out.append(self._stop_naming(named))
                    continue
            out.append(True)
        return out

    @staticmethod
    def _stop_naming(named: _Named) -> bool:
        """A fed id of ``named``'s stream is no token id: nothing of it past the prompt is named or indexed from here
        on. Returns False (what the stream's join gave)."""
        named.covered, named.named, named.due = False, min(named.named, named.prompt_len), 1 << 62
        return False

    def forget(self, rid: str, finished: bool) -> None:
        """``rid``'s streams are named no more; their chains are touched (done with them now)."""
        with self.lock:
            self.shadow.end(rid, finished)
            if self.due_rows or self.landing:  # the request's last pages: indexed while it holds them (those
                self._commit_due()  # still on their way to the host, as a rule landed already, are left)
            for of_label in self.named.values():
                named = of_label.pop(rid, None)
                if named is None:
                    continue
                named.live = False
                self.due.pop(named, None)
                named.life.touch(named.claim)
