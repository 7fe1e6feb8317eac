"""HostTier: pages evicted from the device pool, kept in host memory with their verifying ids (RFC phase 4b).

Write-back: a page is copied to the host only when the device evicts it (``spill``), never while it is cached on
the device. Inclusive: a page copied back up stays in the host tier too, so evicting it from the device again costs
no copy. The tier owns one owner count on each page it holds in its ``HostPagePool``; a lookup that hits pins the
matched pages (one more owner) until their bytes are copied up, so the tier's own eviction never takes a page that
is being read. The tier is an evictable owner of its host pool (``mmcache.reclaim``): its entries are ordered by the
host pool's policy (``mmcache.eviction``) with the same ``eviction_key`` as the device index, and room is made by the
same ``make_room``; an
``EncoderHostTier`` may share the pool (``mmcache.tiers.encoder_host``), and eviction then chooses across both. Its
one KV user (``TierStack``) drives it under the device pool's ``cache_lock``; ``put`` and ``match`` also take the host
pool's (after the device's, never before), which serializes them with an encoder tier on the same host pool.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.pool import HostPagePool, PagePool, can_hold, copy_pages
from mmcache.reclaim import coldest_of, eviction_key, make_room
from mmcache.tiers.lineage import RequestLineage

_LIN = np.dtype((np.void, 16))
COUNTERS = (  # ``HostTier.counters``, each since creation
    "written_pages",    # device pages a put copied in
    "refreshed_pages",  # pages a put found held already with equal ids (marked used, no copy)
    "full_pages",       # pages a put skipped: no room once the tier's unpinned pages were dropped
    "evicted_pages",    # pages the tier's eviction took out of it
    "freed_pages",      # of them, pages that went free in the host pool (a page a hit pins goes once it is read)
    "hit_pages",        # pages lookups matched and verified
    "collisions",       # lookups that found a page under its name whose ids differ (a verification failure)
)


class HostBudget:
    """Host memory split explicitly between the host tier (``tier``) and preemption offload (``offload``, the pool
    an engine's preemption offload takes, e.g. M*'s KV resource). They are two ``HostPagePool``s, so neither can take
    the other's pages: a full tier evicts its own coldest pages, a full offload pool refuses the offload, whatever the
    other holds.

    ``pin_memory`` defaults to pinning when the device pool is on CUDA (page-locked memory needs CUDA)."""

    def __init__(self, like: PagePool, tier_pages: int, offload_pages: int, pin_memory: bool | None = None):
        if pin_memory is None:
            pin_memory = like.device.type == "cuda" and torch.cuda.is_available()
        for what, n in (("tier_pages", tier_pages), ("offload_pages", offload_pages)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise InvalidRequest(f"{what} must be a non-negative integer, got {n!r}")
        self.tier = HostPagePool.like(like, tier_pages, pin_memory) if tier_pages else None
        self.offload = HostPagePool.like(like, offload_pages, pin_memory) if offload_pages else None

    @classmethod
    def split(cls, like: PagePool, host_bytes: int, tier_share: float, pin_memory: bool | None = None) -> HostBudget:
        """``host_bytes`` of host memory, ``tier_share`` of it (0..1) for the tier and the rest for offload."""
        if not 0.0 <= tier_share <= 1.0:
            raise InvalidRequest(f"tier_share must lie in [0, 1], got {tier_share}")
        pages = host_bytes // max(1, like.page_bytes)
        tier = int(pages * tier_share)
        return cls(like, tier, pages - tier, pin_memory)


class HostTier:
    """Page name -> host page, with the verifying ids of each page: tokens, 128-bit media id, depth in its chain and
    the lineage of its parent (``mmcache.tiers.lineage``). Coldest pages (then deepest) are dropped when full."""

    def __init__(self, pool: HostPagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        P = page_size
        n = pool.num_pages
        self._name = np.zeros(n, dtype=np.uint64)
        self._tokens = np.zeros((n, P), dtype=np.int32)
        self._media = np.zeros((n, 2), dtype=np.uint64)
        self._plin = np.zeros(n, dtype=_LIN)
        self._depth = np.zeros(n, dtype=np.int32)
        self._tick = np.zeros(n, dtype=np.int64)
        self._key = np.zeros(n, dtype=np.int64)  # the host pool policy's eviction key at the last use
        self._held = np.zeros(n, dtype=bool)
        self._pages: dict[int, int] = {}
        pool.register(self)
        self.counters = dict.fromkeys(COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._pages)

    def __contains__(self, name) -> bool:
        return name in self._pages

    def put(self, src: PagePool, src_pages, names, tokens: np.ndarray, media: np.ndarray, parent_lineages,
            depths) -> int:
        """Copy device pages ``src_pages`` (evicted, still holding their bytes) into the tier with their ids.

        A name already held with equal ids is only refreshed (no copy); one held with other ids is replaced. Pages
        beyond the tier's free room after dropping its coldest unpinned pages are skipped. Returns pages copied."""
        with self.pool.cache_lock:  # shared with an EncoderHostTier on the same host pool
            if not can_hold(self.pool, src):
                raise InvalidRequest(f"host tier pages {self.pool!r} cannot hold device pages {src!r}")
            tick = self.pool.clock.tick()
            fresh_at, replace = [], []
            for j, name in enumerate(names):
                page = self._pages.get(name)
                if page is not None and self._same(page, tokens[j], media[j], parent_lineages[j], depths[j]):
                    self._tick[page] = tick
                    self._key[page] = self.pool.policy.key(int(name), tick, int(self._key[page]))
                    self.counters["refreshed_pages"] += 1
                else:
                    if page is not None:
                        replace.append(page)
                    fresh_at.append(j)
            self._drop(np.asarray(replace, dtype=np.int64))
            room = self._free_up_to(len(fresh_at))
            self.counters["full_pages"] += len(fresh_at) - room
            fresh_at = fresh_at[:room]
            if not fresh_at:
                return 0
            hp = self.pool.alloc(len(fresh_at))
            copy_pages(src, [src_pages[j] for j in fresh_at], self.pool, hp)
            for j, page in zip(fresh_at, hp):
                self._pages[names[j]] = page
            self._name[hp] = np.array([names[j] for j in fresh_at], dtype=np.uint64)
            self._tokens[hp] = tokens[fresh_at]
            self._media[hp] = media[fresh_at]
            self._plin[hp] = np.array([parent_lineages[j] for j in fresh_at], dtype=_LIN)
            self._depth[hp] = np.asarray(depths)[fresh_at]
            self._tick[hp] = tick
            self._key[hp] = self.pool.policy.keys(self._name[hp], tick, np.zeros(len(hp), dtype=np.int64))
            self._held[hp] = True
            self.counters["written_pages"] += len(hp)
            return len(hp)

    def match(self, names, start: int, tokens: np.ndarray, mids: np.ndarray, lineage: RequestLineage) -> list[int]:
        """Host pages for pages ``start, start+1, ...`` of a request, to the first miss or failed verification:
        each entry's tokens, media, depth and parent lineage must equal the request's own. Pins the returned pages
        (one more owner each): the caller releases them once their bytes are copied up."""
        with self.pool.cache_lock:  # shared with an EncoderHostTier on the same host pool
            idx = np.fromiter(map(self._pages.get, names[start:], repeat(-1)), dtype=np.int64,
                              count=len(names) - start)
            miss = np.flatnonzero(idx < 0)
            if miss.size:
                idx = idx[:miss[0]]
            if not idx.size:
                self.pool.policy.looked_up(names[start:], 0)
                return []
            k, P = idx.size, self.page_size
            ok = (self._depth[idx] == np.arange(start, start + k)) & (self._media[idx] == mids[start:start + k]).all(1)
            ok &= (self._tokens[idx] == tokens[start * P:(start + k) * P].reshape(k, P)).all(1)
            # the parent lineages last, one hash per page, only as far as the cheap checks pass
            k = k if ok.all() else int(np.argmin(ok))
            plin = self._plin[idx[:k]]
            for i in range(k):
                if plin[i].tobytes() != lineage.before(start + i):
                    k = i
                    break
            if k < idx.size:
                self.counters["collisions"] += 1
            self.pool.policy.looked_up(names[start:], k)
            out = idx[:k].tolist()
            if out:
                self.pool.retain(out, distinct=True)
                tick = self._tick[out] = self.pool.clock.tick()
                self._key[out] = self.pool.policy.keys(self._name[out], tick, self._key[out])
                self.counters["hit_pages"] += len(out)
            return out

    def _same(self, page: int, tokens, mid, parent_lineage: bytes, depth: int) -> bool:
        return bool(self._depth[page] == depth and (self._media[page] == mid).all()
                    and self._plin[page].tobytes() == parent_lineage and (self._tokens[page] == tokens).all())

    def _free_up_to(self, need: int) -> int:
        """Free up to ``need`` pages by dropping the coldest (then deepest) pages only the tier holds; returns how
        many pages are free for the caller now (at most ``need``)."""
        try:
            make_room(self.pool, need)
        except OutOfPages as e:  # pinned pages hold the rest: drop every candidate and use what is free
            if need - e.shortfall > self.pool.num_free:
                make_room(self.pool, need - e.shortfall)
        return min(need, self.pool.num_free)

    # -- the pool's reclaim protocol (``mmcache.reclaim``) ------------------------------------------------------------
    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Pages only the tier holds (no hit pinning them), keyed by the host pool's policy, then deepest first."""
        cands = np.flatnonzero(self._held & (self.pool.counts == 1))
        return cands, eviction_key(self.pool, self._key[cands], self._depth[cands])

    def coldest(self, n: int):
        return coldest_of(self.eviction_candidates(), n)

    def evict(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        held = pages[self._held[pages]] if pages.size else pages
        self.pool.policy.evicted(self._name[held].tolist(), self._key[held].tolist(), self._tick[held].tolist())
        self.counters["evicted_pages"] += int(held.size)
        self.counters["freed_pages"] += self._drop(pages)

    def _drop(self, pages: np.ndarray) -> int:
        """Take the held ones of ``pages`` out of the tier and release them; how many went free."""
        pages = pages[self._held[pages]] if pages.size else pages
        if not pages.size:
            return 0
        for name in self._name[pages].tolist():
            del self._pages[name]
        self._held[pages] = False
        return len(self.pool.release(pages))
