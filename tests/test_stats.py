"""Typed stats: frozen snapshots read by attribute, whose ``to_dict()`` keeps the dict shape reports consume."""

import dataclasses

import numpy as np
import pytest
import torch

from mmcache import EncoderKey, EncoderStore, Fingerprint, HostPagePool, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import InvalidRequest
from mmcache.histogram import WaitHistogram
from mmcache.stats import EncoderCounters, EncoderStoreStats, HistogramStats, PrefixCacheStats, TierStats
from mmcache.tiers import HostTier, MemoryStore, StoreTier, TierStack
from mmcache.tiers.store import WAIT_BOUNDS

COUNTERS = ["queries", "hits", "misses", "bytes_stored", "evictions", "evicted_bytes", "bypasses", "joins",
            "collisions", "time_saved_s", "host_spilled", "host_hits", "host_misses", "host_rejected", "store_hits",
            "store_misses", "store_rejected", "store_mac_failures"]


def test_prefix_cache_stats_are_a_frozen_snapshot_with_the_documented_keys():
    cache = PrefixCache(PagePool(8), Fingerprint("m", page_size=4))
    cache.admit("a", np.arange(9))
    s = cache.stats()
    assert isinstance(s, PrefixCacheStats) and s.queries == 1 and s.requests_live == 1
    assert list(s.to_dict()) == ["queries", "hits", "queried_tokens", "hit_tokens", "evicted_pages", "freed_pages",
                                 "eviction_batches", "shortfall_pages", "stalls", "collisions", "pages_free",
                                 "pages_live", "pages_cached", "requests_live"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.hits = 3
    cache.abort("a")
    assert s.requests_live == 1 and cache.stats().requests_live == 0  # a snapshot never changes


def test_encoder_store_stats_to_dict_is_the_flat_report_shape():
    store = EncoderStore(capacity_bytes=4096, page_bytes=1024)
    key = EncoderKey(b"d" * 16, "enc", "image")
    store.put(key, torch.ones(10))
    store.get(key)
    s = store.stats()
    assert isinstance(s, EncoderStoreStats) and isinstance(s.by_modality["image"], EncoderCounters)
    assert (s.totals.hits, s.totals.bytes_stored, s.entries, s.capacity_bytes) == (1, 40, 1, 4096)
    d = s.to_dict()
    assert list(d) == COUNTERS + ["entries", "capacity_bytes", "by_modality"]
    assert d["by_modality"] == {"image": {**dict.fromkeys(COUNTERS, 0), "queries": 1, "hits": 1,
                                          "bytes_stored": 40, "time_saved_s": 0.0}}
    assert d["hits"] == 1 and isinstance(d["time_saved_s"], float)


def test_shadow_and_allocator_stats_are_typed():
    shadow = ShadowIndex(Fingerprint("m", page_size=4))
    shadow.admit("a", np.arange(9))
    assert shadow.stats().to_dict() == {"requests": 1, "prompt_pages": 2, "matched_pages": 0,
                                        "matched_page_share": 0.0, "inflight_pages": 0,
                                        "misses_held_in_flight": 0, "table_pages": 0, "media_items": 0,
                                        "repeated_media": 0, "duplicate_media_rate": 0.0, "replicas": 1,
                                        "repeated_prefixes": 0, "replica_spread_mean": 0.0,
                                        "replica_spread_max": 0}



def test_wait_histogram_counts_each_observation_in_the_first_bucket_at_or_above_it():
    h = WaitHistogram((0.1, 1.0))
    for seconds in (0.1, 0.5, 1.0, 3.0, 0.0):
        h.observe(seconds)
    s = h.snapshot()
    assert isinstance(s, HistogramStats) and s.counts == (2, 2, 1) and s.count == 5 and s.sum == pytest.approx(4.6)
    for bad in ((), (1.0, 1.0), (0.0, 1.0), (2.0, 1.0)):
        with pytest.raises(InvalidRequest):
            WaitHistogram(bad)


def test_tier_stats_are_a_flat_snapshot_with_the_store_wait():
    fp = Fingerprint("m", page_size=4)
    pool = PagePool(4, (4,), torch.float32)
    store = StoreTier(MemoryStore(16), publish_async=False, deadline_s=None)
    stack = TierStack(fp, host=HostTier(HostPagePool.like(pool, 4), 4), store=store)
    cache = PrefixCache(pool, fp, tiers=stack)
    cache.admit("a", np.arange(9))  # misses on the device and the host, asks the store once
    s = stack.stats()
    assert isinstance(s, TierStats) and (s.host, s.store, s.store_up, s.page_size) == (True, True, True, 4)
    assert (s.store_gets, s.store_misses, s.store_wait.count, s.host_pages_held) == (2, 1, 1, 0)
    d = s.to_dict()
    assert all(k in ("page_size", "host", "store") or k.startswith(("host_", "store_")) for k in d)
    assert d["store_wait"] == {"bounds": WAIT_BOUNDS, "counts": s.store_wait.counts, "sum": s.store_wait.sum}
    assert TierStack(fp).stats() == TierStats(page_size=4)  # no tier: nothing counted


def test_an_eviction_counts_the_pages_it_unindexed_and_the_pages_it_freed():
    """Evicting a cold page takes its indexed descendants out of the index too; one another owner holds stays with
    that owner: unindexed, not freed. (The single count said 2 evicted where 1 page went free.)"""
    P = 4
    cache = PrefixCache(PagePool(4), Fingerprint("m", page_size=P), evict_batch_pages=1)
    prompt = np.arange(2 * P + 1, dtype=np.int32)
    cache.admit("a", prompt)
    cache.grow("a", prompt.size)
    cache.mark_computed("a", prompt.size)
    first, second = cache.state("a").page_indices[:2]
    cache.finish("a")
    cache.pool.retain([second])  # another owner (a suspended request, an engine's copy) holds the child
    cache.index.evict([first])
    stats = cache.stats()
    assert (stats.evicted_pages, stats.freed_pages) == (2, 1)
    assert cache.pool.counts[second] == 1 and cache.pool.counts[first] == 0
