from mmcache import Fingerprint, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import UnknownRequest

import pytest

FP = Fingerprint("m", page_size=4)


def test_shadow_matches_what_an_unbounded_cache_realizes():
    prompts = [list(range(12)) + [i] * 3 for i in range(5)] + [list(range(30))]
    shadow, cache = ShadowIndex(FP), PrefixCache(PagePool(1000), FP)
    for rid, prompt in enumerate(prompts):
        want = cache.admit(rid, prompt).matched_tokens // 4
        assert shadow.admit(rid, prompt).matched_pages == want
        cache.grow(rid, len(prompt) + 4)
        cache.mark_computed(rid, len(prompt) + 4)
        cache.finish(rid, [9, 9, 9, 9])
        shadow.finish(rid, [9, 9, 9, 9])
    s = shadow.stats()
    assert s.requests == 6 and s.matched_pages == sum(r.matched_pages for r in shadow.records) > 0


def test_shadow_records_misses_that_an_in_flight_request_held():
    shadow = ShadowIndex(FP)
    shadow.admit("a", list(range(17)))
    m = shadow.admit("b", list(range(17)))                          # a has not finished: nothing matches yet
    assert m.matched_pages == 0 and m.inflight_pages == 4
    shadow.finish("a")
    assert shadow.admit("c", list(range(17))).matched_pages == 4
    assert shadow.stats().misses_held_in_flight == 1


def test_shadow_verifies_like_the_cache_and_rejects_unknown_ids():
    shadow = ShadowIndex(FP)
    shadow.admit("a", list(range(9)), names=[1, 2])
    shadow.finish("a")
    assert shadow.admit("b", list(range(100, 109)), names=[1, 2]).matched_pages == 0
    assert shadow.admit("c", list(range(9)), salt=b"x", names=[1, 2]).matched_pages == 0
    with pytest.raises(UnknownRequest):
        shadow.finish("zzz")
