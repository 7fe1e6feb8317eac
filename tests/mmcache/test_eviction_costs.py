"""Cost-aware eviction on one pool holding KV pages and encoder outputs: the policy weighs what a hit on each saves
(a KV page its prefill, ``PrefixCache(page_seconds=)``; an encoder output its forward over its pages, ``compute_s``),
so what saves most stays; ``lru`` weighs recency alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache

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


@pytest.mark.parametrize("policy, kept", [("lru", False), ("odds", True), ("lfu", True)])
def test_an_output_that_saves_more_outlives_newer_kv_pages(policy, kept):
    """Prompts whose pages save 1 ms each run through the pool, then an image's output (50 ms of encoder on one
    page) is stored, then more prompts fill the pool past its size: recency alone evicts the output first; a policy
    that weighs what each saves keeps it. (Costs read against the mean of those keyed so far, so the first entries
    of a fresh pool read as average: the prompts before the image set the scale.)"""
    pool, cache, store = shared_pool(policy)
    rng = np.random.default_rng(0)
    prompt = lambda: rng.integers(0, 1000, size=3 * P + 1, dtype=np.int32)  # noqa: E731  3 full pages + a token
    for rid in range(6):  # 24 pages through a 12-page pool
        serve(cache, rid, prompt())
    image = EncoderKey(b"\x01" * 16, "vision-tower", "image")
    assert store.put(image, torch.zeros(1, dtype=torch.uint8), compute_s=0.05)
    for rid in range(6, 12):
        serve(cache, rid, prompt())
    assert (store.get(image) is not None) == kept


def test_a_cost_every_entry_shares_changes_no_key():
    """Costs weigh entries against each other only: a pool whose entries all save the same per page keys them as one
    given no cost (an engine that does not say what a page saves), by the count rule alone."""
    from mmcache.eviction import make_policy
    with_cost, without = (make_policy("odds", 64, lambda: 0) for _ in range(2))
    names = np.arange(1, 41, dtype=np.uint64)
    for policy in (with_cost, without):
        policy.looked_up(names.tolist())
    floors = np.zeros(names.size, dtype=np.int64)
    assert (with_cost.keys(names, 100, floors, 0.003) == without.keys(names, 100, floors)).all()  # one cost: average
    assert with_cost.key(7, 100, 0, 0.003) == without.key(7, 100)
