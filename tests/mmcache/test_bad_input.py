"""Every bad input raises an mmcache error that names the problem, before any state changes."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from digests.digest import Digest, hasher
from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache, ShadowIndex, page_names
from mmcache.errors import InvalidRequest, MmcacheError

P = 4
FP = Fingerprint("org/m@rev", page_size=P)
PROMPT = list(range(1, 11))  # 2 full pages + 2 tokens

BAD_INTS = [1.5, 7.0, "7", None, True, np.float64(2.0), [3]]
BAD_NAMES = [[-1, -2], [2**64, 1], [1.5, 2.0], ["1", "2"], [None, 1], [[1], [2]], [{}, {}], [1]]


def snapshot(cache: PrefixCache):
    return (cache.stats(), cache.pool.counts.tobytes(), list(cache.pool._free),
            {rid: cache.state(rid) for rid in cache._live})


def live_cache():
    cache = PrefixCache(PagePool(16), FP)
    cache.admit("a", PROMPT)
    cache.grow("a", 12)
    cache.mark_computed("a", 10)
    return cache


@pytest.mark.parametrize("bad", BAD_INTS)
def test_counts_must_be_integers(bad):
    cache = live_cache()
    before = snapshot(cache)
    for call in (lambda: cache.grow("a", bad), lambda: cache.mark_computed("a", bad),
                 lambda: cache.protect_prefix("a", bad), lambda: cache.release_oldest("a", bad),
                 lambda: cache.pool.alloc(bad)):
        with pytest.raises(InvalidRequest, match="integer"):
            call()
    assert snapshot(cache) == before


def test_numpy_integers_are_counts():
    cache = live_cache()
    assert cache.grow("a", np.int64(16)).seq_len == 16 and len(cache.pool.alloc(np.uint8(2))) == 2


@pytest.mark.parametrize("bad", [[1.7], ["0"], [True], [[0], [1, 2]], [None], np.array([0.0])])
def test_page_ids_must_be_integers(bad):
    pool = PagePool(4)
    pool.alloc(2)
    before = (pool.counts.tobytes(), list(pool._free))
    with pytest.raises(InvalidRequest, match="page ids"):
        pool.release(bad)
    with pytest.raises(InvalidRequest, match="page ids"):
        pool.retain(bad)
    assert (pool.counts.tobytes(), list(pool._free)) == before
    assert pool.release(np.array([1], dtype=np.int32)) == [1]  # integer dtypes are ids


@pytest.mark.parametrize("bad", [0, -3, 2.0, "4", True])
def test_pool_size_and_allocation_counts(bad):
    with pytest.raises(InvalidRequest):
        PagePool(bad)
    with pytest.raises(InvalidRequest):
        PagePool(4).alloc(-1)


@pytest.mark.parametrize("names", BAD_NAMES)
def test_bad_names_are_refused_at_admit_in_cache_and_shadow(names):
    cache = live_cache()
    before = snapshot(cache)
    with pytest.raises(InvalidRequest, match="names"):
        cache.admit("b", PROMPT, names=names)
    assert snapshot(cache) == before and "b" not in cache._live
    shadow = ShadowIndex(FP)
    with pytest.raises(InvalidRequest, match="names"):
        shadow.admit("b", PROMPT, names=names)
    assert not shadow.records and not shadow._live and not shadow._inflight


def test_shadow_checks_the_name_count_so_a_later_admit_still_works():
    shadow = ShadowIndex(FP)
    with pytest.raises(InvalidRequest, match="2 full pages"):
        shadow.admit("a", PROMPT, names=[1])
    shadow.admit("b", PROMPT, names=[1, 2])
    shadow.finish("b")
    assert shadow.admit("c", PROMPT, names=np.array([1, 2], dtype=np.uint64)).matched_pages == 2


@pytest.mark.parametrize("tokens", [[[1, 2], [3, 4]], [[1, 2], [3]], 5, np.zeros((2, 1, 3), dtype=np.int32)])
def test_token_ids_must_be_one_flat_prompt(tokens):
    cache = live_cache()
    before = snapshot(cache)
    with pytest.raises(InvalidRequest, match="token ids"):
        cache.admit("b", tokens)
    assert snapshot(cache) == before


def test_a_batch_of_one_row_is_its_prompt():
    cache = PrefixCache(PagePool(8), FP)
    assert cache.admit("a", torch.tensor([PROMPT])).seq_len == 0 and cache.state("a").rid == "a"
    assert (cache._live["a"].claim.prompt.tokens == PROMPT).all()


@pytest.mark.parametrize("media", [[(True, b"x" * 16)], [(1, b"")], [(1, True)], [(1, "abc")]])
def test_bad_media_marks_are_refused(media):
    cache = live_cache()
    before = snapshot(cache)
    with pytest.raises(InvalidRequest):
        cache.admit("b", PROMPT, media=media)
    assert snapshot(cache) == before


@pytest.mark.parametrize("digest", [None, b"", "abc", 5, True, object()])
def test_encoder_key_digest_must_be_bytes(digest):
    with pytest.raises(InvalidRequest, match="digest"):
        EncoderKey(digest, "enc", "image")


@pytest.mark.parametrize("key", ["str", Digest("xxh3_128", b"d" * 16), None, ("d", "enc")])
def test_encoder_store_needs_an_encoder_key(key):
    store = EncoderStore(capacity_bytes=4096, page_bytes=1024)
    for call in (lambda: store.get(key), lambda: store.put(key, torch.ones(2)), lambda: store.pin(key),
                 lambda: store.get_or_compute(key, lambda: torch.ones(2)), lambda: key in store):
        with pytest.raises(InvalidRequest, match="EncoderKey"):
            call()
    assert store.stats().totals.queries == 0 and len(store) == 0 and store.pool.num_free == 4


@pytest.mark.parametrize("kw", [dict(capacity_bytes=10, page_bytes=1024), dict(capacity_bytes=4096, page_bytes=0),
                                dict(capacity_bytes=4096.0), dict(), dict(capacity_bytes=4096, pool=PagePool(2, (8,)))])
def test_encoder_store_sizes(kw):
    with pytest.raises(InvalidRequest):
        EncoderStore(**kw)


def test_unknown_digest_algorithm():
    with pytest.raises(InvalidRequest, match="md5"):
        hasher("md5")


# ------------------------------------------------------------------ property: bad input never changes state
# Bools are refused as counts (above) and as all-bool arrays; inside a list of ints they are ints, as in numpy.
# Huge counts are well-formed: grow(2**64) is an OutOfPages that counts a stall, by design.
junk = st.one_of(st.floats(allow_nan=False), st.text(max_size=3), st.none(), st.integers(max_value=-1))


@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "mark", "protect", "oldest", "alloc", "release", "retain",
                                                "names", "tokens"]), junk), min_size=1, max_size=12))
def test_bad_input_leaves_pool_and_cache_exactly_as_they_were(ops):
    cache = live_cache()
    cache.admit("z", PROMPT[:5])
    before = snapshot(cache)
    calls = {
        "grow": lambda x: cache.grow("a", x),
        "mark": lambda x: cache.mark_computed("a", x),
        "protect": lambda x: cache.protect_prefix("a", x),
        "oldest": lambda x: cache.release_oldest("a", x),
        "alloc": lambda x: cache.pool.alloc(x),
        "release": lambda x: cache.pool.release([x]),
        "retain": lambda x: cache.pool.retain([x]),
        "names": lambda x: cache.admit("b", PROMPT, names=[1, x]),
        "tokens": lambda x: cache.admit("b", [1, 2, x]),
    }
    for op, x in ops:
        with pytest.raises(MmcacheError):  # InvalidRequest, or PageOwnershipError for an integer id out of range
            calls[op](x)
        assert snapshot(cache) == before


def test_numpy_integer_names_are_names_and_their_chain_extends():
    cache = PrefixCache(PagePool(16), FP)
    toks = list(range(1, 14))
    cache.admit("a", toks, names=[np.uint64(x) for x in page_names(FP, toks)])
    cache.grow("a", 20)
    cache.mark_computed("a", 20)
    assert cache.finish("a", list(range(20, 27))) == 5
    assert cache.admit("b", toks + list(range(20, 27)) + [1]).matched_tokens == 20
