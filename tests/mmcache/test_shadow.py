import pytest

from mmcache import Fingerprint, PagePool, PrefixCache, ShadowIndex
from mmcache.errors import UnknownRequest

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


def test_shadow_counts_duplicate_media_per_salt():
    shadow = ShadowIndex(FP)
    shadow.admit("a", list(range(9)), media=[(0, b"img1"), (4, b"img2")])
    shadow.admit("b", list(range(9)), media=[(0, b"img1")])
    shadow.admit("c", list(range(9)), media=[(0, b"img1")], salt=b"tenant")  # another tenant: not a repeat
    s = shadow.stats()
    assert (s.media_items, s.repeated_media) == (4, 1) and s.duplicate_media_rate == 0.25


def test_shadow_replica_spread_counts_replicas_per_repeated_prefix():
    shadow = ShadowIndex(FP)
    for rid, replica in enumerate([0, 0, 1, 2]):       # one 2-page prefix on three replicas
        shadow.admit(rid, list(range(9)), replica=replica)
    shadow.admit("alone", list(range(50, 59)), replica=3)  # seen once: not a repeated prefix
    s = shadow.stats()
    assert (s.replicas, s.repeated_prefixes, s.replica_spread_mean, s.replica_spread_max) == (4, 2, 3.0, 3)
