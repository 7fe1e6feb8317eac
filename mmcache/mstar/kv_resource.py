"""ReuseKVManager: M*'s own ``KVManager`` (mstar-ai 0.2.1) over mmcache's pool, with exact prefix reuse per label.

Built by M*'s engine like its own KV resource: a ``ReuseKVSpec`` (a ``KVSpec`` whose ``resource_class`` is this one)
goes through ``build_resource(spec, info)``. Everything M* reads and writes is M*'s: the ``CacheStream`` table, the KV
tensor, planning, ``write_kv``/``read_kv``, forks, transfers, offload. What differs:

- Pages come from a ``PagePool`` over M*'s KV tensor (one owner count per page; page 0 stays M*'s sink page). The
  arena's allocator is a ``CountedPageAllocator``: ``free`` drops one owner, a shortfall evicts the coldest cached
  pages of the node's pool (every label's index and an ``EncoderStore`` built on ``manager.pool``) before M* sees
  ``AllocationFailed``. M*'s ``_lock`` is the pool's ``cache_lock``: one lock for the streams, the indexes and the
  encoder store.
- One ``PrefixLifecycle`` per reused label (labels never share pages). ``feed`` (called by the seam in the node's
  ``prepare_inputs``, ``mmcache.mstar.switch``) names what a step is about to write: the first feed of a stream is
  matched, its verified prefix becomes the stream's first pages and ``stored_len``, and the seam cuts the input to
  the suffix; a later feed with everything before its page indexed continues the match (a chunked prefill, a walk
  after another, from inside a page too: the cached page found for that page stands in for the stream's own). A feed
  of several ids is never cut to one row (``_ROWS_LEFT``). ``commit`` then indexes every full page whose positions
  were all announced through ``feed``, prompt and generated tokens alike, as it is written: a walk the seam did not
  name (embeddings, a remote retrieve) stops the stream's indexing at its first position, so a page is never indexed
  under ids other than those its KV was computed from. A retried step (after ``AllocationFailed``) feeds the prompt
  again and is cut at what is held. A feed's positions count as named once the stream holds exactly them, settled at
  the stream's next feed or, for a feed that fills a page, at its commit: a decode step costs one ``feed`` per
  request, and the pages that fill in a step are indexed in one ``PrefixLifecycle.commit_many``. M*'s GPU thread
  commits right after it launches the step's forward, so fed ids on a CUDA device (a decode step's sampled tokens)
  are never read there with a blocking copy: they are copied to pinned host memory behind an event
  (``ids_to_host``), and their pages are indexed at the first commit after the copy landed.
- Row outputs (``PrefixReuse.row_outputs``, ``mmcache.mstar.row_outputs``): a ``SideRows`` beside the arena, indexed
  by the same page ids, so a page's rows live and die with it. The allocator forgets a page's rows whenever it hands
  the page out; ``commit`` stores the rows the watched forward recorded between the step's ``admit`` and it (none
  after a forward no hook saw); a feed that needs them is served only pages whose rows are all stored, and
  ``held_rows`` reads those of the rows it cut.
- The methods that assumed one owner per page count owners: ``reset_request(free=False)`` gives up a stream's pages
  when another owner holds one (M* would rewind onto them and overwrite shared KV); ``reclaimable`` and ``offload``
  count the pages no other live stream holds (after the offload each is free, or its label's index holds it alone and
  a shortfall evicts it: M*'s ``num_free`` counts both), and an offload that would free none moves nothing and
  returns 0, as M*'s contract reads 0.

With no ``PrefixReuse`` (``reuse=None``) nothing is matched or indexed: M*'s own behaviour on a counted pool.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, NamedTuple, Sequence

import numpy as np
import torch

from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.eviction import DEFAULT_POLICY, check_policy
from mmcache.lifecycle import Claim, LowerTier, PrefixLifecycle, Written
from mmcache.mstar.requirement import require_mstar
from mmcache.mstar.row_outputs import RowOutputs, RowParts, SideRows
from mmcache.names import Fingerprint, as_tokens
from mmcache.pool import PagePool
from mmcache.prefix_index import IndexObserver
from mmcache.reclaim import reclaimable as reclaimable_pages
from mmcache.reclaim import take
from mmcache.shadow import ShadowIndex
from mmcache.stats import PrefixCacheStats, ShadowStats
from mmcache.tp import TPAgreement

require_mstar()
from mstar.engine.resources.kv.cache import PageAllocator  # noqa: E402
from mstar.engine.resources.kv.config import KVSpec  # noqa: E402
from mstar.engine.resources.kv.manager import KVManager  # noqa: E402
from mstar.engine.resources.kv.plan import SINK_PAGE  # noqa: E402


# A step cut to one row for every request looks like a decode step to M*'s attention resource (it picks its decode
# wrapper when the last query offset equals the batch size, attn/flashinfer.py:168), whose plan has no query offsets
# for ``select_last_hidden`` (Orpheus, Higgs Audio, Qwen3-Omni and Whisper call it on every prefill walk): a feed of
# several ids is never cut to fewer than two.
_ROWS_LEFT = 2


def _joined_tokens(chunks: list) -> np.ndarray:
    """The ids of ``chunks`` (what consecutive feeds fed: ints (``feed_rows``' one id a step), tensors, arrays or lists,
    one step's ids each) as one int32 array; ``InvalidRequest`` when one is not a flat sequence of token ids. Chunks
    of one kind are joined by one call of their library (one device copy for tensors), mixed ones id by id."""
    first = chunks[0]
    try:
        if type(first) is int:
            return as_tokens(chunks)
        if isinstance(first, torch.Tensor):
            return as_tokens(torch.cat(chunks))
        if isinstance(first, np.ndarray):
            return as_tokens(np.concatenate(chunks))
    except (InvalidRequest, RuntimeError, TypeError, ValueError):  # mixed chunks: the general path says what is wrong
        pass
    return as_tokens([i for c in chunks
                      for i in ((c,) if type(c) is int else c.tolist() if hasattr(c, "tolist") else c)])


_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def _one_tensor(tensors: list) -> torch.Tensor | None:
    """``tensors`` joined by one ``torch.cat`` (on their device, without reading them) into one flat tensor; None
    when one call does not join them so (the caller's general path then says what is wrong)."""
    try:
        joined = torch.cat(tensors)
    except (RuntimeError, TypeError, ValueError):
        return None
    return joined if joined.dim() == 1 else None


def _step_ids(ids: list) -> list[int] | None:
    """A decode step's fed ids (one one-element tensor per request, as M* hands them) as ints, joined by one call:
    a stream then keeps an int a step, not a tensor, and the pages that fill are named from ints. None for ids on a
    CUDA device (reading them here would wait for the forward just launched: they go through ``ids_to_host``) and
    for anything one call does not join into one integer id a request (kept as fed, checked where joined)."""
    first = ids[0]
    if not isinstance(first, torch.Tensor) or first.device.type == "cuda":
        return None
    joined = _one_tensor(ids)
    if joined is None or joined.numel() != len(ids) or joined.dtype not in _INT_DTYPES:
        return None
    return joined.tolist()


def _append_generated(named: _Named, ids: np.ndarray) -> None:
    """``named.generated`` += ``ids``, in room that doubles (a stream's generated ids are copied O(log n) times, not
    at every page that fills). ``generated`` stays a view of its first ids: a view taken earlier still reads what it
    read, since the room is only ever written past it."""
    n, k = named.generated.size, ids.size
    room = named.spare
    if n + k > room.size:
        room = np.empty(max(2 * room.size, n + k), dtype=np.int32)
        room[:n] = named.generated
        named.spare = room
    room[n:n + k] = ids
    named.generated = room[:n + k]


def ids_to_host(chunks: list[list]) -> tuple[torch.Tensor, object] | None:
    """Fed id tensors on a CUDA device (a decode step's sampled tokens, fed back; ``chunks``: each stream's, in
    order), joined there and copied to pinned host memory without waiting: ``(host tensor, the copy's event)``. M*'s
    GPU thread commits a step right after launching its forward, so a blocking copy there would wait for that forward.
    None for anything else (ids on the host are joined where they are, at once)."""
    first = chunks[0][0]
    if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return None
    ids = _one_tensor([chunk for stream in chunks for chunk in stream])
    if ids is None:
        return None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class _Landing(NamedTuple):
    """Pages that filled in a step whose fed ids are on their way to the host (``ids_to_host``): the streams, how
    many of the ids each fed, the host tensor and the copy's event."""

    streams: list
    sizes: list[int]
    host: torch.Tensor
    event: object


class CountedPageAllocator(PageAllocator):
    """M*'s ``PageAllocator`` interface over a ``PagePool``: ``try_allocate`` takes pages with one owner each,
    evicting cold cached pages of the pool first; ``free`` drops one owner per page (the pool frees a page when its
    count reaches 0). Thread-safe: every take and release holds the pool's locks. ``counters``: the shortfalls of the
    takes made here, the one count of them (``ReuseKVManager.shortfalls`` reports them)."""

    def __init__(self, pool: PagePool, evict_batch_pages: int = 1, side: SideRows | None = None):
        self.pool, self.max_num_pages, self.evict_batch_pages = pool, pool.num_pages, evict_batch_pages
        self.side = side  # the pages' row outputs: every page taken here starts with none valid
        self.counters = {"eviction_batches": 0, "shortfall_pages": 0, "stalls": 0}

    def try_allocate(self, n: int) -> list[int] | None:
        try:
            pages = take(self.pool, n, self.evict_batch_pages, self.counters)
        except OutOfPages:
            return None
        if self.side is not None:
            with self.pool.cache_lock:
                self.side.forget(pages)
        return pages

    def allocate(self, n: int) -> list[int]:
        pages = self.try_allocate(n)
        if pages is None:
            raise RuntimeError(f"Not enough free pages: requested {n}, available {self.num_free}")
        return pages

    def free(self, pages: list[int]) -> None:
        self.pool.release(pages)

    @property
    def num_free(self) -> int:
        """Pages free now plus cached pages a take would evict (what M* may count on)."""
        with self.pool.cache_lock:
            return self.pool.num_free + reclaimable_pages(self.pool.evictables)

    @property
    def free_pages(self):  # M*'s attribute is a queue; nothing outside the allocator reads it
        raise AttributeError("a CountedPageAllocator has no free-page queue; use num_free")


@dataclasses.dataclass(frozen=True)
class PrefixReuse:
    """Turns reuse on for a KV resource.

    - ``model`` names the weights exactly (repository@revision, or a hash of the files): it roots every page name
      with the rest of the fingerprint (TP rank and size, KV dtype, page size, the resource and label).
    - ``labels``: the streams the seam names (the label a node's step writes its prompt into).
    - ``attention_backend``: part of the fingerprint.
    - ``evict_batch_pages``: least pages one eviction frees (default 1/64 of the pool).
    - ``eviction``: the policy that orders what the node's pool evicts (its prefix indexes and an encoder store on
      ``manager.pool``): a name in ``mmcache.eviction.POLICIES``; an unknown one raises ``InvalidConfig`` here, before
      any resource is built.
    - ``tiers(fingerprint, pool)``: a ``LowerTier`` per label (host tier, shared store), or None.
    - ``observer(fingerprint, pool)``: an ``IndexObserver`` per label (``mmcache.kv_events.KVEventPublisher``), or
      None.
    - ``position_advance(graph_walk, node_inputs, rows)``: for a node that computes its step's positions itself in
      ``prepare_inputs``, from the counter as it stands at the walk's start (Qwen3-Omni's thinker, MRoPE), how far the
      counter moves past the ``rows`` leading rows of the step the stream holds already. Given, the seam leaves the
      counter alone before the step and adds that to the step's declared advance: the commit leaves the counter where
      a cold prefill leaves it, and a step retried after ``AllocationFailed`` reads the counter its walk started at.
      None for a walk whose positions M*'s position resource plans from the counter, one a row (``pos_ids`` not
      given: BAGEL's text walks, beside image walks whose rows share one position): the seam then moves the counter
      before the step to where it stood at the walk's start plus the ``rows`` held (that start kept per request, so a
      retried step moves it to the same place), and the commit adds the step's own span.
    - ``cut(node_inputs, rows)``: drops the first ``rows`` rows of everything a step feeds per row (default
      ``mmcache.mstar.switch.cut_to_suffix``: ``input_ids``, ``input_embeds``; a model whose inputs carry more per
      row, positions or masks, gives its own).
    - ``row_outputs``: what a node's forward emits for every fed row that the KV does not hold
      (``mmcache.mstar.row_outputs.RowOutputs``; Qwen3-Omni's thinker streams each row's states to its talker when
      audio output is asked). Given, the manager keeps them per KV page beside the arena (``SideRows``, written at
      every commit of a watched forward, needed or not), a step that needs them is cut only at pages whose rows are
      all held, and the seam puts the held rows back in front of what the forward emitted. Not with ``tiers``
      (``InvalidRequest``): a page copied up from a lower tier carries no row outputs.
    - ``needs_every_row(graph_walk, fwd_info)``: True for a step that must be computed in full because it writes,
      from its rows, something the reused pages do not hold (BAGEL's guided text walk also writes its ``cfg_img``
      branch): such a step is named and indexed, never cut.
    - ``walk_media(graph_walk, fwd_info, inputs, node_inputs)``: for a step fed embeddings, the ``(offset in the
      step, digest)`` marks of the media items its rows hold (their digests must commit to everything the rows depend
      on: the media bytes as sent, the preprocessing and the encoder's weights), or None when the rows are not
      described by media: then the seam names nothing and the stream's indexing stops there. Called once per walk:
      the walk's step fed again after ``AllocationFailed`` keeps the marks it was given. A mark enters the names
      of its page and, through the chain, of every later page, never of an earlier one: where a walk's attention is
      bidirectional (Pi0.5's prefill) every position's KV depends on the whole walk, and one mark at its first row
      must name all of it (``mmcache.mstar.pi05``).
    - ``id_walks``: the graph walks whose ``input_embeds`` are exactly the model's embedding of the ``input_ids`` fed
      with them (Higgs Audio's ``prefill_text`` embeds its ids only to share a capture with ``prefill_audio``): the
      seam names such a walk by its ids, as if no embeddings went in, and cuts both to the suffix. That is the
      invariant this list declares, and nothing checks it: a walk listed here whose embeddings depend on anything but
      its ids (spliced media, a scale, a soft prompt) is indexed under ids that do not determine its KV, and a later
      request with the same ids is served that KV.
    - ``walk_ids(graph_walk, inputs)``: for an ``id_walks`` walk whose node inputs carry the embeddings without their
      ids (Qwen3-Omni's ``thinker_decode`` embeds the sampled token it reads from its graph inputs), those ids from
      the walk's graph inputs, or None (the walk then names nothing).
    - ``shadow``: measure only (phase 1): each label's prompts are named and looked up in a ``ShadowIndex`` (every
      finished request's pages, unbounded), nothing is shared, cut or indexed, and M* computes what it computes
      without mmcache; ``ReuseKVManager.shadow_stats(label)`` says what reuse would have saved.
    """

    model: str
    labels: tuple[str, ...] = ("main",)
    attention_backend: str = "flashinfer"
    evict_batch_pages: int | None = None
    eviction: str = DEFAULT_POLICY
    tiers: Callable[[Fingerprint, PagePool], LowerTier | None] | None = None
    observer: Callable[[Fingerprint, PagePool], IndexObserver | None] | None = None
    position_advance: Callable[[str, object, int], int | None] | None = None
    cut: Callable[[object, int], None] | None = None
    row_outputs: RowOutputs | None = None
    needs_every_row: Callable[[str, object], bool] | None = None
    walk_media: Callable | None = None
    id_walks: tuple[str, ...] = ()
    walk_ids: Callable | None = None
    shadow: bool = False

    def __post_init__(self):
        check_policy(self.eviction)


@dataclasses.dataclass
class ReuseKVSpec(KVSpec):
    """M*'s ``KVSpec`` with ``reuse``; the engine builds a ``ReuseKVManager`` from it."""

    reuse: PrefixReuse | None = None

    @property
    def resource_class(self):
        return ReuseKVManager

    @classmethod
    def of(cls, spec: KVSpec, reuse: PrefixReuse | None) -> ReuseKVSpec:
        """``spec`` (a model's own ``KVSpec``) with reuse, every field kept."""
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        return cls(**fields, reuse=reuse)


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
    in_flight: int = 0  # fed ids on their way to the host (``_Landing``), not yet in ``generated``
    live: bool = True  # False once the request's stream is forgotten: a landing then indexes nothing of it


@dataclasses.dataclass(slots=True, eq=False)
class _ReuseState:
    """What a ``ReuseKVManager`` keeps beside M*'s own state, in one object. M*'s ``KVManager`` sets 24 attributes;
    an instance with more than about 28 no longer keeps its attributes inline (CPython's shared-key instance values),
    and every attribute and method lookup on it, M*'s own admit and plan included, once per request a step, costs a
    tenth more. So the subclass adds three: ``reuse``, ``pool`` and this."""

    side: SideRows | None  # the pages' row outputs (PrefixReuse.row_outputs)
    evict_batch: int
    reused: frozenset  # labels whose pages are shared
    shadowed: frozenset  # labels measured in shadow
    agreement: TPAgreement | None
    fresh_rows: RowParts | None = None  # the last watched forward's rows, until its step commits
    watched: set = dataclasses.field(default_factory=set)
    lifecycles: dict = dataclasses.field(default_factory=dict)  # label -> PrefixLifecycle
    named: dict = dataclasses.field(default_factory=dict)  # label -> rid -> its stream's names (_Named)
    due: dict = dataclasses.field(default_factory=dict)  # streams whose announced feed reaches a page end, in order
    landing: collections.deque = dataclasses.field(default_factory=collections.deque)  # _Landing, oldest first
    shadows: dict = dataclasses.field(default_factory=dict)  # label -> ShadowIndex
    # (rid, label) -> (prompt length, position -> ids fed there; None after a walk no ids describe)
    shadow_fed: dict = dataclasses.field(default_factory=dict)


class ReuseKVManager(KVManager):
    """M*'s ``KVManager`` on a counted pool with prefix reuse (see the module docstring)."""

    def __init__(self, cfg, name, joint_comm_group, transfer_engine_info, device, dtype=torch.bfloat16,
                 reuse: PrefixReuse | None = None):
        super().__init__(cfg, name, joint_comm_group, transfer_engine_info, device, dtype)
        self.reuse = reuse
        self.pool = PagePool.over(self.kv_cache.tensor, page_dim=1, eviction=reuse.eviction if reuse else None)
        batch = max(1, (reuse.evict_batch_pages if reuse and reuse.evict_batch_pages else self.pool.num_pages // 64))
        self._lock = self.pool.cache_lock
        side = None  # row outputs per page (PrefixReuse.row_outputs)
        if reuse is not None and reuse.row_outputs is not None and not reuse.shadow:
            if reuse.tiers is not None:
                raise InvalidRequest(f"KV {name}: row outputs are kept on the device only and a page copied up from "
                                     "a lower tier carries none: give PrefixReuse tiers or row_outputs, not both")
            side = SideRows(self.pool.num_pages, self.config.page_size, reuse.row_outputs, self.kv_cache.tensor.device)
        self._arena.allocator = CountedPageAllocator(self.pool, batch, side)
        if self._arena.acquire(1) != [SINK_PAGE]:
            raise InvalidRequest(f"KV {name}: page {SINK_PAGE} must be the sink page")
        labels = frozenset(reuse.labels) if reuse is not None else frozenset()
        reused = labels if reuse is not None and not reuse.shadow else frozenset()
        agreement = None
        if joint_comm_group is not None and joint_comm_group.world_size > 1:
            if joint_comm_group.sp_group.world_size > 1:
                raise InvalidRequest("prefix reuse agrees over the TP group; sequence parallelism is not supported")
            agreement = TPAgreement(joint_comm_group.tp_group.device_group)
        self._mm = _ReuseState(side=side, evict_batch=batch, reused=reused, shadowed=labels - reused,
                               agreement=agreement)

    @property
    def side(self) -> SideRows | None:
        """The pages' row outputs (``PrefixReuse.row_outputs``), or None."""
        return self._mm.side

    @classmethod
    def build(cls, spec: KVSpec, info):
        return cls(cfg=spec.config, name=spec.resource_key, device=info.device,
                   joint_comm_group=info.joint_comm_group, transfer_engine_info=info.transfer_engine_info,
                   dtype=info.kv_dtype, reuse=getattr(spec, "reuse", None))

    # ----------------------------------------------------------------- the seam (mmcache.mstar.switch)
    def reuses(self, label: str) -> bool:
        """Whether the seam feeds ``label``'s steps here (reused, or measured in shadow)."""
        return label in self._mm.reused or label in self._mm.shadowed

    def fingerprint(self, label: str) -> Fingerprint:
        """What roots ``label``'s page names: the weights, this rank, the KV layout and the label."""
        r = self.reuse
        return Fingerprint(model=r.model, tp_rank=self._rank, tp_size=self._world_size,
                           kv_dtype=str(self.kv_cache.dtype), attention_backend=r.attention_backend,
                           page_size=self.config.page_size, extra=f"{self.name}/{label}")

    def lifecycle(self, label: str) -> PrefixLifecycle:
        """The prefix lifecycle of ``label`` (made on first use)."""
        life = self._mm.lifecycles.get(label)
        if life is None:
            r, fp = self.reuse, self.fingerprint(label)
            tiers = r.tiers(fp, self.pool) if r.tiers is not None else None
            observer = r.observer(fp, self.pool) if r.observer is not None else None
            life = self._mm.lifecycles[label] = PrefixLifecycle(
                self.pool, fp, evict_batch_pages=self._mm.evict_batch, tiers=tiers, agreement=self._mm.agreement,
                observer=observer)
        return life

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
        if label not in self._mm.reused:
            return self._shadow_feed(rid, label, token_ids, media, salt, length) if label in self._mm.shadowed else 0
        if token_ids is None and media and length:
            token_ids = np.zeros(int(length), dtype=np.int32)  # placeholders: the marks carry what the rows hold
        named = self._mm.named.get(label, {}).get(rid)
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
                named.claim.add_media([(held + int(o), d) for o, d in media], self.config.page_size)
                named.media_upto = held + n
            if (held >= named.prompt_len and n > 1
                    and (servable := self._servable(rows_needed, whole)) is not False):
                cut = self._continue(named, held, token_ids, servable)
                token_ids, start = (token_ids[cut:] if cut else token_ids), held + cut
                named.continued = (held, cut, n) if cut else None
        named.pending = (start, token_ids, n - cut)
        if named.covered and start + n - cut >= named.due:
            with self._lock:
                self._mm.due[named] = None  # a page fills in this step: commit indexes it
        return cut

    def marks_taken(self, rid: str, label: str) -> bool:
        """Whether (``rid``, ``label``)'s stream stands inside the walk whose media marks it took last (the prompt's,
        for its first feed): that walk is not written (a step that runs writes all it was fed, through where its
        marks end), so a walk fed now is that one again, after ``AllocationFailed``. ``feed`` reads such a walk's
        marks only for being there (the stream's names hold them already), so the caller may hand it the marks it
        announced for the walk instead of naming its rows again. False for a stream not named (none yet, or
        forgotten: a reset request is named afresh, from the marks it is fed), and in shadow."""
        named = self._mm.named.get(label, {}).get(rid)
        return named is not None and self._marks_taken(named)

    @staticmethod
    def _marks_taken(named: _Named) -> bool:
        return named.stream.stored_len < named.media_upto

    def feed_rows(self, label: str, rows: dict) -> list:
        """The one-row feeds of a step at once (a decode step's): for each ``rid -> ids`` (one id) what
        ``feed(rid, label, ids)`` does for a stream already named, where a one-row feed is never cut (``_ROWS_LEFT``)
        and carries no media. The step's ids are joined into ints at once where they are on the host (``_step_ids``:
        one ``torch.cat`` a step, where keeping each request's tensor until its page fills costs a join of a page of
        one-element views per stream). Returns the rids left to ``feed`` (a stream not named yet, a label in
        shadow)."""
        if label not in self._mm.reused:
            return list(rows)
        left, due, named_of = [], [], self._mm.named.get(label, {})
        fed = list(rows.values())
        ints = _step_ids(fed) if fed else None
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
            with self._lock:
                for named in due:
                    self._mm.due[named] = None  # a page fills in this step: commit indexes it
        return left

    def _shadow_feed(self, rid: str, label: str, token_ids, media: Sequence, salt: bytes, length: int | None) -> int:
        """Shadow mode: the first feed of a stream is looked up in the label's ``ShadowIndex`` (named outside the
        pool's lock; a walk of embeddings by its marks, as ``feed`` names it); later feeds are kept by the position
        they write (a retried step overwrites its own) until a walk no ids describe. Cuts nothing."""
        key = (rid, label)
        seen = self._mm.shadow_fed.get(key)
        if seen is None:
            if token_ids is None:
                if not media or not length:
                    return 0  # embeddings no marks describe: nothing of this stream is measured
                token_ids = np.zeros(int(length), dtype=np.int32)
            with self._lock:
                held = self._ensure_label(rid, label).stored_len
            if held:
                return 0  # a stream filled another way
            ids = as_tokens(token_ids)
            self.shadow_index(label).admit(rid, ids, media, salt)
            self._mm.shadow_fed[key] = (int(ids.size), {})
            return 0
        prompt_len, fed = seen
        held = self._streams[rid][label].stored_len
        if fed is None or held < prompt_len:
            return 0  # after an unnamed walk, or a retried prefill
        if token_ids is None:
            self._mm.shadow_fed[key] = (prompt_len, None)
        else:
            fed[held] = as_tokens(token_ids)
        return 0

    def shadow_index(self, label: str) -> ShadowIndex:
        """``label``'s shadow table (made on first use)."""
        shadow = self._mm.shadows.get(label)
        if shadow is None:
            shadow = self._mm.shadows[label] = ShadowIndex(self.fingerprint(label), rows_left=_ROWS_LEFT)
        return shadow

    def shadow_stats(self, label: str) -> ShadowStats:
        """What reuse would have matched on ``label`` so far (``ShadowIndex.stats``)."""
        return self.shadow_index(label).stats()

    def _end_shadow(self, rid: str, finished: bool) -> None:
        """``rid`` left (``finished``: its pages of prompt + what was fed after it go into the table) or was reset."""
        for key in [k for k in self._mm.shadow_fed if k[0] == rid]:
            (at, fed), shadow = self._mm.shadow_fed.pop(key), self._mm.shadows[key[1]]
            if not finished:
                shadow.abort(rid)
                continue
            out = []
            while fed and at in fed:
                out.append(fed[at])
                at += out[-1].size
            shadow.finish(rid, np.concatenate(out) if out else ())

    def _servable(self, rows_needed: bool, whole: bool = False):
        """What a feed may be served: any verified page (None), pages whose row outputs are all held (a check), or,
        for a step computed in full or needing rows no ``SideRows`` holds, nothing (False)."""
        if whole:
            return False
        if not rows_needed:
            return None
        return self._mm.side.servable if self._mm.side is not None else False

    def _first_feed(self, rid: str, label: str, token_ids, media: Sequence, salt: bytes, servable) -> int:
        if token_ids is None:
            return 0
        ids = as_tokens(token_ids)
        with self._lock:
            stream = self._ensure_label(rid, label)
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
        P, stream, claim = self.config.page_size, named.stream, named.claim
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
        with self._lock:
            if own:  # the cached page stands in for the stream's own, whose positions it holds the same way
                self._arena.release(stream.page_indices[-1:])
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
        return self._streams[rid][label].stored_len

    # ----------------------------------------------------------------- row outputs (PrefixReuse.row_outputs)
    def watch(self, submodule) -> None:
        """Put ``RowOutputs.watch`` on ``submodule`` once (the seam calls it for the node whose steps it feeds)."""
        if self._mm.side is not None and id(submodule) not in self._mm.watched:
            self._mm.watched.add(id(submodule))
            self.reuse.row_outputs.watch(submodule, self._record_rows)

    def _record_rows(self, parts: RowParts) -> None:
        self._mm.fresh_rows = parts

    def held_rows(self, rid: str, label: str, lo: int, hi: int) -> torch.Tensor:
        """The row outputs of positions ``lo..hi-1`` of (``rid``, ``label``)'s stream (a copy: a cut walk's held
        rows, read before its step runs)."""
        with self._lock:
            return self._mm.side.read(self._streams[rid][label].page_indices, lo, hi)

    def admit(self, step, ctx):
        self._mm.fresh_rows = None  # rows are taken only from the forward between a step's admit and its commit
        return super().admit(step, ctx)

    def _rows_to_write(self, step) -> tuple | None:
        """Before ``step`` commits: ``(spans, parts)``, ``spans`` the ``(stream, first position, rows, first row)`` of
        each of its segments on a reused label (row offsets counted over every segment in order: the forward packs its
        rows so), ``parts`` the watched forward's rows; None when no watched forward ran since the step's admit (a
        replayed graph runs no hook) or its rows do not match the step."""
        parts, self._mm.fresh_rows = self._mm.fresh_rows, None
        if parts is None or not step.commit:
            return None
        spans, row = [], 0
        for seg in step.segments:
            if seg.label in self._mm.reused and seg.span > 0:
                stream = self._streams[seg.request_id][seg.label]
                spans.append((stream, stream.stored_len, seg.span, row))
            row += seg.span
        return (spans, parts) if spans and row == parts[0].shape[0] else None

    def _write_rows(self, todo: tuple) -> None:
        """Store the rows ``_rows_to_write`` found, of the segments the step committed (a stream offloaded mid-step
        committed nothing)."""
        spans, parts = todo
        done = [(s.page_indices, lo, n, r) for s, lo, n, r in spans if s.stored_len == lo + n]
        if done:
            self._mm.side.write(done, parts)

    def _match(self, rid: str, label: str, ids: np.ndarray, media: Sequence, salt: bytes, rows_left: int,
               servable=None) -> int:
        life = self.lifecycle(label)
        prompt = life.name(ids, media, salt, what=f"request {rid!r} label {label!r}")
        # outside the lock: a group agreement may wait for other ranks
        claim, match = life.match(prompt, rows_left, servable)
        if match.fetch is not None:
            match.fetch.wait()  # pages copied up from a tier: read none before they arrived
        k = len(match.pages) * self.config.page_size
        with self._lock:
            stream = self._ensure_label(rid, label)
            stream.page_indices = list(match.pages)
            stream.stored_len = k
            stream.generation += 1
            P = self.config.page_size
            named = self._mm.named.setdefault(label, {})[rid] = _Named(
                claim, life, stream, int(ids.size), k, (k // P + 1) * P, pending=(k, ids[k:], int(ids.size) - k),
                media_upto=int(ids.size))
            if ids.size >= named.due:
                self._mm.due[named] = None
        return k

    # ----------------------------------------------------------------- M*'s lifecycle, owner-counted
    def commit(self, step, ctx):
        with self._lock:
            rows = self._rows_to_write(step) if self._mm.side is not None else None
            super().commit(step, ctx)
            if rows is not None:
                self._write_rows(rows)
            if step.commit and (self._mm.due or self._mm.landing):
                self._commit_due()

    def _commit_due(self) -> None:
        """Index the pages that filled: of the streams whose announced feed reaches a page end (``due``), those
        whose feed is now written; their fed ids joined at once (``_flush``), then one ``commit_many`` per label. Ids
        on a CUDA device are copied to the host without waiting (``_park``) and their pages indexed at a later commit,
        once the copy has landed (``_land``). A stream whose step has not committed yet stays."""
        if self._mm.landing:
            self._land(wait=False)
        ready = []
        for named in list(self._mm.due):
            stream = named.stream
            self._settle(named, stream.stored_len, unwritten_stays=True)
            if named.pending is not None:
                continue
            del self._mm.due[named]
            if named.covered and min(stream.stored_len, named.named) >= named.due:
                ready.append(named)
        if ready and not self._park(ready):
            self._index_written(ready, self._flush(ready))

    def _index_written(self, streams: Sequence[_Named], joined: Sequence[bool]) -> None:
        """``commit_many`` (one per label) of the pages ``streams`` wrote and named, for each whose ids ``joined``
        into ``generated``; the next page end each is due at."""
        P, written = self.config.page_size, {}
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
        """Start the host copy of ``streams``' chunks when they are device tensors (``ids_to_host``); their pages are
        indexed when it lands, and each is due at its next page end meanwhile. False (nothing changed) otherwise."""
        first = next((named.chunks[0] for named in streams if named.chunks), None)
        if first is None or type(first) is int:  # ids joined when fed (``_step_ids``) are on the host
            return False
        started = ids_to_host([named.chunks for named in streams if named.chunks])
        if started is None:
            return False
        sizes = [named.named - named.prompt_len - named.generated.size - named.in_flight for named in streams]
        if started[0].numel() != sum(sizes):
            return False
        P = self.config.page_size
        for named, size in zip(streams, sizes):
            named.chunks, named.in_flight = [], named.in_flight + size
            named.due = (min(named.stream.stored_len, named.named) // P + 1) * P
        self._mm.landing.append(_Landing(streams, sizes, *started))
        return True

    def _land(self, wait: bool) -> None:
        """Index the pages of every parked step whose ids reached the host, oldest first (a stream's ids join its
        ``generated`` in the order it fed them); stop at the first copy still running, or, with ``wait``, wait for
        every one. A stream forgotten meanwhile gets nothing indexed (its pages may be gone); a fed id that is no
        token id stops its own stream's naming, as on the host."""
        with self._lock:
            while self._mm.landing:
                landing = self._mm.landing[0]
                if not wait and not landing.event.query():
                    return
                landing.event.synchronize()
                self._mm.landing.popleft()
                joined, at = [], 0
                for named, size in zip(landing.streams, landing.sizes):
                    part, at = landing.host[at:at + size], at + size
                    named.in_flight -= size
                    # still named: no bad id stopped the stream's names since (``_stop_naming`` cuts them to the prompt)
                    ok = named.live and named.named >= named.prompt_len + named.generated.size + size
                    if ok:
                        try:
                            _append_generated(named, as_tokens(part))
                        except InvalidRequest:
                            ok = self._stop_naming(named)
                    joined.append(ok)
                self._index_written(landing.streams, joined)

    def _flush(self, streams: Sequence[_Named]) -> list[bool]:
        """Join each stream's chunks fed since its last flush to its int32 ``generated`` (which then holds the ids of
        positions ``prompt_len..named-1``), after any still on their way to the host (``_land``, waited for): every
        stream's chunks in one join, split by what each stream's names cover; a stream whose chunks do not join so is
        joined alone. Per stream: False (and nothing of it from here on is named) when a fed id is no token id."""
        if self._mm.landing:
            self._land(wait=True)
        todo = [named for named in streams if named.chunks]
        if len(todo) > 1:
            sizes = [named.named - named.prompt_len - named.generated.size for named in todo]
            try:
                joined = _joined_tokens(list(itertools.chain.from_iterable(named.chunks for named in todo)))
            except InvalidRequest:
                joined = None
            if joined is not None and joined.size == sum(sizes):
                at = 0
                for named, size in zip(todo, sizes):
                    _append_generated(named, joined[at:at + size])
                    named.chunks, at = [], at + size
                return [True] * len(streams)
        out = []
        for named in streams:
            chunks, named.chunks = named.chunks, []
            if chunks:
                try:
                    _append_generated(named, _joined_tokens(chunks))
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

    def reset_request(self, rid: str, free: bool = False):
        self._forget(rid, finished=False)  # first: the chain is touched while the stream still holds it
        if not free:
            with self._lock:
                for stream in self._streams.get(rid, {}).values():
                    if stream.page_indices and (self.pool.counts[stream.page_indices] > 1).any():
                        # M* would rewind onto these pages and overwrite KV that another owner still reads
                        self._arena.release(stream.page_indices)
                        stream.page_indices = []
        super().reset_request(rid, free)

    def remove_request(self, rid: str):
        self._forget(rid, finished=True)
        super().remove_request(rid)

    def _forget(self, rid: str, finished: bool) -> None:
        """``rid``'s streams are named no more; their chains are touched (done with them now)."""
        with self._lock:
            if self._mm.shadow_fed:
                self._end_shadow(rid, finished)
            if self._mm.landing:  # the request's last pages, as a rule landed already: index them while it holds them
                self._land(wait=False)
            for of_label in self._mm.named.values():
                named = of_label.pop(rid, None)
                if named is None:
                    continue
                named.live = False
                self._mm.due.pop(named, None)
                named.life.touch(named.claim)

    def reclaimable(self, rid: str) -> int:
        """What ``offload(rid)`` frees now (``_freeable``): 0 when it would move nothing."""
        with self._lock:
            streams = self._streams.get(rid)
            return 0 if streams is None else self._freeable((label, s.page_indices) for label, s in streams.items())

    def offload(self, rid: str) -> int:
        """M*'s offload of every stream of ``rid``, only when it frees a page: returns the pages it freed
        (``_freeable``, counted when the copies are committed), and 0 exactly when nothing moved (M*'s worker then
        picks another victim, and the request runs on)."""
        if not self.reclaimable(rid):
            return 0  # no host copy for nothing; a change before the commit is caught there
        return super().offload(rid)

    def _commit_offload(self, rid, moved):
        with self._lock:
            freed = self._freeable((c.label, c.pages) for c in moved)
            if not freed:  # other live streams took every page meanwhile: M* abandons the claims, nothing moves
                return 0, set()
            _, labels = super()._commit_offload(rid, moved)
            return (freed if labels else 0), labels

    def _freeable(self, streams) -> int:
        """Of the ``(label, pages)`` of one request's streams, the pages no other live stream holds: released, each
        is free, or held by its label's index alone (an eviction candidate, which M*'s ``num_free`` counts). Labels
        never share pages, and a stream lists a page once. Under the lock."""
        counts, n = self.pool.counts, 0
        for label, pages in streams:
            if pages:
                others = counts[pages] - 1
                life = self._mm.lifecycles.get(label)
                if life is not None:
                    others -= life.index.indexed[pages]
                n += int((others == 0).sum())
        return n

    # ----------------------------------------------------------------- stats
    def stats(self, label: str) -> PrefixCacheStats:
        """``label``'s lifecycle counters and the node's pool; ``pages_live``: distinct pages its live streams hold.
        ``eviction_batches``, ``shortfall_pages`` and ``stalls`` are the node's (``shortfalls``), the same for every
        label: M*'s arena takes every stream's pages, whatever its label. ``evicted_pages``: pages that left
        ``label``'s index."""
        with self._lock:
            held = [s.page_indices for streams in self._streams.values() for lab, s in streams.items()
                    if lab == label and s.page_indices]
            live = int(np.unique(np.concatenate(held)).size) if held else 0
            n = sum(1 for streams in self._streams.values() if label in streams)
            return dataclasses.replace(self.lifecycle(label).stats(live, n), **self.shortfalls())

    def shortfalls(self) -> dict[str, int]:
        """The node's shortfalls since creation, each counted once where it happened: M*'s arena (the allocator's
        ``counters``) and every label's host tier copying pages up (its index's counters)."""
        with self._lock:
            out = dict(self._arena.allocator.counters)
            for life in self._mm.lifecycles.values():
                for k in out:
                    out[k] += life.index.counters[k]
            return out
