"""ReuseKVManager: M*'s own ``KVManager`` (mstar-ai 0.2.1) over mmcache's pool, with exact prefix reuse per label.

Built by M*'s engine like its own KV resource: a ``ReuseKVSpec`` (a ``KVSpec`` whose ``resource_class`` is this one)
goes through ``build_resource(spec, info)``. Everything M* reads and writes is M*'s: the ``CacheStream`` table, the KV
tensor, planning, ``write_kv``/``read_kv``, forks, transfers, offload. What differs:

- Pages come from a ``PagePool`` over M*'s KV tensor (one owner count per page; page 0 stays M*'s sink page). The
  arena's allocator is a ``CountedPageAllocator``: ``free`` drops one owner, a shortfall evicts the coldest cached
  pages of the node's pool (every label's index and an ``EncoderStore`` built on ``manager.pool``) before M* sees
  ``AllocationFailed``. M*'s ``_lock`` is the pool's ``cache_lock``: one lock for the streams, the indexes and the
  encoder store.
- One ``PrefixLifecycle`` per reused label (labels never share pages), driven by the reuse state machine of
  ``mmcache.mstar.reuse_state`` (``ReuseState``: what each state of a stream means and what is held when, the feed /
  settle / commit invariants; it imports nothing of M*). This class keeps M*'s hooks and hands it M*'s stream table:
  ``feed`` and ``feed_rows`` (called by the seam in the node's ``prepare_inputs``, ``mmcache.mstar.switch``) name
  what a step is about to write and say how many leading ids the stream holds already, which the seam cuts off; M*'s
  ``commit`` of a step then indexes the pages that filled (``ReuseState.commit``); ``remove_request`` and
  ``reset_request`` forget the request's names. M*'s GPU thread commits right after it launches the step's forward,
  so fed ids on a CUDA device (a decode step's sampled tokens) are never read there with a blocking copy: they are
  copied to pinned host memory behind an event (``ids_to_host``, looked up here at each commit, as ``step_ids`` at
  each ``feed_rows``: M*'s tests stand them in on this module), and their pages are indexed at the first commit after
  the copy landed.
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

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.eviction import DEFAULT_POLICY, check_policy
from mmcache.index_types import IndexObserver
from mmcache.lifecycle import LowerTier, PrefixLifecycle
from mmcache.mstar.fed_ids import ids_to_host, step_ids  # looked up here when called: M*'s tests stand them in
from mmcache.mstar.requirement import require_mstar
from mmcache.mstar.reuse_state import ReuseState
from mmcache.mstar.row_outputs import RowOutputs, RowParts, SideRows
from mmcache.names import Fingerprint
from mmcache.pool import PagePool
from mmcache.reclaim import reclaimable as reclaimable_pages
from mmcache.reclaim import take
from mmcache.shadow import ShadowIndex
from mmcache.stats import PrefixCacheStats, ShadowStats
from mmcache.tp import TPAgreement

require_mstar()
from mstar.engine.resources.kv.cache import PageAllocator  # noqa: E402
from mstar.engine.resources.kv.config import KVSpec  # noqa: E402
from mstar.engine.resources.kv.manager import CacheStream, KVManager  # noqa: E402
from mstar.engine.resources.kv.plan import SINK_PAGE  # noqa: E402


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



class ReuseKVManager(KVManager):
    """M*'s ``KVManager`` on a counted pool with prefix reuse (see the module docstring): M*'s hooks, over a
    ``ReuseState`` (``_mm``) that keeps the names."""

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
        root = None  # the weights, this rank and the KV layout; each label's fingerprint adds the label
        if reuse is not None:
            root = Fingerprint(model=reuse.model, tp_rank=self._rank, tp_size=self._world_size,
                               kv_dtype=str(self.kv_cache.dtype), attention_backend=reuse.attention_backend,
                               page_size=self.config.page_size, extra=self.name)
        self._mm = ReuseState(self.pool, self.config.page_size, self._streams, root=root, new_stream=CacheStream,
                              release=self._arena.release, tiers=reuse.tiers if reuse is not None else None,
                              observer=reuse.observer if reuse is not None else None, side=side, evict_batch=batch,
                              reused=reused, shadowed=labels - reused, agreement=agreement,
                              to_host=lambda chunks: ids_to_host(chunks))  # looked up here when called

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
        return self._mm.reuses(label)

    def fingerprint(self, label: str) -> Fingerprint:
        """What roots ``label``'s page names: the weights, this rank, the KV layout and the label."""
        return self._mm.fingerprint(label)

    def lifecycle(self, label: str) -> PrefixLifecycle:
        """The prefix lifecycle of ``label`` (made on first use)."""
        return self._mm.lifecycle(label)

    def feed(self, rid: str, label: str, token_ids, media: Sequence = (), salt: bytes = b"",
             length: int | None = None, rows_needed: bool = False, whole: bool = False) -> int:
        """A step is about to feed ``token_ids`` to (``rid``, ``label``): how many leading ids the stream holds
        already, which the caller cuts off (``ReuseState.feed``)."""
        return self._mm.feed(rid, label, token_ids, media, salt, length, rows_needed, whole)

    def marks_taken(self, rid: str, label: str) -> bool:
        """Whether (``rid``, ``label``)'s stream stands inside the walk whose media marks it took last
        (``ReuseState.marks_taken``)."""
        return self._mm.marks_taken(rid, label)

    def feed_rows(self, label: str, rows: dict) -> list:
        """The one-row feeds of a step at once (``ReuseState.feed_rows``, the ids joined by this module's
        ``step_ids``); returns the rids left to ``feed``."""
        return self._mm.feed_rows(label, rows, step_ids)

    def shadow_index(self, label: str) -> ShadowIndex:
        """``label``'s shadow table (made on first use)."""
        return self._mm.shadow.index(label)

    def shadow_stats(self, label: str) -> ShadowStats:
        """What reuse would have matched on ``label`` so far (``ShadowIndex.stats``)."""
        return self._mm.shadow.stats(label)

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

    # ----------------------------------------------------------------- M*'s lifecycle, owner-counted
    def commit(self, step, ctx):
        with self._lock:
            rows = self._rows_to_write(step) if self._mm.side is not None else None
            super().commit(step, ctx)
            if rows is not None:
                self._write_rows(rows)
            if step.commit and (self._mm.due or self._mm.due_rows or self._mm.landing):
                self._mm.commit()

    def reset_request(self, rid: str, free: bool = False):
        self._mm.forget(rid, finished=False)  # first: the chain is touched while the stream still holds it
        if not free:
            with self._lock:
                for stream in self._streams.get(rid, {}).values():
                    if stream.page_indices and (self.pool.counts[stream.page_indices] > 1).any():
                        # M* would rewind onto these pages and overwrite KV that another owner still reads
                        self._arena.release(stream.page_indices)
                        stream.page_indices = []
        super().reset_request(rid, free)

    def remove_request(self, rid: str):
        self._mm.forget(rid, finished=True)
        super().remove_request(rid)

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
