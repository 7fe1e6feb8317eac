"""EncoderHostTier: encoder entries evicted from a device ``EncoderStore``, kept in host pages as their payloads
(``mmcache.tiers.encoder_entry``), so a hit is verified exactly like a shared-store hit.

Write-back, inclusive, like the KV ``HostTier``: an entry is written only when the device evicts it, and one read back
up stays here, so evicting it again costs no copy (an entry held under the same name and verifying ids is only
refreshed). It lives on a ``HostPagePool`` (its pages viewed as bytes, any page shape), whose owner counts and
eviction policy it uses as the KV host tier does, and it is an evictable owner of that pool (``mmcache.reclaim``):
whole entries, lowest key first, by the same ``eviction_key``, room made by the same ``make_room``. So one host pool
can hold a KV ``HostTier`` and an ``EncoderHostTier`` side by side, and a shortfall of either evicts the coldest
host pages of both kinds. Every method takes the host pool's ``cache_lock`` (which the KV host tier takes too); it
is taken after a device pool's lock, never before one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from mmcache.checks import require
from mmcache.errors import InvalidRequest, OutOfPages
from mmcache.eviction import entry_name
from mmcache.guard import Guard
from mmcache.pool import HostPagePool
from mmcache.reclaim import coldest_of, eviction_key, make_room

COUNTERS = (  # ``EncoderHostTier.counters``, each since creation (entries written: ``EncoderCounters.host_spilled``)
    "refreshed_entries",  # entries a spill found held already with equal verifying ids (marked used, no copy)
    "full_entries",       # entries a put could not fit (larger than the pool, or pinned KV pages hold the rest)
    "evicted_pages",      # pages of the entries the tier's eviction took out of it
    "freed_pages",        # of them, pages that went free in the host pool
)


@dataclasses.dataclass(eq=False)
class _HostEntry:
    pages: list[int]
    length: int           # payload bytes (the last page is zero-padded)
    verify_ids: bytes | None
    tick: int
    rank: int = 0         # the host pool policy's eviction key at the last use


class EncoderHostTier:
    """Store key (``encoder_entry.entry_key``) -> an entry's payload in pages of ``pool``."""

    def __init__(self, pool: HostPagePool):
        if pool.data is None or not pool.data.is_contiguous():
            raise InvalidRequest(f"an encoder host tier needs a host pool with data, got {pool!r}")
        self.pool = pool
        self.page_bytes = pool.page_bytes
        self._bytes = pool.data.view(-1).view(torch.uint8).view(pool.num_pages, self.page_bytes)
        self._entries: dict[str, _HostEntry] = {}
        self._owner: dict[int, str] = {}  # page -> the key of the entry holding it
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.guard = Guard(self.counters)
        pool.register(self)

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: str, verify_ids: bytes | None) -> bool:
        """Whether the entry under ``key`` is held with these verifying ids; if so it is marked used (a refresh)."""
        with self.pool.cache_lock:
            e = self._entries.get(key)
            if e is None or e.verify_ids != verify_ids:
                return False
            self._used(key, e)
            self.counters["refreshed_entries"] += 1
            return True

    def put(self, key: str, payload: bytes, verify_ids: bytes | None) -> bool:
        """Hold ``payload`` under ``key`` (replacing what is there), dropping the coldest host pages first when the
        pool is short; False, with nothing held under ``key``, when it cannot fit."""
        n = -(-len(payload) // self.page_bytes)
        with self.pool.cache_lock:
            self._drop([key])
            if n > self.pool.num_pages:
                self.counters["full_entries"] += 1
                return False
            try:
                make_room(self.pool, n)
            except OutOfPages:  # pinned KV host pages hold the rest
                self.counters["full_entries"] += 1
                return False
            pages = self.pool.alloc(n)
            blob = torch.zeros(n * self.page_bytes, dtype=torch.uint8)
            blob.numpy()[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            self._bytes.index_copy_(0, torch.as_tensor(pages), blob.view(n, self.page_bytes))
            self._entries[key] = e = _HostEntry(pages, len(payload), verify_ids, 0)
            self._used(key, e)
            self._owner.update(dict.fromkeys(pages, key))
            return True

    def discard(self, key: str) -> None:
        """Drop the entry under ``key`` if held (its value is being replaced above)."""
        with self.pool.cache_lock:
            self._drop([key])

    def get(self, key: str) -> np.ndarray | None:
        """A copy of the payload under ``key`` (uint8, fresh memory), marked used; None when not held."""
        with self.pool.cache_lock:
            e = self._entries.get(key)
            self.guard.call("eviction policy", self.pool.policy.looked_up, (entry_name(key),), int(e is not None))
            if e is None:
                return None
            self._used(key, e)
            return self._bytes.index_select(0, torch.as_tensor(e.pages)).view(-1)[:e.length].numpy()

    # -- the host pool's reclaim protocol (``mmcache.reclaim``; called under its ``cache_lock``) -----------------------
    def eviction_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """Every held page (no hit pins one: a hit copies its payload out under the lock), keyed by the host pool
        policy's key of its entry (depth 0), so keys compare with the KV host tier's."""
        pages = [p for e in self._entries.values() for p in e.pages]
        ranks = [e.rank for e in self._entries.values() for _ in e.pages]
        return np.asarray(pages, dtype=np.int64), eviction_key(self.pool, ranks)

    def coldest(self, n: int):
        return coldest_of(self.eviction_candidates(), n)

    def evict(self, pages) -> None:
        """Drop every entry holding one of ``pages`` (whole entries)."""
        keys = {self._owner[p] for p in np.asarray(pages).tolist() if p in self._owner}
        gone = [self._entries[k] for k in keys]
        self.counters["evicted_pages"] += sum(len(e.pages) for e in gone)
        self.counters["freed_pages"] += self._drop(keys)
        self.guard.call("eviction policy", self.pool.policy.evicted, [entry_name(k) for k in keys],
                        [e.rank for e in gone], [e.tick for e in gone])

    def check(self) -> None:
        """``BrokenInvariant`` unless each held page belongs to exactly the entry the page table names, and the host
        pool counts the tier's owner on each."""
        pages = {p: k for k, e in self._entries.items() for p in e.pages}
        require(pages == self._owner, "each held page is its entry's, as the page table says")
        require(all(self.pool.owners(p) >= 1 for p in pages), "the host pool counts the tier's owner on every page")

    def _used(self, key: str, e: _HostEntry) -> None:
        """Entry ``e`` under ``key`` stored or used now: its tick and the host pool policy's key for it."""
        e.tick = self.pool.clock.tick()
        e.rank = self.guard.key(self.pool.policy, entry_name(key), e.tick, e.rank)

    def _drop(self, keys) -> int:
        """Take the entries under ``keys`` out of the tier and release their pages; how many pages went free."""
        freed = 0
        for key in keys:
            e = self._entries.pop(key, None)
            if e is not None:
                for p in e.pages:
                    del self._owner[p]
                freed += len(self.pool.release(e.pages))
        return freed
