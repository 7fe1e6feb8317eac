import dataclasses
import threading

import numpy as np
import pytest
import torch

from mmcache import Fingerprint, OutOfPages, PagePool, PrefixCache, page_names
from mmcache.errors import DuplicateRequest, InvalidRequest, UnknownRequest
from mmcache.reclaim import coldest_of

P = 4
FP = Fingerprint(model="org/m@rev", page_size=P)


def make(num_pages=32, data=False, **kw):
    pool = PagePool(num_pages, (P,) if data else (), torch.int64)
    return PrefixCache(pool, FP, **kw)


def serve(cache, rid, prompt, output=(), computed=None, **kw):
    """Run one request the way an engine would: admit, prefill, decode, finish."""
    st = cache.admit(rid, prompt, **kw)
    total = len(prompt) + len(output)
    cache.grow(rid, total)
    cache.mark_computed(rid, total if computed is None else computed)
    cache.finish(rid, output)
    return st


def test_second_request_hits_prompt_and_generated_pages():
    cache = make()
    first = serve(cache, "a", list(range(10)), output=[50, 51, 52, 53, 54])
    assert first.matched_tokens == 0
    again = cache.admit("b", list(range(10)) + [50, 51, 52, 53, 54, 99])
    assert again.matched_tokens == 12 and again.seq_len == 12 and again.position_id_start == 0
    assert len(again.page_indices) == 3
    s = cache.stats()
    assert s.hits == 1 and s.hit_tokens == 12 and s.pages_live == 3 and s.requests_live == 1


def test_full_match_still_leaves_the_last_token_to_compute():
    cache = make()
    serve(cache, "a", list(range(8)))
    assert cache.admit("b", list(range(8))).matched_tokens == 4      # floor((8-1)/4) pages
    assert cache.admit("c", list(range(9))).matched_tokens == 8


def test_forced_collision_all_names_equal_stays_exact():
    cache = make(data=True)

    def collide(n):  # every page has the same name
        return [7] * (n // P)

    a, b = list(range(12)), list(range(100, 112))
    serve(cache, "a", a, names=collide(12))
    assert cache.admit("b", b, names=collide(12)).matched_tokens == 0
    cache.abort("b")
    # same prompt: page 0 verifies, page 1 is nominated as a's page 0 again and fails the parent check
    assert cache.admit("c", a + [1], names=collide(13)).matched_tokens == 4
    assert cache.stats().collisions == 3      # a's own finish stopped at page 1, then b and c
    assert cache.stats().pages_cached == 1


@pytest.mark.parametrize("pages", [6, 70])  # a request's few pages, and a chain longer than the pool's scalar paths
@pytest.mark.parametrize("differ", ["token", "media", "salt", "parent"])
def test_every_verifying_id_is_compared_on_short_and_long_chains(pages, differ):
    """Names forced equal to the cached prompt's: the one verifying id that differs (a token, the media, the salt, the
    parent) stops the match at its page, costing one counted collision."""
    cache = make(num_pages=4 * pages)
    n, k = pages * P + 1, pages // 2  # page k is where the second prompt's verifying ids differ
    a = list(range(n))
    media_a = [(k * P, b"image-a")]
    serve(cache, "a", a, media=media_a, salt=b"s")
    names = page_names(FP, a, media_a, salt=b"s")
    b, media_b, salt_b = list(a), list(media_a), b"s"
    if differ == "token":
        b[k * P + 1] += 1000
    elif differ == "media":
        media_b = [(k * P, b"image-b")]
    elif differ == "salt":
        salt_b, k = b"t", 0
    else:  # a name that repeats an earlier page's: nominated, then refused by the parent check
        names = names[:k] + [names[k - 1]] + names[k + 1:]
    st = cache.admit("b", b, media=media_b, salt=salt_b, names=names)
    assert st.matched_tokens == k * P
    assert cache.stats().collisions == 1


def test_salts_never_share_pages():
    cache = make()
    serve(cache, "a", list(range(12)), salt=b"tenant-a")
    assert cache.admit("b", list(range(12)), salt=b"tenant-b").matched_tokens == 0
    assert cache.admit("c", list(range(12)), salt=b"tenant-a").matched_tokens == 8
    # given names that ignore the salt still cannot cross tenants: the salt is a verifying id
    names = page_names(FP, list(range(12)), salt=b"tenant-a")
    assert cache.admit("d", list(range(12)), salt=b"tenant-b", names=names).matched_tokens == 0


def test_nothing_matches_across_fingerprints():
    pool = PagePool(32)
    old = PrefixCache(pool, FP)
    serve(old, "a", list(range(12)))
    new = PrefixCache(pool, Fingerprint(model="org/m@rev2", page_size=P))
    assert new.admit("a", list(range(12))).matched_tokens == 0


def test_different_image_behind_same_text_never_hits():
    cache = make()
    prompt = list(range(12))
    serve(cache, "a", prompt, media=[(1, b"image-A" * 3)])
    assert cache.admit("b", prompt, media=[(1, b"image-B" * 3)]).matched_tokens == 0
    assert cache.admit("c", prompt, media=[(1, b"image-A" * 3)]).matched_tokens == 8
    assert cache.admit("d", prompt).matched_tokens == 0


def test_teardown_mid_prefill_indexes_only_written_pages():
    cache = make()
    cache.admit("a", list(range(20)))
    cache.grow("a", 20)
    cache.mark_computed("a", 10)                                     # 2 full pages written, the third half
    assert cache.finish("a") == 2
    assert cache.admit("b", list(range(20))).matched_tokens == 8
    assert cache.stats().pages_cached == 2


def test_equal_pages_are_not_duplicated_when_two_requests_finish():
    cache = make()
    for rid in "ab":                                                 # both in flight: neither hits
        cache.admit(rid, list(range(12)))
        cache.grow(rid, 12)
        cache.mark_computed(rid, 12)
    assert cache.finish("a") == 3 and cache.finish("b") == 0
    s = cache.stats()
    assert s.pages_cached == 3 and s.pages_free == 32 - 3


def test_bytes_written_by_one_request_are_read_by_the_next():
    cache = make(data=True)
    prompt = list(range(100, 113))
    st = cache.admit("a", prompt)
    st = cache.grow("a", len(prompt))
    kv = torch.arange(1000, 1000 + 4 * P).reshape(4, P)             # stand-in KV, one row per page
    cache.pool.data[list(st.page_indices)] = kv
    cache.mark_computed("a", len(prompt))
    cache.finish("a")
    hit = cache.admit("b", prompt)
    assert torch.equal(cache.pool.data[list(hit.page_indices)], kv[:3])


def test_eviction_drops_cold_tails_first_and_live_requests_never_fail_because_of_cache():
    cache = make(num_pages=8, evict_batch_pages=1)
    serve(cache, "old", list(range(16)))                             # 4 cached pages
    serve(cache, "new", list(range(100, 108)))                       # 2 cached pages, hotter
    cache.admit("x", list(range(200, 220)))
    cache.grow("x", 20)                                              # 5 pages: needs 3 evicted
    s = cache.stats()
    assert s.evicted_pages == 3 and s.stalls == 0
    # the cold run lost its tail, not its head; the hot run is intact
    cache.abort("x")
    assert cache.admit("old2", list(range(16))).matched_tokens == 4
    assert cache.admit("new2", list(range(100, 108)) + [1]).matched_tokens == 8


def test_out_of_pages_only_when_live_demand_exceeds_the_pool_and_changes_nothing():
    cache = make(num_pages=4)
    serve(cache, "cached", list(range(8)))
    cache.admit("a", list(range(100, 112)))
    cache.grow("a", 12)                                             # 3 pages live, cache evicted as needed
    before = cache.stats()
    with pytest.raises(OutOfPages) as err:
        cache.grow("a", 24)                                          # 6 pages > 4
    assert err.value.shortfall == 2
    after = cache.stats()
    assert after.stalls == before.stalls + 1
    assert dataclasses.replace(after, stalls=before.stalls) == before
    assert cache.state("a").seq_len == 12


def test_eviction_is_batched_under_saturation():
    cache = make(num_pages=64, evict_batch_pages=8)
    for i in range(40):                                              # distinct prompts fill the pool
        serve(cache, i, [i] * 8 + [1])
    s = cache.stats()
    assert s.stalls == 0 and s.evicted_pages >= s.shortfall_pages
    assert s.evicted_pages / s.eviction_batches >= 8


def test_suspend_releases_shared_pages_and_resume_relooks_them_up():
    cache = make()
    serve(cache, "a", list(range(12)))
    st = cache.admit("b", list(range(12)) + [5] * 6)
    cache.grow("b", 18)
    cache.mark_computed("b", 18)
    own = cache.suspend("b")  # page 3 was indexed when its KV was written: only the tail page is b's alone
    assert st.matched_tokens == 12 and len(own) == 1 and cache.state("b").position_id_start == 16
    assert cache.stats().pages_live == 1
    with pytest.raises(InvalidRequest):
        cache.grow("b", 30)                                          # suspended requests do not grow
    back = cache.resume("b")
    assert back.page_indices[:3] == st.page_indices and back.computed_tokens == 18
    cache.finish("b")
    assert cache.admit("c", list(range(12)) + [5] * 6 + [0]).matched_tokens == 16


def test_suspend_ranks_the_prefix_it_releases_as_used_until_now():
    """A preempted request used its matched prefix until it was suspended: under lru those pages are as recent as the
    suspension, so a later shortfall evicts an older cached prompt first, not the prefix the request will come back
    to."""
    pool = PagePool(12, (), torch.int64, eviction="lru")
    cache = PrefixCache(pool, FP, evict_batch_pages=1)
    serve(cache, "a", list(range(12)))             # 3 pages: the prefix b will match
    serve(cache, "old", list(range(100, 112)))     # 3 pages, used after a's
    cache.admit("b", list(range(12)) + [5, 5])
    cache.grow("b", 14)
    cache.suspend("b")                             # releases a's three pages, used until now
    cache.admit("hog", list(range(200, 224)))
    cache.grow("hog", 24)                          # 6 pages: 3 cached pages must go
    cache.abort("hog", discard=True)
    assert cache.resume("b").matched_tokens == 12  # the older prompt went, the prefix stayed


def test_resume_after_eviction_recomputes_the_gap():
    cache = make(num_pages=8, evict_batch_pages=1)
    serve(cache, "a", list(range(12)))
    cache.admit("b", list(range(12)) + [5, 5])
    cache.grow("b", 14)
    cache.mark_computed("b", 14)
    cache.suspend("b")
    cache.admit("hog", list(range(100, 128)))
    cache.grow("hog", 28)                                            # 7 pages: the shared prefix is evicted
    cache.abort("hog")
    back = cache.resume("b")
    assert back.matched_tokens == 0 and back.computed_tokens == 0 and len(back.page_indices) == 4


def test_errors_are_clear_and_change_nothing():
    cache = make()
    serve(cache, "done", list(range(12)))
    cache.admit("a", list(range(12)))
    before = cache.stats()
    with pytest.raises(UnknownRequest, match="already ended"):
        cache.grow("done", 20)
    with pytest.raises(UnknownRequest, match="never admitted"):
        cache.finish("ghost")
    with pytest.raises(DuplicateRequest):
        cache.admit("a", [1, 2])
    with pytest.raises(InvalidRequest):
        cache.grow("a", 3)                                           # below the 8 matched tokens
    with pytest.raises(InvalidRequest):
        cache.mark_computed("a", 9)                                  # beyond what is held
    with pytest.raises(InvalidRequest):
        cache.admit("z", [1, -2])
    with pytest.raises(InvalidRequest):
        cache.admit("z", [])
    with pytest.raises(InvalidRequest):
        cache.admit("z", [1, 2], salt="text")
    with pytest.raises(InvalidRequest):
        cache.admit("z", list(range(8)), names=[1])                  # one name for two full pages
    with pytest.raises(InvalidRequest):
        cache.resume("a")                                            # not suspended
    assert cache.stats() == before
    cache.finish("a")
    with pytest.raises(UnknownRequest):
        cache.finish("a")                                            # double teardown


def test_vocab_size_bounds_tokens():
    cache = make(vocab_size=100)
    with pytest.raises(InvalidRequest):
        cache.admit("a", [5, 100])


def test_concurrent_requests_from_threads_keep_counts_exact():
    cache = make(num_pages=256)
    prompts = [list(range(i % 5 * 8)) + [i] * 9 for i in range(200)]

    def worker(k):
        for i in range(k, 200, 4):
            serve(cache, i, prompts[i], output=[1, 2, 3])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = cache.stats()
    assert s.requests_live == 0 and s.pages_live == 0
    assert (cache.pool.counts == cache.index.indexed).all()              # every owned page is owned by the index alone
    cache.clear()
    assert cache.pool.num_free == 256


def test_windowed_label_stores_only_its_protected_prefix_and_releases_through_counts():
    cache = make(num_pages=16)
    serve(cache, "shared", list(range(16)))                          # 4 pages in the index
    st = cache.admit("w", list(range(16)) + [7] * 12)                # matches the 4 shared pages
    assert st.matched_tokens == 16
    cache.grow("w", 28)
    cache.mark_computed("w", 28)
    cache.protect_prefix("w", 4)
    shared_page = st.page_indices[1]
    st = cache.release_oldest("w", 2)                                # positions 1 and 2: index pages
    assert st.released_tokens == 8 and st.protected_tokens == 4 and len(st.page_indices) == 5
    assert cache.pool.counts[shared_page] == 1                       # decremented, not freed: the index holds it
    with pytest.raises(InvalidRequest):
        cache.release_oldest("w", 5)                                 # would reach the tail page
    with pytest.raises(InvalidRequest):
        cache.suspend("w")
    # positions 4-6 were indexed when written, before any release (a fresh prefill writes the same KV); nothing of
    # the request is indexed after the window
    assert cache.finish("w", [1, 2, 3, 4]) == 3
    s = cache.stats()
    assert s.pages_cached == 7 and s.pages_live == 0


def test_windowed_request_grows_past_its_released_window():
    cache = make(num_pages=6)
    cache.admit("w", list(range(8)))
    cache.grow("w", 16)
    cache.mark_computed("w", 16)
    cache.protect_prefix("w", 4)
    cache.release_oldest("w", 2)                                     # holds pages at positions 0 and 3
    st = cache.grow("w", 24)                                         # positions 4 and 5: two new pages
    assert len(st.page_indices) == 4 and cache.stats().pages_live == 4


def test_offload_releases_own_pages_and_resume_gives_fresh_ones_at_the_same_positions():
    cache = make(num_pages=8, data=True)
    serve(cache, "a", list(range(12)))
    st = cache.admit("b", list(range(12)) + [5] * 6)
    st = cache.grow("b", 18)
    kv = torch.arange(100, 100 + 5 * P).reshape(5, P)
    cache.pool.data[list(st.page_indices[3:])] = kv[3:]
    cache.mark_computed("b", 18)
    own = cache.suspend("b")
    saved = cache.pool.data[own].clone()                             # the engine copies them to host memory
    # page 3 was indexed when its KV was written, so it stays resident for the index: only the tail is b's alone
    assert cache.release_suspended("b") == 1 and cache.stats().pages_live == 0
    back = cache.resume("b")
    assert back.computed_tokens == 18 and len(back.page_indices) == 5
    cache.pool.data[list(back.page_indices[4:])] = saved             # ...and back into the fresh page
    cache.finish("b")
    hit = cache.admit("c", list(range(12)) + [5] * 6 + [0])
    assert torch.equal(cache.pool.data[list(hit.page_indices[3:4])], kv[3:4])


def test_unnamed_request_holds_pages_but_is_never_matched_nor_indexed():
    cache = make(num_pages=8)
    st = cache.admit_unnamed("u")
    assert (st.seq_len, st.matched_tokens, st.page_indices) == (0, 0, ())
    with pytest.raises(DuplicateRequest):
        cache.admit_unnamed("u")
    cache.grow("u", 10)
    cache.mark_computed("u", 10)
    assert cache.finish("u") == 0 and cache.pool.num_free == 8
    s = cache.stats()
    assert (s.queries, s.pages_cached, s.requests_live) == (0, 0, 0)


def test_vocab_size_is_public_and_read_only():
    assert make(vocab_size=100).vocab_size == 100 and make().vocab_size == 2**31 - 1
    with pytest.raises(AttributeError):
        make().vocab_size = 5


def test_a_reused_parent_page_never_verifies_a_stale_child():
    """The wrong hit of a windowed request (issue 17): its released matched page was evicted and handed to another
    chain while the page's children stayed indexed under its page id; a name colliding with a stale child then
    verified. Children now leave the index with their parent, so the collision costs a miss."""
    P = 2
    pool = PagePool(8, (P,), torch.int64)
    c = PrefixCache(pool, Fingerprint("m", page_size=P), evict_batch_pages=1)

    def prefill(rid, toks, names, tag):
        st = c.admit(rid, toks, names=names)
        k = st.matched_tokens
        st = c.grow(rid, len(toks))
        for j, p in enumerate(st.page_indices):
            if j * P >= k:
                pool.data[p] = tag * 100 + j
        c.mark_computed(rid, len(toks))

    A = [1, 1, 2, 2, 3, 3, 9]
    prefill("a", A, [10, 11, 12], tag=1)
    c.finish("a")
    c.admit("w", A, names=[10, 11, 12])
    c.grow("w", 9)
    c.release_oldest("w", 2)
    c.admit_unnamed("hog")
    c.grow("hog", P * (pool.num_free - 1))
    prefill("b", [5, 5, 2, 2, 9], [20, 11], tag=2)
    c.finish("b")
    st = c.admit("victim", [5, 5, 2, 2, 3, 3, 9], names=[20, 11, 12])
    served = [int(pool.data[p][0]) for p in st.page_indices]
    assert served in ([], [200], [200, 201]), served            # never a page computed after another prefix


def test_marks_of_several_requests_and_a_finish_that_marks_index_what_one_by_one_marks_do():
    """``mark_computed_many`` and ``finish(computed_tokens=)`` (the continuous-batching allocator's calls) index
    exactly what ``mark_computed`` then ``finish`` would; a bad mark or a repeated request changes nothing."""
    prompts = {"a": list(range(10, 21)), "b": list(range(10, 19)) + [50, 51]}
    caches = [make(), make()]
    for cache in caches:
        for rid, p in prompts.items():
            cache.admit(rid, p)
            cache.grow(rid, len(p) + 6)
    one, many = caches
    for rid in prompts:
        one.mark_computed(rid, 8)
    many.mark_computed_many([(rid, 8, None) for rid in prompts])
    with pytest.raises(InvalidRequest):
        many.mark_computed_many([("a", 12, None), ("b", 40, None)])   # b beyond what it holds
    with pytest.raises(InvalidRequest, match="more than once"):
        many.mark_computed_many([("a", 12, None), ("a", 12, None)])
    with pytest.raises(InvalidRequest):
        many.finish("a", [1, 2, 3, 4, 5], computed_tokens=4)              # below what is computed
    assert many.state("a").computed_tokens == many.state("b").computed_tokens == 8
    one.mark_computed("a", 16, output_ids=[1, 2, 3, 4, 5])
    assert one.finish("a", [1, 2, 3, 4, 5]) == many.finish("a", [1, 2, 3, 4, 5], computed_tokens=16) == 4
    for cache in caches:
        cache.finish("b")
    assert one.stats() == many.stats()
    assert one.admit("c", prompts["a"] + [1, 2, 3, 4, 5, 9]).matched_tokens == 16
    assert many.admit("c", prompts["a"] + [1, 2, 3, 4, 5, 9]).matched_tokens == 16


def test_unindexing_a_page_listed_twice_drops_it_once():
    """``PrefixIndex.remove`` takes pages as listed (a caller may repeat one): each leaves the index and gives back
    the index's owner once (a few pages: the one-by-one path)."""
    c = PrefixCache(PagePool(32), FP)
    c.admit("a", list(range(1, 14)))
    c.grow("a", 13)
    c.finish("a", computed_tokens=13)
    pages = sorted(c.index._pages.values())
    assert len(pages) == 3
    assert c.index.remove(pages + pages[-1:]) == 3
    assert c.pool.num_free == 32 and not c.index._pages


def reference_coldest(index, n):
    """What a pass over the pool chooses: the ``n`` lowest ``(key, page)`` pairs of ``eviction_candidates``."""
    pages, keys = index.eviction_candidates()
    return sorted(zip(keys.tolist(), pages.tolist()))[:n]


def heap_coldest(index, n):
    """``index.coldest(n)`` as ``(key, page)`` pairs, on a copy of the heap: the refreshes and drops it makes never
    help the sequence under test."""
    saved = list(index._cold)
    try:
        pages, keys = index.coldest(n)
    finally:
        index._cold = saved
    return [(int(k), int(p)) for k, p in zip(keys, pages)]


def test_the_coldest_page_is_found_past_many_colder_pages_that_live_requests_hold(monkeypatch):
    """More than ``SCALAR_PAGES`` held pages colder than every cached one: ``coldest`` gives up on the heap and
    makes the pass over the pool, and the heap keeps every entry (a later eviction still finds them)."""
    import mmcache.prefix_index as prefix_index
    from mmcache.pool import SCALAR_PAGES

    passes = []
    monkeypatch.setattr(prefix_index, "coldest_of", lambda found, n: (passes.append(n), coldest_of(found, n))[1])

    cache = make(num_pages=4 * SCALAR_PAGES, evict_batch_pages=1)
    for i in range(SCALAR_PAGES + 8):  # one indexed page each, held by its live request: cold but not evictable
        cache.admit(("held", i), [1000 + i] * P + [1])
        cache.grow(("held", i), P + 1)
        cache.mark_computed(("held", i), P + 1)
    serve(cache, "cached", list(range(P)) + [1])  # hotter than every held page, and only the index holds it
    index = cache.index
    entries = len(index._cold)
    pages, keys = index.coldest(1)
    assert passes == [1], "more held pages than SCALAR_PAGES came first: the pass over the pool answers"
    assert [(int(k), int(p)) for k, p in zip(keys, pages)] == reference_coldest(index, 1) != []
    assert len(index._cold) == entries
    for i in range(SCALAR_PAGES + 8):
        cache.finish(("held", i))
    assert heap_coldest(index, 3) == reference_coldest(index, 3) and passes == [1]  # from the heap again


def test_churn_keeps_the_heap_bounded_and_its_answer_exact():
    """Requests through a pool of 32 (evicting at every one) and through one of 256 whose pages are unindexed
    while hot (no eviction drops their entries as they reach the top): the heap stays within its bound (entries of
    pages gone are dropped at the top or by a rebuild) and ``coldest`` stays what the pass over the pool finds."""
    for pages, unindex in ((32, False), (256, True)):
        cache = make(num_pages=pages, evict_batch_pages=1)
        index = cache.index
        for i in range(600):
            serve(cache, i, [i % 97, i % 89, i % 7, 3] * 2 + [i % 5] * (i % 3), output=[i % 11] * (i % 6))
            if unindex:
                idx = np.flatnonzero(index.indexed)
                index.remove(idx[index._tick[idx] == index._tick[idx].max()].tolist())
            if i % 50 == 0:
                for n in (1, 4, 9):
                    assert heap_coldest(index, n) == reference_coldest(index, n)
            assert len(index._cold) <= 2 * pages + 4 * 64
        assert cache.stats().evicted_pages > 300 or unindex
