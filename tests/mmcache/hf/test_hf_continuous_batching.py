"""mmcache under transformers' continuous-batching engine (``mmcache.hf.continuous_batching``), on the tiny Llama.

- the private engine API the allocator relies on is where it expects (this test fails first when transformers moves
  it);
- cache on generates what plain ``generate`` does and what the engine with sharing off does, at one and three in
  flight, with log-probabilities equal to the sharing-off engine's within float32 noise (the batch schedules differ:
  a hit prefills fewer tokens per step, so bit equality of logits is not reachable through this engine);
- with the engine's sharing off, mmcache under it matches and indexes nothing (requests are admitted unnamed);
- every page name equal (a forced collision) changes no output and matches no unrelated prompt;
- two tenants with salts share nothing, one tenant twice does;
- a pool barely larger than one request evicts cold pages as live requests need them and still serves every request;
- a pool so tight that the engine preempts requests keeps every output, and counts a waiting request's lookup once;
- driven call by call: a lookup sees exactly the blocks written before it (another request's, while that one still
  runs; none it has not written), and a request freed with ``no_cache`` leaves the blocks it wrote indexed;
- bad input is refused before anything changes, and an engine of a model not enabled keeps transformers' allocator.
"""

import inspect

import pytest
import torch

cb = pytest.importorskip("transformers.generation.continuous_batching",
                         reason="transformers has no continuous-batching engine (needs transformers >= 5)")
from conftest import ENGINE_NEW as NEW  # noqa: E402
from conftest import ENGINE_P as P  # noqa: E402
from mmcache.errors import InvalidRequest  # noqa: E402
from mmcache.hf.continuous_batching import TESTED_TRANSFORMERS, allocator_class, enable_prefix_cache  # noqa: E402
from workloads.peers.transformers_cb import Call, PeerEngine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def replay(model, prompts, *, mmcache=True, share=True, inflight=1, salts=None, namer=None, blocks=128,
           logprobs=False):
    calls = [Call(f"r{i}", f"s{i}", p, salts[i] if salts else b"") for i, p in enumerate(prompts)]
    with PeerEngine(model, share=share, page_size=P, num_blocks=blocks, max_batch_tokens=128, max_new_tokens=NEW,
                    mmcache=mmcache, return_logprobs=logprobs, namer=namer) as e:
        out = e.replay(calls, inflight=inflight)
        allocator = e.manager.batch_processor.cache.cache_allocators["full_attention"]
        if e.prefix_cache is None:
            return out, None
        stats = e.prefix_cache.stats()
        # every request ended: no page counted live, and the engine sees every page as free or reclaimable
        assert stats.pages_live == 0 and not allocator.block_table
        assert allocator.pool.count_free_blocks(allocator.index) == e.prefix_cache.pool.num_pages
        return out, stats


def test_the_private_engine_api_is_where_the_allocator_expects():
    import transformers
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.cache_allocators import CacheAllocator, CachePool

    assert tuple(int(x) for x in transformers.__version__.split(".")[:2]) == TESTED_TRANSFORMERS[1], \
        f"transformers {transformers.__version__} is outside the tested pin {TESTED_TRANSFORMERS[0]}"
    assert "full_attention" in cb_cache.ATTN_TYPE_TO_ALLOCATOR
    params = lambda f: list(inspect.signature(f).parameters)[1:]  # noqa: E731  without self
    expected = {
        "register_cache_tensor": ["bytes_per_sector", "non_trash_bytes", "cache_tensor", "pool"],
        "needs_new_sectors": ["request_id", "past_length", "query_length"],
        "needs_new_blocks": ["request_id", "past_length", "query_length"],
        "allocate_cache_to_request": ["request_id", "past_length", "query_length"],
        "mark_complete_blocks": ["request_id", "token_ids", "new_new_blocks"],
        "free_blocks": ["request_id", "no_cache"],
        "fork_blocks": ["source_request_id", "dest_request_id", "past_length"],
        "match_prefix_blocks": ["prompt_ids"],
    }
    for name, args in expected.items():
        assert params(getattr(CacheAllocator, name)) == args, f"CacheAllocator.{name} changed signature"
    assert params(cb_cache.PagedAttentionCache.search_prefix_match) == ["request_id", "prompt_ids"]
    pool = CachePool(4, 1)
    assert isinstance(pool.free_sectors, list) and len(pool._free_blocks) == 1 and pool.num_reserved_sectors == 2
    for name in ("count_free_blocks", "try_to_free_sectors", "reset"):
        assert callable(getattr(pool, name))


@pytest.mark.parametrize("inflight", [1, 3])
def test_cache_on_generates_what_cache_off_does(tiny_llama, prompts, reference, inflight):
    off, _ = replay(tiny_llama, prompts, mmcache=False, share=False, inflight=inflight, logprobs=True)
    on, stats = replay(tiny_llama, prompts, inflight=inflight, logprobs=True)
    assert [o.output_ids for o in on] == [o.output_ids for o in off] == reference
    for a, b in zip(on, off):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-4)
    if inflight == 1:  # later prompts find the written pages of earlier ones
        assert [o.matched_tokens for o in on] == [0, 3 * P, 0, 4 * P, 0]
    assert stats.hit_tokens == sum(o.matched_tokens for o in on) > 0 and stats.requests_live == 0


def test_sharing_off_under_mmcache_matches_and_indexes_nothing(tiny_llama, prompts, reference):
    out, stats = replay(tiny_llama, prompts, share=False, inflight=2)
    assert [o.output_ids for o in out] == reference
    assert stats.hit_tokens == 0 and stats.pages_cached == 0


def test_forced_collisions_change_no_output(tiny_llama, prompts, reference):
    out, stats = replay(tiny_llama, prompts, namer=lambda fp, ids, salt: [7] * (len(ids) // P))
    assert [o.output_ids for o in out] == reference
    assert out[2].matched_tokens == 0 and out[4].matched_tokens == 0  # verification refused the collision
    assert stats.collisions > 0


def test_two_tenants_with_salts_share_nothing(tiny_llama, prompts, reference):
    same = [prompts[3]] * 3
    out, _ = replay(tiny_llama, same, salts=[b"tenant-a", b"tenant-b", b"tenant-a"])
    assert [o.matched_tokens for o in out] == [0, 0, (len(prompts[3]) - 1) // P * P]
    assert all(o.output_ids == reference[3] for o in out)


def test_a_small_pool_evicts_cold_pages_and_serves_every_request(tiny_llama, prompts, reference):
    largest = max(-(-(len(p) + NEW) // P) for p in prompts)
    out, stats = replay(tiny_llama, prompts, blocks=largest + 2)
    assert [o.output_ids for o in out] == reference
    assert stats.evicted_pages > 0 and stats.requests_live == 0


def test_preemption_under_a_tight_pool_keeps_outputs_and_counts_each_lookup_once(tiny_llama, prompts):
    """Four in flight decoding 40 tokens in 12 blocks: the engine starves and offloads requests (freed with
    ``no_cache``, served again); outputs stay what ``generate`` gives, and a request waiting for room is not looked
    up again at every scheduler step."""
    g = torch.Generator().manual_seed(5)
    more = prompts + [prompts[0][:3 * P] + torch.randint(3, 32000, (30,), generator=g).tolist()]
    with torch.inference_mode():
        ref = [tiny_llama.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in more]
    calls = [Call(f"r{i}", f"s{i}", p) for i, p in enumerate(more)]
    with PeerEngine(tiny_llama, share=True, page_size=P, num_blocks=12, max_batch_tokens=64, max_new_tokens=40,
                    mmcache=True) as e:
        out = e.replay(calls, inflight=4)
        stats = e.prefix_cache.stats()
    assert [o.output_ids for o in out] == ref
    assert stats.requests_live == 0 and stats.evicted_pages > 0 and stats.queries < 3 * len(more)


def test_bad_input_is_refused_and_other_models_keep_transformers_allocator(tiny_llama, prompts):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    sliding = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=2,
                                           layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    with pytest.raises(InvalidRequest, match="full-attention layers only"):
        enable_prefix_cache(sliding)
    with pytest.raises(InvalidRequest, match="evict_batch_pages"):
        enable_prefix_cache(tiny_llama, evict_batch_pages=0)
    with enable_prefix_cache(tiny_llama) as mm:
        with pytest.raises(InvalidRequest, match="salt must be bytes"):
            mm.set_salt("r0", "tenant-a")
    with PeerEngine(tiny_llama, share=True, page_size=P, num_blocks=64, max_new_tokens=NEW) as e:
        e.replay([Call("r0", "s0", prompts[0])])
        allocator = e.manager.batch_processor.cache.cache_allocators["full_attention"]
    assert type(allocator) is FullAttentionCacheAllocator and not isinstance(allocator, allocator_class())


def test_a_lookup_sees_exactly_the_blocks_written_before_it(tiny_llama):
    """The allocator driven as the engine drives it, one call at a time: blocks are indexed before the next lookup
    (never before the engine has written them), and a ``no_cache`` free (offload) keeps what was written indexed."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    class State:  # what can_store_request_tokens reads of the engine's request state
        def __init__(self, rid):
            self.request_id = rid

        def current_len(self):
            return 0

    g = torch.Generator().manual_seed(3)
    head = torch.randint(3, 32000, (3 * P + 5,), generator=g).tolist()
    with enable_prefix_cache(tiny_llama) as mm:
        config = ContinuousBatchingConfig(page_size=P, num_blocks=32, max_batch_tokens=128, allow_block_sharing=True,
                                          max_memory_percent=0.5)
        cache = PagedAttentionCache(tiny_llama.config.get_text_config(), config, "cpu", DistributedHelper(None, None),
                                    dtype=torch.float32)
        allocator = cache.cache_allocators["full_attention"]
        assert cache.search_prefix_match("a", head + [7]) == 0
        assert cache.can_store_request_tokens(State("a"), len(head) + 1)
        assert cache.search_prefix_match("b", head + [8]) == 0  # a has written nothing yet
        allocator.mark_complete_blocks("a", head + [7], 2)
        assert cache.search_prefix_match("b", head + [8]) == 2 * P  # a still runs: b shares the two it wrote
        allocator.mark_complete_blocks("a", head + [7], 1)
        cache.free_blocks("a", no_cache=True)  # offloaded: the three blocks it wrote stay indexed
        assert cache.search_prefix_match("c", head + [9]) == 3 * P
        for rid in ("b", "c"):
            cache.free_blocks(rid)
        stats = mm.cache.stats()
    assert stats.pages_live == 0 and stats.pages_cached == 3 and stats.queries == 4 and not allocator.block_table


def test_the_allocator_adds_one_attribute_to_what_transformers_sets(tiny_llama, prompts):
    """The engine looks attributes and methods up on its allocator for every request at every step: an instance with
    more than 28 attributes loses CPython's inline attribute values and every such lookup costs a tenth more.
    Transformers' allocator sets 26; mmcache's keeps its state in one object (``_AllocatorState``)."""
    sizes = {}
    for mmcache in (False, True):
        with PeerEngine(tiny_llama, share=True, page_size=P, num_blocks=64, max_batch_tokens=128, max_new_tokens=NEW,
                        mmcache=mmcache) as e:
            e.replay([Call("r0", "s0", prompts[0], b"")], inflight=1)
            allocator = e.manager.batch_processor.cache.cache_allocators["full_attention"]
            assert isinstance(allocator, allocator_class()) == mmcache
            sizes[mmcache] = set(vars(allocator))
    assert sizes[True] - sizes[False] == {"_mm"}, sorted(sizes[True] - sizes[False])
