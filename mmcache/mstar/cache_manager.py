"""M*'s cache managers with the decode step's page allocation batched: one ``try_alloc_many`` per plan.

M*'s ``FlashInferCacheManager.plan_attention`` calls ``alloc_manager.alloc`` once per request (cache_manager.py,
``_plan_attention_impl``). ``BatchedAllocPlanning`` is a mixin over any M* cache manager class whose
``plan_attention`` first gives the whole batch its pages with the drop-in's ``try_alloc_many`` (one lock hold, one
pool take), then runs M*'s own ``plan_attention`` unchanged over a view of the allocator whose ``alloc`` has nothing
left to do. It does so only when enough of the plan's requests can grow a page (``min_growing_share``): otherwise
M*'s loop runs as it is, over the drop-in's ``alloc``, which returns without its lock when the pages are there.
M*'s semantics are kept exactly:

- ``try_alloc_many`` gives each request the very pages its own ``alloc`` would have, in the same order, so page
  tables (and hence outputs) are identical to the per-request path;
- when the free pages do not cover the batch (a shortfall that needs eviction, or that fails) it changes nothing and
  M*'s loop allocates per request as before: it evicts per request and raises ``AllocationFailedError`` with the
  payload of the request that cannot fit, the requests before it keeping their pages, as over M*'s manager;
- over an allocator without ``try_alloc_many`` (M*'s own), for a pre-planned label (the CUDA-graph runner's fast
  path, which allocates nothing), for a dense-generation plan, or when the arguments do not pair up, nothing is
  pre-allocated: the call is M*'s.

How it is swapped in, without editing M*: M* picks the cache manager class by name, ``KVCacheConfig
.attention_backend``, from its registry ``cache_manager.ATTENTION_BACKENDS`` (M*'s extension point). ``batched_backend
(name)`` adds ``"mmcache.<name>"`` there (the mixin over M*'s class of that name), and ``use_batched_planning(config)``
points one KV cache's config at it. ``mmcache.mstar.install(engine, reuse)`` does that for every KV cache whose
allocator it swaps (``batched_planning=False`` keeps M*'s classes); code that builds cache managers itself calls
``use_batched_planning(alloc_manager.config)`` once. Only names are added to the registry; M*'s entries are untouched.

Left per request: ``plan_attention_batched_cfg`` (CFG image generation: a few requests per plan), and a
``"mmcache.dense_gen"`` cache whose FlashAttention-3 kernel is missing: ``create_cache_manager`` then falls back to
M*'s plain ``FlashInferCacheManager`` by class, bypassing the registry name.
"""

from __future__ import annotations

from mmcache.mstar.vendor import import_mstar

import_mstar()
from mstar.engine import cache_manager as mstar_cache_manager  # noqa: E402
from mstar.engine.kv_store import KVCacheConfig  # noqa: E402

PREFIX = "mmcache."


class BatchedAllocPlanning:
    """Mixin before an M* cache manager class: ``plan_attention`` pre-allocates the batch, then is M*'s.

    ``min_growing_share``: pre-allocate only when the plan's new tokens could grow at least this share of its
    requests by a page (``sum(seq_lens) >= share * page_size * len(seq_lens)``). M*'s loop still calls ``alloc``
    once per request, which over the drop-in costs little when the pages are there (no lock); the batched call then
    saves only the lock-and-take of the requests that grow (about 1.5 us each) while its own pass reads every
    request's state (about 0.2 us each). Measured on one machine (benchmarks/bench_mstar_allocator.py): a decode step
    with 16-token pages (1/16 of requests grow) is cheaper per request, one with 1-token pages or a prefill batch is
    cheaper batched. 0 always pre-allocates."""

    min_growing_share = 1 / 8

    def plan_attention(self, seq_lens=None, dtype=None, is_causal=True, write_store=True, label=None, **kwargs):
        if not self._preallocate(seq_lens, label, kwargs):
            return super().plan_attention(seq_lens=seq_lens, dtype=dtype, is_causal=is_causal,
                                          write_store=write_store, label=label, **kwargs)
        # Every alloc of M*'s loop would now return at once: let it see a view whose alloc does nothing. Only this
        # cache manager, for this call, sees the view; other threads keep calling the allocator itself.
        allocator, self.alloc_manager = self.alloc_manager, _Allocated(self.alloc_manager)
        try:
            return super().plan_attention(seq_lens=seq_lens, dtype=dtype, is_causal=is_causal,
                                          write_store=write_store, label=label, **kwargs)
        finally:
            self.alloc_manager = allocator

    def _preallocate(self, seq_lens, label, hints) -> bool:
        """The pages M*'s plan loop would allocate, in one call; True when every request of the plan then holds
        them (False: nothing was done, M*'s loop allocates as it does over M*'s manager)."""
        try_alloc_many = getattr(self.alloc_manager, "try_alloc_many", None)
        if try_alloc_many is None or seq_lens is None or len(seq_lens) != len(self.request_ids):
            return False
        if label is None:
            labels = set(self.active_labels.values())
            if len(labels) != 1:
                return False  # M*'s plan asserts one active label; let it
            (label,) = labels
        page_size = self.kv_cache_config.page_size
        if sum(seq_lens) < self.min_growing_share * page_size * len(seq_lens):
            return False
        if label in self._pre_planned_labels:
            return False
        if hints.get("dense_gen") and getattr(self, "_dense_gen_applies", lambda: False)():
            return False
        return try_alloc_many(self.request_ids, label, seq_lens, added=True)


class _Allocated:
    """The allocator as M*'s plan loop sees it once ``try_alloc_many`` gave the batch its pages: ``get_state`` is the
    allocator's and ``alloc`` has nothing left to do (the loop asks for the very lengths the batch was given)."""

    __slots__ = ("get_state",)

    def __init__(self, allocator):
        self.get_state = allocator.get_state

    def alloc(self, request_id, label, seq_len):
        pass


_classes: dict[str, type] = {}


def batched_backend(name: str) -> str:
    """Register the batched form of M*'s attention backend ``name`` in M*'s registry; returns its name there
    (``"mmcache." + name``; a name already batched is returned as is)."""
    if name.startswith(PREFIX):
        return name
    registry = mstar_cache_manager.ATTENTION_BACKENDS
    if name not in registry:
        raise ValueError(f"unknown M* attention backend {name!r}; available: {sorted(registry)}")
    key = PREFIX + name
    if key not in _classes:
        base = registry[name]
        _classes[key] = type(f"Batched{base.__name__}", (BatchedAllocPlanning, base),
                             {"__module__": __name__, "__doc__": f"M*'s {base.__name__} with batched allocation."})
    registry.setdefault(key, _classes[key])
    return key


def use_batched_planning(config: KVCacheConfig) -> None:
    """Make the cache managers M* builds for this KV cache (``create_cache_manager``) batch their allocation."""
    config.attention_backend = batched_backend(config.attention_backend)
