"""Traffic for the tier series tests (``test_prometheus.py`` in-process, ``test_prometheus_tiers.py`` on a real Mooncake
master): a ``PrefixCache`` over a small device pool with a host tier and a keyed store tier, requests served whole,
the hits each tier gave tallied from what every admission got, and other instances whose entries the store refuses."""

from __future__ import annotations

import numpy as np
import torch

from mmcache import Fingerprint, HostPagePool, PagePool, PrefixCache
from mmcache.tiers import HostTier, StoreTier, TierStack

P = 4
KEY = b"deployment-key-0123456789abcdef"
FP = Fingerprint(model="tier-series", page_size=P)


def prompts(n: int, pages: int = 3, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 1000, pages * P + 1).tolist() for _ in range(n)]


def serve(cache: PrefixCache, rid: str, tokens: list[int]):
    """One request: admit, then ``complete`` it. Returns the admission's state."""
    state = cache.admit(rid, tokens)
    complete(cache, rid, tokens, state)
    return state


def complete(cache: PrefixCache, rid: str, tokens: list[int], state) -> None:
    """An admitted request: wait for the copy-up, write what missed (one value per page), commit, finish."""
    if state.fetch is not None:
        state.fetch.wait()
    s = cache.grow(rid, len(tokens))
    for j, p in enumerate(s.page_indices[state.matched_tokens // P:]):
        cache.pool.data[p] = float(j + 1)
    cache.mark_computed(rid, len(tokens))
    cache.finish(rid)


class TieredCache:
    """The instance under test: ``pool_pages`` device pages, a host tier of ``host_pages`` and a store tier with
    ``KEY`` on ``client`` (``store`` options passed on). ``hits``: tokens each tier gave, per the admissions."""

    def __init__(self, client, pool_pages: int = 8, host_pages: int = 6, **store):
        self.pool = PagePool(pool_pages, (P,), torch.float32)
        self.store = StoreTier(client, key=KEY, **store)
        self.stack = TierStack(FP, host=HostTier(HostPagePool.like(self.pool, host_pages), P), store=self.store)
        self.cache = PrefixCache(self.pool, FP, evict_batch_pages=1, tiers=self.stack)
        self.hits = dict.fromkeys(("device", "host", "store"), 0)
        self._n = 0

    def serve(self, tokens: list[int], commit: bool = True) -> int:
        """Serve ``tokens`` as a new request (or only look it up and abort, publishing nothing: ``commit=False``);
        returns its matched tokens."""
        self._n += 1
        rid = f"r{self._n}"
        if commit:
            state = serve(self.cache, rid, tokens)
        else:
            state = self.cache.admit(rid, tokens)
            self.cache.abort(rid)
        lower = (state.fetch.host_pages, state.fetch.store_pages) if state.fetch is not None else (0, 0)
        self.hits["host"] += lower[0] * P
        self.hits["store"] += lower[1] * P
        self.hits["device"] += state.matched_tokens - sum(lower) * P
        return state.matched_tokens

    def cache_stats(self) -> dict:
        return {"prefix": self.cache.stats().to_dict(), "tiers": self.stack.stats().to_dict()}


def traffic(instance: TieredCache, work: list[list[int]], sample) -> None:
    """Every tier hits: each prompt served twice (the device hits), a round that evicts to the host tier and reads it
    back, then the device index cleared (the host tier holds the evicted pages only: the rest come from the store).
    ``sample()`` after every request."""
    for rounds in range(3):
        if rounds == 2:
            instance.store.flush(30)
            instance.cache.clear()
        for tokens in work:
            instance.serve(tokens)
            sample()
            if rounds == 0:
                instance.serve(tokens)
                sample()
    assert all(instance.hits.values()), instance.hits


def publish_as_another_instance(client, tokens: list[int], key: bytes = KEY, dtype=torch.float32) -> None:
    """Another instance with the same fingerprint computes and publishes ``tokens``' pages: under another ``key`` its
    entries fail the reader's MAC; with another ``dtype`` (page layout) they fail its verification."""
    pool = PagePool(8, (P,), dtype)
    store = StoreTier(client, key=key, publish_async=False, deadline_s=None)
    serve(PrefixCache(pool, FP, tiers=TierStack(FP, store=store)), "other", tokens)
    store.close()
