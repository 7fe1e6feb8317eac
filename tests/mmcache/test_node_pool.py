"""One pool per node: a PrefixCache and an EncoderStore on ONE PagePool, evicted across both kinds by recency."""

import pytest
import torch

from conftest import assert_same_value
from conftest import store_floats as floats
from conftest import store_key as key
from mmcache import Fingerprint
from mmcache.encoder_store import EncoderStore
from mmcache.errors import OutOfPages
from mmcache.pool import PagePool
from mmcache.prefix_cache import PrefixCache

P = 4                      # tokens per page
KV_PAGE = (2, P, 2)        # K/V x tokens x head_dim, float32: 64 bytes per page
PB = 64


def node(num_pages=8):
    pool = PagePool(num_pages, KV_PAGE, torch.float32)
    cache = PrefixCache(pool, Fingerprint(model="tiny", page_size=P), evict_batch_pages=1)
    return pool, cache, EncoderStore(pool=pool)


def serve(cache, rid, tokens):
    cache.admit(rid, tokens)
    cache.grow(rid, len(tokens))
    cache.mark_computed(rid, len(tokens))
    cache.finish(rid)


def test_store_views_a_kv_shaped_pool_as_bytes():
    pool, _, store = node()
    assert store.page_bytes == PB == pool.page_bytes
    v = floats(40)  # 160 bytes: ceil(160 / 64) = 3 pages
    assert store.put(key(0), v)
    assert_same_value(store.get(key(0)), v)
    assert pool.num_free == 5


def test_grow_evicts_encoder_entries_and_encoder_puts_evict_kv():
    pool, cache, store = node(8)
    for i in range(4):
        assert store.put(key(i), floats(16, seed=i))          # one page each: 4 of 8 pages cached encoder outputs
    serve(cache, "a", list(range(12)))                          # 3 KV pages indexed (full pages of a finished request)
    assert pool.num_free == 1
    cache.admit("b", list(range(100, 120)))
    cache.grow("b", 20)          # 5 pages: a live request evicts cached data of either kind, coldest first
    assert key(0) not in store and key(1) not in store and key(2) not in store and key(3) not in store
    assert len(cache.index) == 3  # newer than every encoder entry: kept
    cache.abort("b")
    assert store.put(key(9), floats(16 * 7))                   # 7 pages, 5 free: evicts the KV chain's cold tail
    assert len(cache.index) == 1 and pool.num_free == 0
    assert_same_value(store.get(key(9)), floats(16 * 7))


def test_each_cache_counts_what_happened_to_it():
    """On a shared pool the request that was short counts the eviction (or the stall); the pages count where they
    left from. An encoder put that cannot fit is no stall of the prefix cache."""
    pool, cache, store = node(8)
    for i in range(4):
        assert store.put(key(i), floats(16, seed=i))
    cache.admit("b", list(range(100, 128)))
    cache.grow("b", 28)                                         # 7 pages, 4 free: 3 encoder pages evicted for it
    s = cache.stats()
    assert (s.eviction_batches, s.shortfall_pages, s.evicted_pages, s.stalls) == (1, 3, 0, 0)
    assert store.stats().totals.evictions == 3
    assert not store.put(key(9), floats(16 * 2))                # 2 pages, 1 free, nothing evictable: a bypass
    assert cache.stats().stalls == 0
    with pytest.raises(OutOfPages):
        cache.grow("b", 40)                                     # 10 pages > the pool: the prefix cache's stall
    assert cache.stats().stalls == 1


def test_pinned_and_live_pages_are_never_evicted():
    pool, cache, store = node(8)
    assert store.put(key(0), floats(32))                       # 2 pages
    pin = store.pin(key(0))
    cache.admit("a", list(range(16)))
    cache.grow("a", 16)                                         # 4 live pages
    with pytest.raises(OutOfPages):
        cache.admit("b", [1, 2, 3])
        cache.grow("b", 12)                                     # 3 pages: only 2 free, nothing evictable
    assert key(0) in store and pool.counts[list(pin.pages)].tolist() == [2, 2]
    pin.release()
    cache.grow("b", 12)                                         # now the unpinned entry goes
    assert key(0) not in store
    assert not store.put(key(1), floats(16 * 3))                # every page is live: bypassed, nothing evicted
    assert pool.num_free == 1 and len(store) == 0


def test_one_clock_orders_both_kinds():
    pool, cache, store = node(6)
    assert store.put(key(0), floats(16))                        # oldest
    serve(cache, "a", list(range(9)))                           # 2 KV pages
    assert store.put(key(1), floats(16))
    assert store.get(key(0)) is not None                        # a hit makes key 0 the newest
    assert pool.num_free == 2
    cache.admit("b", list(range(50, 62)))
    cache.grow("b", 12)                                         # 3 pages, 2 free: one cached page goes
    assert key(0) in store and key(1) in store
    assert len(cache.index) == 1                                # the KV chain's deepest page: the coldest


def test_an_entry_with_several_heap_items_is_chosen_once():
    """A policy whose keys fall (the replay's optimum) leaves several heap items of one entry; taking it twice counted
    its pages twice, so a reclaim that seemed to cover a shortfall freed half of it and the allocation after it failed
    (KV pages and encoder outputs on one pool under the optimum)."""
    import heapq

    from mmcache.reclaim import coldest_off_heap

    entry, other = object(), object()
    heap = [(5, 1, entry), (5, 2, entry), (7, 3, other)]
    heapq.heapify(heap)
    chosen = coldest_off_heap(heap, 4, lambda item: 5 if item[2] is entry else 7, lambda item: True,
                              lambda item: 2, ident=lambda item: id(item[2]))
    assert [item[2] for item in chosen] == [entry, other]
