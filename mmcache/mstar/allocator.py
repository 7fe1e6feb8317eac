"""PrefixPagedAllocationManager: M*'s ``PagedAllocationManager`` with owner counts and exact prefix reuse.

A subclass of M*'s class (imported from the vendored source at runtime), so everything M* reads and writes is M*'s
own: the constructor ``(config, kv_cache, transfer_engine_info)``, ``request_states`` of real ``KVRequestState``
objects that the cache manager mutates (``state.seq_len += n``), ``get_state`` creating a label on first access,
grow-only ``alloc`` raising ``AllocationFailedError(pages_short, request_id, label)`` before changing anything,
``reset_label(free=False)`` for the cuda-graph state swap, the remote-read methods. What differs:

- Pages come from a ``PagePool`` (owner counts) through ``page_allocator`` (a ``CountedPageAllocator``): ``free``
  drops one owner, so a page a request and the prefix index both hold stays until both let go.
- Labels: one pool and one KV tensor for all labels of the node (as in M*), one ``PrefixIndex`` per label on that
  pool (labels never share pages: a "main" page is never matched for "cfg_text").
- Lookup: ``match_prefix(rid, label, token_ids, media, salt)`` before the first prefill allocation of a (request,
  label) retains the verified cached prefix and leaves the state exactly as if it had prefilled those tokens
  (``page_indices`` = the matched pages, ``seq_len`` = ``position_id_start`` = matched tokens); the caller then
  prefills only ``token_ids[matched:]``. Generated ids reach the manager through ``append_tokens``.
- Teardown (``remove_request``): every full page whose KV is written (``seq_len``) and whose ids are known (prompt +
  appended) moves to the label's index; the rest is released. ``reset_label`` releases without indexing.
- Eviction: a shortfall evicts the coldest cached pages of the node's pool (every label's index, and an
  ``EncoderStore`` built on the same pool: ``EncoderStore(pool=m.pool, page_data=m.kv_cache, page_dim=1)``) by
  recency on the pool's one clock (``mmcache.reclaim``, one place) before ``AllocationFailedError``, whose
  ``pages_short`` then counts what live requests and pins alone lack. The manager's ``_lock`` is the pool's
  ``cache_lock``, so the encoder store and M*'s allocation path serialize on one lock.
- Offload suspends, never tears down: the claim (prompt ids, names) survives; a label is offloaded only if the CPU
  pool took its pages, otherwise it stays resident (M* frees the GPU pages anyway and loses the KV).

- Batched allocation: ``try_alloc_many`` gives a plan's requests the very pages their ``alloc`` calls in turn would
  (one lock hold, one pool take) or changes nothing; ``mmcache.mstar.cache_manager`` has M*'s cache manager use it.
  ``alloc`` returns without the lock when the pages already cover ``seq_len`` (a request's pages only grow while
  it plans), the common case of a decode step.

``reuse=None`` is today's M*: no index, nothing retained or matched, ``match_prefix`` returns 0.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Hashable, Sequence

import numpy as np
import torch

from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.mstar.vendor import import_mstar
from mmcache.names import Fingerprint, NamedPrompt, as_tokens
from mmcache.pool import PagePool
from mmcache.prefix_index import PrefixIndex
from mmcache.reclaim import make_room, reclaimable
from mmcache.stats import PrefixCacheStats

import_mstar()
from mstar.communication.tensors import LocalTransferEngine  # noqa: E402
from mstar.engine import kv_store  # noqa: E402
from mstar.engine.kv_store import (  # noqa: E402
    AllocationFailedError, KVCacheConfig, KVTransferEngine, PageAllocator, PagedAllocationManager, TransferEngineInfo,
)

logger = logging.getLogger(__name__)


class CountedPageAllocator(PageAllocator):
    """M*'s ``PageAllocator`` interface over a ``PagePool``: ``allocate``/``try_allocate`` take pages with one owner,
    ``free`` drops one owner per listed page (the pool frees a page when its count reaches 0).

    ``reclaim(n)``, when given, is called before taking ``n`` pages to evict cached pages on a shortfall (it raises
    ``OutOfPages`` and evicts nothing when even that would not cover it). Thread-safe: the pool's lock makes each
    take atomic; M*'s manager calls it under its own lock, so reclaim-then-take is atomic too.
    """

    def __init__(self, max_num_pages: int | PagePool, reclaim: Callable[[int], None] | None = None):
        self.pool = max_num_pages if isinstance(max_num_pages, PagePool) else PagePool(max_num_pages)
        self.max_num_pages = self.pool.num_pages
        self._lock = self.pool.lock
        self._reclaim = reclaim

    def try_allocate(self, n: int) -> list[int] | None:
        try:
            if self._reclaim is not None:
                self._reclaim(n)
            return self.pool.alloc(n)
        except OutOfPages:
            return None

    def allocate(self, n: int) -> list[int]:
        pages = self.try_allocate(n)
        if pages is None:
            raise RuntimeError(f"Not enough free pages: requested {n}, available {self.num_free}")
        return pages

    def free(self, pages: list[int]) -> None:
        self.pool.release(pages)

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def free_pages(self):  # M*'s attribute is a queue; nothing outside kv_store reads it
        raise AttributeError("a CountedPageAllocator has no free-page queue; use num_free")


@dataclasses.dataclass(frozen=True)
class PrefixReuse:
    """Turns reuse on. ``fingerprint`` names everything KV bytes depend on (weights, TP slicing, KV dtype, attention
    backend); its ``page_size`` must equal the KV cache's. ``labels``: the labels whose KV token ids describe (None:
    every label). ``evict_batch_pages``: least pages one eviction frees (default 1/64 of the pool)."""

    fingerprint: Fingerprint
    labels: tuple[str, ...] | None = None
    evict_batch_pages: int | None = None


@dataclasses.dataclass(slots=True, eq=False)
class _Claim:
    """What names a (request, label)'s KV: its named prompt, salt id, and the generated ids appended so far."""

    prompt: NamedPrompt
    salt_id: int
    generated: list[int]


class CPUKVTransferEngine(KVTransferEngine):
    """In-process remote reads for a KV cache on the CPU, where M*'s CUDA-IPC engine cannot run: the transfer info
    is the tensor itself and a read is a synchronous copy (no future)."""

    def __init__(self, kv_cache: torch.Tensor):
        self._kv_cache = kv_cache

    def get_kv_transfer_info(self) -> torch.Tensor:
        return self._kv_cache

    def read_batched_async(self, remote_kv_info: torch.Tensor, read_info) -> None:
        for info in read_info:
            self._kv_cache[info.layer_idx, info.local_page_idx, :, info.token_start:info.token_end] = \
                remote_kv_info[info.layer_idx, info.remote_page_idx, :, info.token_start:info.token_end]
        return None

    def shutdown(self) -> None:
        pass


class PrefixPagedAllocationManager(PagedAllocationManager):
    """M*'s manager with owner counts and a prefix index per label; see the module docstring for the contract.

    ``pool``: the node's ``PagePool`` (``config.max_num_pages`` pages, page id = index in the KV tensor's dim 1);
    by default a metadata-only one, since M* owns the KV tensor. Other caches on the node (an encoder store) join it
    by being built on that pool (they register on it and share its clock and ``cache_lock``).
    """

    def __init__(self, config: KVCacheConfig, kv_cache: torch.Tensor, transfer_engine_info: TransferEngineInfo,
                 *, reuse: PrefixReuse | None = None, pool: PagePool | None = None):
        if kv_cache is not None and kv_cache.device.type != "cuda" and \
                isinstance(transfer_engine_info.transfer_engine, LocalTransferEngine):
            self._init_cpu(config, kv_cache, transfer_engine_info)
        else:
            super().__init__(config, kv_cache, transfer_engine_info)
        self._init_reuse(reuse, pool)

    def _init_cpu(self, config, kv_cache, transfer_engine_info) -> None:
        """M*'s constructor body for a KV cache off the GPU, with in-process reads in place of the CUDA-IPC engine
        (``storage._share_cuda_()`` needs CUDA). Mirrors kv_store.py:466-497; ``page_allocator`` and ``_lock`` (the
        pool's) are set after, by ``_init_reuse``."""
        self.config = config
        self.request_states = {}
        self.kv_cache = kv_cache
        self.write_policy = kv_store.StoreWritePolicy.ALWAYS
        self._kv_transfer_engine = CPUKVTransferEngine(kv_cache)
        self._offload_stream = None
        self.pending_reads = {}

    def _init_reuse(self, reuse, pool) -> None:
        config = self.config
        if pool is None:
            pool = PagePool(config.max_num_pages)
        if pool.num_pages != config.max_num_pages:
            raise InvalidRequest(f"the pool has {pool.num_pages} pages; the KV cache {config.max_num_pages}")
        if reuse is not None and reuse.fingerprint.page_size != config.page_size:
            raise InvalidRequest(f"fingerprint page_size {reuse.fingerprint.page_size} != KV page_size "
                                 f"{config.page_size}")
        self.pool = pool
        self.reuse = reuse
        self._lock = pool.cache_lock  # an RLock, as M*'s: every cache on the node's pool evicts under it
        self._batch = max(1, (reuse.evict_batch_pages if reuse else None) or pool.num_pages // 64)
        self.indexes: dict[str, PrefixIndex] = {}   # label -> index, created on a label's first match
        self._claims: dict[tuple[Hashable, str], _Claim] = {}
        self.page_allocator = CountedPageAllocator(pool, reclaim=self._reclaim)

    @classmethod
    def replacing(cls, manager: PagedAllocationManager, reuse: PrefixReuse | None = None,
                  **kwargs) -> "PrefixPagedAllocationManager":
        """A drop-in for ``manager`` (no request added yet) on its config, KV tensor and transfer engine."""
        if manager.request_states:
            raise InvalidRequest("replace the allocation manager before any request is added")
        self = cls.__new__(cls)
        self.__dict__.update(manager.__dict__)
        self.request_states, self.pending_reads = {}, {}
        self._init_reuse(reuse, kwargs.get("pool"))
        return self

    # ----------------------------------------------------------------- reuse
    def match_prefix(self, request_id: Hashable, label: str, token_ids, media: Sequence = (),
                     salt: bytes = b"") -> int:
        """Before the first prefill of (request, label): reuse the longest verified cached prefix of ``token_ids``
        (full pages only, never the last prompt token). The state then holds the matched pages with ``seq_len`` =
        ``position_id_start`` = the matched token count, which is returned; prefill ``token_ids[matched:]``.

        ``media``: ``(offset, digest)`` marks of the media placeholders; ``salt``: tenant isolation. Raises
        ``InvalidRequest`` (changing nothing) if the label already holds pages or KV. With reuse off, returns 0.
        """
        if request_id not in self.request_states:
            raise InvalidRequest(f"request {request_id!r} was never added")
        if not self._reuses(label):
            return 0
        P = self.config.page_size
        prompt = NamedPrompt.build(self.reuse.fingerprint, token_ids, media, salt, what=f"request {request_id!r}")
        tokens, limit = prompt.tokens, prompt.matchable
        with self._lock:
            state = self.get_state(request_id, label)
            if state.page_indices or state.seq_len or (request_id, label) in self._claims:
                raise InvalidRequest(f"request {request_id!r}: label {label!r} already holds KV; match_prefix comes "
                                     f"before its first prefill")
            index = self._index(label)
            salt_id = index.salt_id(salt)
            idx = index.match(prompt.names[:limit], tokens, prompt.media_ids(limit), salt_id)
            self.pool.retain(idx, distinct=True)
            index.touch(idx)
            k = idx.size * P
            state.page_indices = idx.tolist()
            state.seq_len = state.position_id_start = k
            self._claims[(request_id, label)] = _Claim(prompt, salt_id, [])
            c = index.counters
            c["queries"] += 1
            c["hits"] += bool(k)
            c["queried_tokens"] += int(tokens.size)
            c["hit_tokens"] += k
            return k

    def append_tokens(self, request_id: Hashable, label: str, token_ids) -> None:
        """Generated ids of (request, label), in order: at teardown their written full pages are indexed too. A label
        without a ``match_prefix`` ignores them (its KV is not named)."""
        ids = as_tokens(token_ids)
        with self._lock:
            claim = self._claims.get((request_id, label))
            if claim is not None:
                claim.generated.extend(ids.tolist())

    def try_alloc_many(self, request_ids: Sequence[Hashable], label: str, seq_lens: Sequence[int], *,
                       added: bool = False) -> bool:
        """``alloc(rid, label, n)`` for each pair in turn, in one lock hold and one pool take, when the free pages
        cover the whole batch: each request gets exactly the pages its own ``alloc`` would have given it, in the same
        order. ``added=True``: ``seq_lens`` count the tokens a plan adds beyond each state's ``seq_len`` (as M*'s
        ``plan_attention`` takes them).

        Returns False and changes nothing when the free pages do not cover the batch (covering it would evict, or
        fail), a request or its label does not exist yet, a request is listed twice, or the lengths do not pair up:
        the caller then allocs per request, which creates, evicts and raises (``AllocationFailedError`` for the
        request that cannot fit) exactly as M*'s loop does. Returns True at once when every request is covered."""
        if len(request_ids) != len(seq_lens):
            return False
        P = self.config.page_size
        with self._lock:
            rs = self.request_states
            try:
                states = [rs[rid][label] for rid in request_ids]
            except KeyError:
                return False
            if added:
                needs = [(s.seq_len + n + P - 1) // P - len(s.page_indices) for s, n in zip(states, seq_lens)]
            else:
                needs = [(n + P - 1) // P - len(s.page_indices) for s, n in zip(states, seq_lens)]
            grow = [i for i, n in enumerate(needs) if n > 0]
            if not grow:
                return True
            if len(set(request_ids)) != len(request_ids):
                return False  # a request listed twice: its second alloc sees the first one's pages
            pages = self.pool.alloc_split([needs[i] for i in grow])  # requests that take none change nothing
            if pages is None:
                return False
            for i, got in zip(grow, pages):
                states[i].page_indices.extend(got)
            return True

    def alloc_many(self, request_ids: Sequence[Hashable], label: str, seq_lens: Sequence[int]) -> None:
        """``alloc`` for a batch, with M*'s per-request semantics: ``try_alloc_many`` when the free pages cover it,
        else ``alloc`` for each request in turn (evicting cached pages as needed; the first request that cannot fit
        raises ``AllocationFailedError`` with its own shortfall, the requests before it keep their pages)."""
        if len(request_ids) != len(seq_lens):
            raise InvalidRequest(f"{len(request_ids)} requests but {len(seq_lens)} sequence lengths")
        if not self.try_alloc_many(request_ids, label, seq_lens):
            for rid, n in zip(request_ids, seq_lens):
                self.alloc(rid, label, n)

    def stats(self, label: str) -> PrefixCacheStats:
        """The label's index counters plus the node pool's page counts (live = held by a request)."""
        with self._lock:
            index = self.indexes.get(label)
            counters = index.counters if index else dict.fromkeys(PrefixCacheStats.__dataclass_fields__, 0)
            counters = {k: counters.get(k, 0) for k in PrefixCacheStats.__dataclass_fields__}
            live = len({p for labels in self.request_states.values() for s in labels.values() for p in s.page_indices})
            cached = len(index) if index else 0
            return PrefixCacheStats(**{**counters, "pages_free": self.pool.num_free, "pages_live": live,
                                       "pages_cached": cached,
                                       "requests_live": sum(label in ls for ls in self.request_states.values())})

    @property
    def num_reclaimable_pages(self) -> int:
        """Free pages plus cached pages an allocation could evict: what live requests can still get."""
        with self._lock:
            return self.pool.num_free + reclaimable(self.pool.evictables)

    # ----------------------------------------------------------------- M*'s contract
    def alloc(self, request_id: str, label: str, seq_len: int):
        # Pages only grow while a request plans, so pages that already cover seq_len need no lock: the common case
        # of a decode step, and every call of M*'s plan loop after ``try_alloc_many`` gave the batch its pages.
        if len(self.request_states[request_id][label].page_indices) * self.config.page_size >= seq_len:
            return
        with self._lock:
            state = self.request_states[request_id][label]
            need = -(-seq_len // self.config.page_size) - len(state.page_indices)
            if need > 0:
                state.page_indices.extend(self._take(need, request_id, label))

    def reset_label(self, request_id: str, label: str, free: bool = True):
        self.wait_for_retrieves(request_id, label)
        with self._lock:
            self._claims.pop((request_id, label), None)
            if label in self.request_states[request_id] and free:
                self.page_allocator.free(self.request_states[request_id][label].page_indices)
            self.request_states[request_id][label] = self._new_state()

    def remove_request(self, request_id: str):
        for label in self.request_states[request_id]:
            self.wait_for_retrieves(request_id, label)
        with self._lock:
            for label, state in self.request_states[request_id].items():
                self._teardown(request_id, label, state)
            del self.request_states[request_id]
            del self.pending_reads[request_id]

    def offload_request(self, request_id: str, cpu_pool) -> int:
        """M*'s offload, except that a label whose pages the CPU pool cannot take stays resident (its KV is kept,
        nothing is freed for it) and the request's claim survives (suspension, not teardown)."""
        freed = 0
        with self._lock:
            labels = list(self.request_states[request_id].items())
        for label, state in labels:
            if not state.page_indices:
                continue
            self.wait_for_retrieves(request_id, label)
            if cpu_pool.num_free_pages < len(state.page_indices):
                logger.warning("CPU page pool full: %s/%s stays resident (%d pages)", request_id, label,
                               len(state.page_indices))
                continue
            cpu_pool.offload_pages(request_id, label, self.kv_cache, state.page_indices, state.seq_len,
                                   state.position_id_start)
            if label not in cpu_pool.offloaded.get(request_id, {}):
                continue  # refused after all: keep the pages
            with self._lock:
                freed += len(state.page_indices)
                self.page_allocator.free(state.page_indices)
                state.page_indices = []
                state.seq_len = 0
        return freed

    def reload_request(self, request_id: str, cpu_pool) -> None:
        """M*'s reload; pages come through eviction like any allocation (``AllocationFailedError`` if short)."""
        with self._lock:
            for label in list(cpu_pool.offloaded.get(request_id, {}).keys()):
                pages = self._take(len(cpu_pool.offloaded[request_id][label].cpu_page_indices), request_id, label)
                state = self.get_state(request_id, label)
                state.page_indices = pages
                state.seq_len, state.position_id_start = cpu_pool.reload_pages(request_id, label, self.kv_cache,
                                                                                pages)
        cpu_pool.sync()

    # ----------------------------------------------------------------- internals (callers hold self._lock)
    def _reuses(self, label: str) -> bool:
        return self.reuse is not None and (self.reuse.labels is None or label in self.reuse.labels)

    def _index(self, label: str) -> PrefixIndex:
        index = self.indexes.get(label)
        if index is None:
            index = self.indexes[label] = PrefixIndex(self.pool, self.config.page_size, self._batch)
        return index

    def _reclaim(self, n: int, label: str | None = None) -> None:
        """Evict cold cached pages of any cache on the pool for ``n`` pages, counted on ``label``'s index."""
        index = self.indexes.get(label)
        make_room(self.pool, n, self._batch, index.counters if index is not None else None)

    def _take(self, n: int, request_id, label: str) -> list[int]:
        try:
            self._reclaim(n, label)
            return self.pool.alloc(n)
        except OutOfPages as err:
            raise AllocationFailedError(
                pages_short=err.shortfall, request_id=request_id, label=label,
                message=f"Not enough free pages: requested {n}, available {self.pool.num_free} "
                        f"(after evicting every cached page, {err.shortfall} short)") from None

    def _teardown(self, request_id, label: str, state) -> None:
        """Index the full written pages of a claimed label (prompt + generated); release every other page."""
        claim = self._claims.pop((request_id, label), None)
        pages = state.page_indices
        if claim is None or not pages:
            self.page_allocator.free(pages)
            return
        written = min(state.seq_len, len(pages) * self.config.page_size)
        names, page_tokens, mids = claim.prompt.written_pages(np.asarray(claim.generated, dtype=np.int32), written)
        kept = set(self._index(label).insert(pages, names, page_tokens, mids, claim.salt_id))
        self.page_allocator.free([p for j, p in enumerate(pages) if j not in kept])


def install(engine, reuse: PrefixReuse | dict | None, *, batched_planning: bool = True,
            **kwargs) -> dict[str, PrefixPagedAllocationManager]:
    """Swap every self-attention ``PagedAllocationManager`` of a loaded M* ``KVCacheEngine`` (after ``load_model``,
    before ``warmup`` and any request) for a drop-in. ``reuse``: one ``PrefixReuse`` for every KV cache, or a mapping
    of ``KVCacheConfig.get_node_str()`` to one (a cache missing from it keeps reuse off). ``batched_planning``: the
    cache managers M* builds for those caches allocate a plan's pages in one call (``mmcache.mstar.cache_manager``;
    the same pages and errors as M*'s per-request loop). Returns the drop-ins by that key. Cross-attention pools keep
    M*'s manager."""
    from mmcache.mstar.cache_manager import use_batched_planning
    out = {}
    for key, kv_mgmt in engine.kv_management.items():
        this = reuse.get(key) if isinstance(reuse, dict) else reuse
        kv_mgmt.alloc_manager = out[key] = PrefixPagedAllocationManager.replacing(kv_mgmt.alloc_manager, this,
                                                                                  **kwargs)
        if batched_planning:
            for config in {id(c): c for c in (kv_mgmt.kv_cache_config, out[key].config)}.values():
                use_batched_planning(config)
    return out
