"""Typed stats: frozen snapshots read by attribute, whose ``to_dict()`` keeps the dict shape reports consume."""

import dataclasses

import numpy as np
import pytest
import torch

from mmcache import EncoderKey, EncoderStore, Fingerprint, HostPagePool, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import InvalidRequest
from mmcache.histogram import WaitHistogram
from mmcache.stats import EncoderCounters, EncoderStoreStats, HistogramStats, PrefixCacheStats, TierStats
from mmcache.tiers import EncoderHostTier, EncoderTiers, HostTier, MemoryStore, StoreTier, TierStack
from mmcache.tiers.store import EXISTS, FULL, STORED, WAIT_BOUNDS

COUNTERS = ["queries", "hits", "misses", "bytes_stored", "evictions", "evicted_bytes", "evicted_pages", "freed_pages",
            "bypasses", "joins", "collisions", "time_saved_s", "host_spilled", "host_hits", "host_misses",
            "host_rejected", "store_hits", "store_misses", "store_rejected", "store_mac_failures"]
TIER_FIELDS = ["host", "store", "host_refreshed_entries", "host_full_entries", "host_evicted_pages", "host_freed_pages",
               "host_listener_errors",
               "store_published_entries", "store_publish_exists", "store_publish_full", "store_publish_dropped",
               "store_room_removed", "store_refused_removed", "listener_errors"]


def test_prefix_cache_stats_are_a_frozen_snapshot_with_the_documented_keys():
    cache = PrefixCache(PagePool(8), Fingerprint("m", page_size=4))
    cache.admit("a", np.arange(9))
    s = cache.stats()
    assert isinstance(s, PrefixCacheStats) and s.queries == 1 and s.requests_live == 1
    assert list(s.to_dict()) == ["queries", "hits", "queried_tokens", "hit_tokens", "evicted_pages", "freed_pages",
                                 "eviction_batches", "shortfall_pages", "stalls", "collisions", "listener_errors",
                                 "pages_free", "pages_live", "pages_cached", "requests_live"]
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
    assert list(d) == COUNTERS + ["entries", "capacity_bytes"] + TIER_FIELDS + ["by_modality"]
    assert d["host"] is d["store"] is False  # no tiers
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


def test_an_encoder_eviction_counts_the_pages_it_took_and_freed():
    store = EncoderStore(capacity_bytes=3 * 64, page_bytes=64)
    for i in range(3):  # 40 floats: 3 pages each, so every put evicts the one before
        store.put(EncoderKey(bytes([i]) * 16, "enc", "image"), torch.ones(40))
    image = store.stats().by_modality["image"]
    assert (image.evictions, image.evicted_bytes, image.evicted_pages, image.freed_pages) == (2, 2 * 160, 6, 6)


def test_host_tiers_count_what_their_eviction_took_and_freed_and_what_did_not_fit():
    P = 4
    fp = Fingerprint("m", page_size=P)
    pool = PagePool(4, (P,), torch.float32)
    stack = TierStack(fp, host=HostTier(HostPagePool.like(pool, 2), P))
    cache = PrefixCache(pool, fp, evict_batch_pages=1, tiers=stack)
    for k in range(3):  # 3-page chains through a 4-page pool: each evicts the last one's pages to a 2-page host tier
        prompt = np.arange(3 * P + 1, dtype=np.int32) + 100 * k
        cache.admit(k, prompt)
        cache.grow(k, prompt.size)
        cache.mark_computed(k, prompt.size)
        cache.finish(k)
    s = stack.stats()
    assert s.host_written_pages + s.host_full_pages == cache.stats().evicted_pages > s.host_written_pages
    assert s.host_evicted_pages == s.host_freed_pages == s.host_written_pages - s.host_pages_held > 0

    host = EncoderHostTier(HostPagePool(4, (64,), torch.uint8))
    assert host.put("a", bytes(130), None) and host.holds("a", None)  # 3 pages; held: a refresh
    assert not host.put("big", bytes(5 * 64), None)  # more than the pool
    assert host.put("b", bytes(65), None)  # 2 pages, 1 free: takes "a" out, 3 pages evicted and freed
    assert host.counters == {"refreshed_entries": 1, "full_entries": 1, "evicted_pages": 3, "freed_pages": 3,
                             "listener_errors": 0}


class NeverOverwrites(MemoryStore):
    """A store like Mooncake's: a put never overwrites (``EXISTS``) and a full store refuses it (``FULL``)."""

    def put(self, key, value):
        if key in self._data:
            return EXISTS
        if len(self._data) >= self.capacity_pages:
            return FULL
        self._data[key] = value
        return STORED


def test_a_shared_store_counts_puts_and_removals_per_kind_each_in_its_kinds_stats():
    store = StoreTier(NeverOverwrites(2), publish_async=False, deadline_s=None)
    store.publish([("mmcache/k", b"a")], "kv")
    store.publish([("mmcache/k", b"a")], "kv")  # held already
    store.publish([("mmcache/e1", b"bb")], "encoder")  # the store is full now
    store.publish([("mmcache/e2", b"cc")], "encoder")  # room made: the KV page, then the encoder entry
    store.discard("mmcache/e2", "encoder")  # refused by a reader
    assert store.kinds == {
        "kv": {"published": 1, "publish_exists": 1, "publish_full": 0, "publish_dropped": 0, "room_removed": 1,
               "refused_removed": 0},
        "encoder": {"published": 2, "publish_exists": 0, "publish_full": 0, "publish_dropped": 0, "room_removed": 1,
                    "refused_removed": 1}}
    assert (store.counters["published_pages"], store.counters["published_entries"]) == (1, 2)  # totals over both
    assert (store.counters["room_removed"], store.counters["refused_removed"]) == (2, 1)
    kv = TierStack(Fingerprint("m", page_size=4), store=store).stats()
    assert (kv.store_published_pages, kv.store_publish_exists, kv.store_room_removed, kv.store_refused_removed) == (
        1, 1, 1, 0)
    encoder = EncoderStore(capacity_bytes=4096, page_bytes=1024, tiers=EncoderTiers(store=store)).stats()
    assert (encoder.host, encoder.store, encoder.store_published_entries, encoder.store_room_removed,
            encoder.store_refused_removed) == (False, True, 2, 1, 1)
