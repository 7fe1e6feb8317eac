"""Cost-aware eviction on one pool holding KV pages and encoder outputs: the policy weighs what a hit on each saves
(a KV page its prefill, ``PrefixCache(page_seconds=)``; an encoder output its forward over its pages, ``compute_s``),
bounded: a costly entry outlives newer cheap ones by at most a share of a turnover, never for good. ``lru`` and the
default ``dip`` weigh no cost; ``dip-costs`` and ``lfu`` do."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidCost
from mmcache.eviction import make_policy
from mmcache.eviction.costs import CostWeight

P = 4
FP = Fingerprint(model="costs", page_size=P)


def shared_pool(policy: str, pages: int = 12):
    """A KV prefix cache and an encoder store on one pool of ``pages`` (a stand-in byte per page for outputs)."""
    pool = PagePool(pages, eviction=policy)
    cache = PrefixCache(pool, FP, evict_batch_pages=1, page_seconds=0.001)  # a page's prefill: 1 ms
    store = EncoderStore(pool=pool, page_data=torch.zeros((pages, 1), dtype=torch.uint8))
    return pool, cache, store


def serve(cache: PrefixCache, rid, tokens: np.ndarray) -> int:
    matched = cache.admit(rid, tokens).matched_tokens
    cache.grow(rid, tokens.size)
    cache.mark_computed(rid, tokens.size)
    cache.finish(rid)
    return matched


@pytest.mark.parametrize("policy, outlives", [("lru", False), ("dip", False), ("dip-costs", True), ("lfu", True)])
def test_an_output_that_saves_more_outlives_newer_kv_pages_for_a_bounded_time(policy, outlives):
    """Prompts whose pages save 1 ms each run through a 12-page pool, then an image's output (50 ms of encoder on one
    page) is stored, then more prompts: after a turnover's worth of new pages recency alone has evicted the output,
    and a policy that weighs what each saves still holds it; three turnovers later every policy has dropped it (its
    weight is capped: it saves 50 times a page's prefill, and counts as twice)."""
    pool, cache, store = shared_pool(policy)
    rng = np.random.default_rng(0)
    prompt = lambda: rng.integers(0, 1000, size=3 * P + 1, dtype=np.int32)  # noqa: E731  3 full pages + a token
    for rid in range(8):  # 32 pages through the pool: the typical cost is a KV page's
        serve(cache, rid, prompt())
    image = EncoderKey(b"\x01" * 16, "vision-tower", "image")
    assert store.put(image, torch.zeros(1, dtype=torch.uint8), compute_s=0.05)
    for rid in range(8, 12):  # 16 new pages: one turnover and a third
        serve(cache, rid, prompt())
    assert (store.get(image) is not None) == outlives
    for rid in range(12, 24):
        serve(cache, rid, prompt())
    assert store.get(image) is None


def test_a_cost_every_entry_shares_changes_no_key():
    """Costs weigh entries against each other only: a pool whose entries all save the same per page keys them as one
    given no cost (an engine that does not say what a page saves)."""
    with_cost, without = (make_policy("dip-costs", 64, lambda: 0) for _ in range(2))
    names = np.arange(1, 41, dtype=np.uint64)
    floors = np.zeros(names.size, dtype=np.int64)
    for step in range(5):
        for policy in (with_cost, without):
            policy.looked_up(names.tolist(), step * 8, held=True)
        assert (with_cost.keys(names, 100 + step, floors, 0.003) == without.keys(names, 100 + step, floors)).all()
        assert with_cost.key(7, 100 + step, 0, 0.003) == without.key(7, 100 + step)


def test_one_outlier_cost_moves_the_typical_cost_a_bounded_step():
    """A thousand pages at 1 ms set the scale; one entry claiming a million times that moves it as if it claimed four
    times (two octaves), for its pages' share; every weight stays within one octave each way."""
    weight = CostWeight()
    weight.octaves(0.001, 1000)
    weight.refresh()
    assert weight.octaves(1000.0, 1) == 1.0 and weight.octaves(1e-9, 1) == -1.0
    weight.refresh()
    assert abs(weight.log_mean - np.log2(0.001)) < 0.01 * 2 * 2 + 1e-9


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, -0.5, "slow", True])
def test_a_cost_that_is_not_a_finite_number_of_seconds_is_refused_before_anything_changes(bad):
    """An infinite cost once made a pool's typical cost NaN, and keys compared with nothing; now each is refused where
    it enters, with one error naming the value, and nothing is stored or registered."""
    pool, cache, store = shared_pool("dip")
    with pytest.raises(InvalidCost, match="compute_s"):
        store.put(EncoderKey(b"\x02" * 16, "vision-tower", "image"), torch.zeros(1, dtype=torch.uint8), compute_s=bad)
    assert len(store) == 0 and pool.num_free == pool.num_pages
    other = PagePool(8)
    with pytest.raises(InvalidCost, match="page_seconds"):
        PrefixCache(other, FP, page_seconds=bad)
    assert other.evictables == []
