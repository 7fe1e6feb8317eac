"""mmcache under transformers' continuous-batching engine: a cache allocator for its full-attention layers whose blocks
are the pages of a ``PrefixCache``, so prefix matching is mmcache's verified lookup instead of the engine's hash table.

Turn it on for a model, then use the engine as usual (``init_continuous_batching``, ``generate_batch``)::

    mm = enable_prefix_cache(model)              # every engine built from this model from now on
    mm.set_salt("r1", b"tenant-a")               # optional, before add_request: tenants with salts share nothing
    manager = model.init_continuous_batching(continuous_batching_config=ContinuousBatchingConfig(...))

What changes inside the engine (and nothing else does: the scheduler, the model runner, the KV tensor are its own):

- matching: ``admit`` walks the page-name chain (fingerprint root, the request's salt) and compares the stored
  token ids before a block is used; a 64-bit collision costs a comparison, never a wrong block;
- completed blocks: the full blocks each forward writes are indexed before the next lookup (every request that
  wrote since in one ``mark_computed_many``, with the ids generated so far), so a request admitted while another
  runs shares what that one has written; at teardown a request's own are indexed and ``finish`` releases it (a
  cancelled request too, its KV is good), ``abort`` after them when the engine frees with ``no_cache`` (offload:
  nothing more is indexed), so nothing is ever de-duplicated by hash alone;
- eviction: the engine's free-block count is the pages no live request holds, so its safety margin never flushes
  the cache; ``grow`` evicts cached pages, in the order of the policy ``enable_prefix_cache(eviction=...)`` names,
  only as many as a live request is short (``evict_batch_pages=1``).

Page ``p`` of the ``PrefixCache`` is the engine's block ``p + reserved``, where ``reserved`` are the trash sectors'
blocks. The ``PagePool`` holds ids and owner counts only (``page_shape=()``): the KV stays in the engine's tensor.

Private API this relies on (transformers 5.24, ``TESTED_TRANSFORMERS``;
``tests/mmcache/hf/test_hf_continuous_batching.py`` fails when it moves): ``cache.ATTN_TYPE_TO_ALLOCATOR``, the
``CacheAllocator`` block-level methods, the ``CachePool`` fields ``free_sectors``, ``_free_blocks`` and
``num_reserved_sectors``, and ``PagedAttentionCache.search_prefix_match(request_id, prompt_ids)``, wrapped once to
pass the request id (the allocator's own ``match_prefix_blocks`` receives the tokens only, and the salt is per
request).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable, Sequence

from mmcache.errors import InvalidRequest
from mmcache.eviction import DEFAULT_POLICY, check_policy
from mmcache.names import Fingerprint
from mmcache.pool import PagePool
from mmcache.prefix_cache import PrefixCache
from mmcache.weights_fingerprint import weights_fingerprint

TESTED_TRANSFORMERS = (">=5.24,<5.25", (5, 24))  # the pin in pyproject's ``models`` extra; enable refuses others
_LOG = logging.getLogger("ContinuousBatchingLogger")  # the engine's logger: the match line the peer driver reads

Namer = Callable[[Fingerprint, Sequence[int], bytes], Sequence[int]]


def _engine():
    """The engine's modules, imported on first use (mmcache.hf imports no engine at import time)."""
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    return cb_cache, full_attention


def _check_version() -> None:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    if (major, minor) != TESTED_TRANSFORMERS[1]:
        raise InvalidRequest(f"mmcache's continuous-batching allocator is tested with transformers "
                             f"{TESTED_TRANSFORMERS[0]}, found {transformers.__version__}: its private cache API "
                             "may have moved (run tests/mmcache/hf/test_hf_continuous_batching.py)")


class _FreeBlocks:
    """Stands in for the engine pool's free-block tree of the mmcache allocator: its length is what ``grow`` can
    supply without touching a live request (pages free or cached: every page no live request holds), so every engine
    check of free capacity, the safety margin and the offload planner included, sees cached pages as free. The engine
    never takes blocks from it (the allocator's ``allocate_cache_to_request`` asks the ``PrefixCache``)."""

    def __init__(self, num_pages: int, live: dict[int, int]):
        self.num_pages, self.live = num_pages, live

    def __len__(self) -> int:
        return self.num_pages - len(self.live)

    def delete_full_trees(self) -> list[int]:
        return []  # holds no sectors: nothing to return to the engine's pool

    def _refuse(self, *args):
        raise AssertionError("the mmcache allocator's blocks come from its PrefixCache, not the engine's pool")

    pop_leaves = add_leaves = add_tree = _refuse


class MmcacheBatching:
    """The handle ``enable_prefix_cache`` returns: the settings of the model's engines and their ``PrefixCache``.

    ``cache`` is the ``PrefixCache`` of the latest engine cache built from the model (None before one is built);
    it outlives manager restarts over the same engine cache, as the engine's KV tensor does.
    """

    def __init__(self, model, fingerprint: str | None, evict_batch_pages: int, namer: Namer | None,
                 eviction: str = DEFAULT_POLICY):
        text = model.config.get_text_config(decoder=True)
        p = next(model.parameters())
        self.model_id = fingerprint or weights_fingerprint(model)
        self.kv_dtype, self.attention = str(p.dtype), str(text._attn_implementation)
        self.vocab_size = text.vocab_size
        self.evict_batch_pages, self.namer, self.eviction = evict_batch_pages, namer, eviction
        self.cache: PrefixCache | None = None
        self._salts: dict[str, bytes] = {}
        self._config = text

    def set_salt(self, request_id: str, salt: bytes) -> None:
        """Give the next request named ``request_id`` a tenant salt (enters its page-name chain at page 0)."""
        if not isinstance(salt, (bytes, bytearray)):
            raise InvalidRequest(f"salt must be bytes, got {type(salt).__name__}")
        self._salts[str(request_id)] = bytes(salt)

    def take_salt(self, request_id: str) -> bytes:
        return self._salts.pop(request_id, b"")

    def new_cache(self, num_pages: int, page_size: int) -> PrefixCache:
        fp = Fingerprint(model=self.model_id, kv_dtype=self.kv_dtype, attention_backend=self.attention,
                         page_size=page_size, extra="transformers-cb")
        self.cache = PrefixCache(PagePool(num_pages, eviction=self.eviction), fp,
                                 evict_batch_pages=self.evict_batch_pages, vocab_size=self.vocab_size)
        return self.cache

    def disable(self) -> None:
        """Engines built from the model after this use transformers' own allocator again."""
        _BOUND.pop(id(self._config), None)

    def __enter__(self) -> MmcacheBatching:
        return self

    def __exit__(self, *exc) -> None:
        self.disable()


_BOUND: dict[int, MmcacheBatching] = {}  # id(text config) -> settings; the config is the allocator's only link
_INSTALL = threading.Lock()


def enable_prefix_cache(model, *, fingerprint: str | None = None, evict_batch_pages: int = 1,
                        namer: Namer | None = None, eviction: str = DEFAULT_POLICY) -> MmcacheBatching:
    """Serve every continuous-batching engine built from ``model`` after this call on mmcache's ``PrefixCache``.

    The engine's ``allow_block_sharing`` still turns reuse on and off. ``fingerprint`` names the weights (default:
    ``mmcache.weights_fingerprint``, from the checkpoint files they were loaded from); ``namer(fingerprint,
    token_ids, salt)`` overrides page names (tests force collisions with it); ``eviction`` (a name in
    ``mmcache.eviction.POLICIES``) orders what each engine's pool evicts. Only models whose layers are all full
    attention are accepted. An unknown ``eviction`` raises ``InvalidConfig`` before anything is installed.
    """
    check_policy(eviction)
    _check_version()
    cb_cache, _ = _engine()
    text = model.config.get_text_config(decoder=True)
    groups = cb_cache.group_layers_by_attn_type(text)
    if set(groups) != {"full_attention"}:
        raise InvalidRequest(f"mmcache's continuous-batching allocator serves full-attention layers only; this model "
                             f"has {sorted(groups)}")
    if evict_batch_pages < 1:
        raise InvalidRequest(f"evict_batch_pages must be at least 1, got {evict_batch_pages}")
    handle = MmcacheBatching(model, fingerprint, evict_batch_pages, namer, eviction)
    with _INSTALL:
        _install(cb_cache)
        _BOUND[id(text)] = handle
    return handle


def _install(cb_cache) -> None:
    """Register the allocator class for full attention and wrap ``search_prefix_match``, once per process. Both
    route to transformers' own code for every model not enabled."""
    if getattr(cb_cache.PagedAttentionCache.search_prefix_match, "_mmcache", False):
        return
    cb_cache.ATTN_TYPE_TO_ALLOCATOR["full_attention"] = allocator_class()
    original = cb_cache.PagedAttentionCache.search_prefix_match

    @functools.wraps(original)
    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        ours = self.cache_allocators.get("full_attention")
        if not isinstance(ours, allocator_class()):
            return original(self, request_id, prompt_ids)
        return ours.admit(request_id, prompt_ids) if self.use_prefix_sharing else 0

    search_prefix_match._mmcache = True
    cb_cache.PagedAttentionCache.search_prefix_match = search_prefix_match


class _AllocatorState:
    """What the mmcache allocator keeps beside transformers' own allocator state, in one object. Transformers'
    ``FullAttentionCacheAllocator`` sets 26 attributes; an instance with more than 28 loses CPython's inline attribute
    values, and every attribute and method lookup on it, the engine's own per-request calls included, costs a tenth
    more. So the subclass adds one: this."""

    __slots__ = ("handle", "cache", "reserved", "live", "free", "full", "prompt_len", "tokens", "salt", "written",
                 "pending", "looked_up")

    def __init__(self, handle: MmcacheBatching):
        self.handle = handle
        self.cache: PrefixCache | None = None  # built when the engine registers its cache tensor
        self.reserved = 0  # the trash sectors' blocks: page p is the engine's block p + reserved
        self.live: dict[int, int] = {}  # page -> live requests holding it
        self.free: _FreeBlocks | None = None
        self.full: dict[str, int] = {}  # rid -> leading pages whose KV the engine has written
        self.prompt_len: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}  # rid -> the token ids the engine last passed
        self.salt: dict[str, bytes] = {}  # kept from first admission until the engine is done with the request
        self.written = 0  # counts the events that may index pages (blocks completed, requests finished)
        self.pending: dict[str, None] = {}  # requests with blocks completed since their last commit, in order
        self.looked_up: dict[str, int] = {}  # rid -> ``written`` when it was admitted


@functools.cache
def allocator_class():
    """The allocator class (built on first use: it subclasses transformers' full-attention allocator)."""
    _, full_attention = _engine()
    Stock = full_attention.FullAttentionCacheAllocator

    class MmcacheFullAttentionAllocator(Stock):
        """Full-attention blocks held through a ``PrefixCache`` (its state in ``_mm``, an ``_AllocatorState``).
        Invariants: ``block_table[rid]`` is the request's ``page_indices`` shifted by ``reserved`` (pages only ever
        append while a request lives, so each admit and grow appends the new ones); ``live`` counts, per page, the
        live requests holding it (the pages the ``PrefixCache`` counts as live, kept here so the engine's frequent
        free-capacity checks cost nothing); ``full[rid]`` counts the leading pages whose KV the engine has written
        (matched ones included), and ``pending`` holds the requests whose written pages the ``PrefixCache`` has not
        been told of yet: it is empty whenever a lookup runs, so every lookup sees every page written before it."""

        def __new__(cls, *args, **kwargs):
            handle = _BOUND.get(id(kwargs.get("config")))
            if handle is None:  # a model not enabled: transformers' own allocator, built as the registry would
                return Stock(*args, **kwargs)
            self = super().__new__(cls)
            self._mm = _AllocatorState(handle)
            return self

        def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
            super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
            mm = self._mm
            mm.cache = mm.handle.new_cache(self.num_blocks, self.tokens_per_page)
            mm.reserved = pool.num_reserved_sectors * self.blocks_per_sector
            mm.free = _FreeBlocks(self.num_blocks, mm.live)
            self._claim()

        def _claim(self) -> None:
            """Take every sector from the engine's pool and put ``_FreeBlocks`` in this allocator's place; again
            after the engine resets its pool (warmup does)."""
            free = self._mm.free
            if self.pool._free_blocks[self.index] is not free:
                self.pool.free_sectors.clear()
                self.pool._free_blocks[self.index] = free

        def _sync(self, rid: str, state) -> None:
            table, live, reserved = self.block_table.setdefault(rid, []), self._mm.live, self._mm.reserved
            for p in state.page_indices[len(table):]:
                live[p] = live.get(p, 0) + 1
                table.append(p + reserved)

        # ------------------------------------------------------------------------------------ request lifecycle
        def admit(self, rid: str, prompt_ids: list[int]) -> int:
            """A pending request's verified prefix match; returns the tokens matched (whole pages, never the last
            prompt token). A request still pending from an earlier attempt matched nothing (a match makes the
            engine start it): it is looked up again only if pages may have been indexed since, so a request waiting
            for room does not count as a query at every scheduler step."""
            self._claim()
            mm = self._mm
            if rid in self.block_table:
                if mm.looked_up.get(rid) == mm.written:
                    return 0
                self._end(rid, index=False)
            if rid not in mm.salt:
                mm.salt[rid] = mm.handle.take_salt(rid)
            salt = mm.salt[rid]
            names = mm.handle.namer(mm.cache.fingerprint, prompt_ids, salt) if mm.handle.namer else None
            if mm.pending:  # what the running requests wrote since the last lookup, indexed before this one
                self._commit(list(mm.pending))
            state = mm.cache.admit(rid, prompt_ids, salt=salt, names=names)
            self._sync(rid, state)
            mm.full[rid] = len(state.page_indices)
            mm.prompt_len[rid] = len(prompt_ids)
            mm.looked_up[rid] = mm.written
            if state.matched_tokens:  # the engine's own line, formatted only where it is shown
                _LOG.debug("Found a prefix match of %d tokens for request %s", state.matched_tokens, rid)
            return state.matched_tokens

        def needs_new_sectors(self, request_id: str, past_length: int, query_length: int) -> int:
            """transformers' answer, computed in place (the engine asks for every request at every step): no sector
            while the blocks the request lacks fit in the blocks no live request holds, else the sectors it is short
            of. This allocator holds every sector, so a positive answer means the request does not fit now."""
            mm = self._mm
            if self.pool._free_blocks[self.index] is not mm.free:
                self._claim()
            held, free = self.block_table.get(request_id), len(mm.free)
            short = -(-(past_length + query_length) // self.tokens_per_page) - (len(held) if held else 0) - free
            return 0 if short <= 0 else -(-short // self.blocks_per_sector)

        def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
            """Pages for ``past_length + query_length`` tokens; a request the engine never had matched (warmup,
            sharing off, a copy back from CPU offload) is admitted unnamed: it shares and indexes nothing."""
            if request_id not in self.block_table:
                self._mm.cache.admit_unnamed(request_id)
                self.block_table[request_id], self._mm.full[request_id] = [], 0
            total, P = past_length + query_length, self.tokens_per_page
            # Skipping grow when no page is added and no page fills keeps the decode step cheap; the held length
            # stays at least every full page's end, which is all mark_computed needs.
            if -(-total // P) > len(self.block_table[request_id]) or not total % P:
                self._sync(request_id, self._mm.cache.grow(request_id, total))

        def mark_complete_blocks(self, request_id: str, token_ids: list[int], new_new_blocks: int) -> None:
            """The last forward completed ``new_new_blocks`` more leading blocks: their KV is written. They are
            indexed at the next lookup or at the request's teardown, whichever comes first (``_commit``): the
            engine calls this after every forward, and most forwards are followed by no lookup."""
            mm = self._mm
            mm.full[request_id] += new_new_blocks
            mm.tokens[request_id] = token_ids  # the engine builds a new list for every call
            mm.written += 1
            mm.pending[request_id] = None

        def _commit(self, rids: list[str]) -> None:
            """Tell the ``PrefixCache`` how far each of ``rids`` has written (one index update for all) and take them
            off ``pending``: past the prompt, the ids generated so far name the pages."""
            self._mm.cache.mark_computed_many([self._mark(rid) for rid in rids])

        def _mark(self, rid: str) -> tuple[str, int, list[int] | None]:
            """``rid`` off ``pending``, and what it has written: ``(rid, tokens written, ids generated in them)``."""
            mm = self._mm
            mm.pending.pop(rid, None)
            done, n = mm.full[rid] * self.tokens_per_page, mm.prompt_len.get(rid)
            return rid, done, mm.tokens[rid][n:done] if n is not None and done > n else None

        def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
            """Teardown: the written pages of prompt + output are in the index, then the request is released, or
            aborted with ``no_cache`` (the engine offloads the request and will bring it back or recompute it)."""
            if request_id in self.block_table:
                self._end(request_id, index=not no_cache)

        def _end(self, rid: str, index: bool) -> None:
            """Release ``rid``: the pages it wrote are indexed either way (their KV is good), by ``finish`` along
            with the teardown, or before ``abort``."""
            mm = self._mm
            _, done, out = self._mark(rid) if rid in mm.pending else (rid, None, None)
            live, reserved = mm.live, mm.reserved
            for b in self.block_table.pop(rid):
                p = b - reserved
                if live[p] == 1:
                    del live[p]
                else:
                    live[p] -= 1
            mm.full.pop(rid, None)
            mm.looked_up.pop(rid, None)
            mm.tokens.pop(rid, None)
            if mm.prompt_len.pop(rid, None) is not None and index:
                mm.written += 1
                mm.salt.pop(rid, None)  # done; after a no_cache free the engine may send the request back
                mm.cache.finish(rid, out or (), computed_tokens=done)
            else:
                if done is not None:
                    mm.cache.mark_computed(rid, done, output_ids=out)
                mm.cache.abort(rid)

        def fork_blocks(self, source_request_id, dest_request_id, past_length):
            raise InvalidRequest("mmcache's continuous-batching allocator does not fork requests "
                                 "(num_return_sequences > 1); disable it for parallel sampling")

        def match_prefix_blocks(self, prompt_ids: list[int]) -> list[int]:
            raise AssertionError("matching goes through admit (search_prefix_match is wrapped)")

    return MmcacheFullAttentionAllocator
