"""The host tier (RFC phase 4b): pages evicted from a tiny device pool move to host memory with their verifying ids,
a later lookup continues there and copies them back behind a readiness gate, and a model prefix served that way is
bit-exact against the uncached run on the same chunk schedule. The host budget is split explicitly with offload."""

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from conftest import random_tokens
from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidRequest
from mmcache.hf.paged_kv import PagedKVCache, kv_page_shape
from mmcache.hf.runner import chunk_spans, replay, serve
from mmcache.pool import HostPagePool
from mmcache.tiers import HostBudget, HostTier, TierStack

P, NEW = 4, 5

pytestmark = pytest.mark.usefixtures("one_thread")


def host_tier(pool: PagePool, fp: Fingerprint, host_pages: int) -> tuple[TierStack, HostTier]:
    host = HostTier(HostPagePool.like(pool, host_pages), fp.page_size)
    return TierStack(fp, host=host), host





@pytest.mark.parametrize("dtype,attn", [(torch.float32, "eager"), (torch.bfloat16, "sdpa")])
def test_a_prefix_served_from_the_host_tier_is_bit_exact(llama_folder, dtype, attn):
    model = LlamaForCausalLM.from_pretrained(llama_folder, attn_implementation=attn, dtype=dtype).eval()
    host = HostTier(HostPagePool(32, kv_page_shape(model.config, P), dtype), P)
    kv = PagedKVCache.for_model(model, num_pages=8, page_size=P, evict_batch_pages=1,
                                tiers=TierStack(PagedKVCache.fingerprint_for(model, P), host=host))
    first = random_tokens(13, 1)
    a = serve(model, kv, "a", first, max_new_tokens=NEW, chunk_tokens=P)
    written = (len(first) + NEW - 1) // P * P
    serve(model, kv, "other", random_tokens(22, 2), max_new_tokens=NEW, chunk_tokens=P)  # evicts a's tail to the host
    assert kv.prefix.stats().evicted_pages == host.counters["written_pages"] == written // P - 1
    second = first + a.output_ids + random_tokens(6, 3)
    got = serve(model, kv, "b", second, max_new_tokens=NEW, chunk_tokens=P)
    # page 0 matched on the device, the rest of a's pages in the host tier
    assert got.matched_tokens == written and host.counters["hit_pages"] == written // P - 1
    # the uncached run of the same schedule: a's chunks and decode steps up to the matched length, then b's own
    uncached_a = replay(model, DynamicCache(config=model.config), first + a.output_ids[:-1],
                        chunk_spans(0, len(first), P) + [(i, i + 1) for i in range(len(first), written)])
    prefix = [s for s in uncached_a.spans if s[1] <= written]
    want = replay(model, DynamicCache(config=model.config), second, prefix + [s for s in got.spans
                                                                               if s[1] <= len(second)],
                  max_new_tokens=NEW)
    assert want.output_ids == got.output_ids
    assert all(torch.equal(x, y) for x, y in zip(want.logits[len(prefix):], got.logits))


def test_host_hits_are_gated_and_counted():
    pool = PagePool(4, (P,), torch.float32)
    fp = Fingerprint(model="gate", page_size=P)
    tiers, _ = host_tier(pool, fp, 8)
    cache = PrefixCache(pool, fp, evict_batch_pages=1, tiers=tiers)

    def run(rid, ids):
        s = cache.admit(rid, ids)
        s = cache.grow(rid, len(ids))
        for j in range(s.matched_tokens // P, len(s.page_indices)):
            pool.data[s.page_indices[j]] = float(ids[j * P])
        cache.mark_computed(rid, len(ids))
        cache.finish(rid)
        return s

    run("a", list(range(1, 10)))
    run("b", list(range(20, 33)))  # 4 pages: every page of a goes to the host
    s = run("c", list(range(1, 10)))
    assert s.matched_tokens == 8 and s.fetch is not None and s.fetch.ready and s.fetch.host_pages == 2
    assert [pool.data[p][0].item() for p in s.page_indices[:2]] == [1.0, 5.0]
    # the pages came back into the device index: the next lookup hits on the device, with no fetch
    s = cache.admit("d", list(range(1, 10)))
    assert s.matched_tokens == 8 and s.fetch is None
    cache.abort("d")


def test_a_host_hit_the_device_cannot_hold_is_given_up_not_an_error():
    pool = PagePool(3, (P,), torch.float32)
    fp = Fingerprint(model="full", page_size=P)
    tiers, host = host_tier(pool, fp, 8)
    cache = PrefixCache(pool, fp, evict_batch_pages=1, tiers=tiers)
    cache.admit("a", list(range(1, 10)))
    cache.grow("a", 9)
    cache.mark_computed("a", 9)
    cache.finish("a")
    cache.admit("live", list(range(50, 62)))
    cache.grow("live", 12)  # every device page is live now; a's pages went to the host
    s = cache.admit("c", list(range(1, 10)))
    assert s.matched_tokens == 0 and s.fetch is None and host.pool.num_free + len(host) == 8
    assert (host.pool.counts <= 1).all()  # the pins of the given-up hit were released


def test_the_host_budget_is_split_explicitly():
    pool = PagePool(8, (2, P), torch.float32)
    budget = HostBudget(pool, tier_pages=3, offload_pages=5)
    assert budget.tier is not budget.offload and (budget.tier.num_pages, budget.offload.num_pages) == (3, 5)
    assert not budget.tier.pinned  # pinned memory needs CUDA; the default pins only for a CUDA pool
    fp = Fingerprint(model="split", page_size=P)
    cache = PrefixCache(pool, fp, evict_batch_pages=1, tiers=TierStack(fp, host=HostTier(budget.tier, P)))
    for i in range(9):  # fill the tier (and more): it drops its own coldest pages, never the offload pool's
        ids = random_tokens(9, 10 + i)
        cache.admit(i, ids)
        cache.grow(i, 9)
        cache.mark_computed(i, 9)
        cache.finish(i)
    assert budget.tier.num_free == 0 and budget.offload.num_free == 5
    half = HostBudget.split(pool, 10 * pool.page_bytes, 0.3)
    assert (half.tier.num_pages, half.offload.num_pages) == (3, 7)
    with pytest.raises(InvalidRequest):
        HostBudget(pool, -1, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and the async copy-up need CUDA")
def test_copy_up_from_pinned_memory_is_gated_by_an_event():
    pool = PagePool(2, (P,), torch.float32, device="cuda")
    fp = Fingerprint(model="cuda", page_size=P)
    host = HostTier(HostPagePool.like(pool, 4, pin_memory=True), P)
    cache = PrefixCache(pool, fp, evict_batch_pages=1, tiers=TierStack(fp, host=host))
    for rid, ids in (("a", list(range(1, 10))), ("b", list(range(20, 29)))):
        s = cache.admit(rid, ids)
        s = cache.grow(rid, 9)
        for j, p in enumerate(s.page_indices):
            pool.data[p] = float(ids[j * P])
        cache.mark_computed(rid, 9)
        cache.finish(rid)
    s = cache.admit("c", list(range(1, 10)))
    assert s.fetch is not None and s.fetch.host_pages >= 1
    assert s.fetch._event is not None  # the copy-up went through a CUDA event (nothing has polled it yet)
    s.fetch.wait()
    assert s.fetch.ready and pool.data[s.page_indices[0]][0].item() == 1.0
