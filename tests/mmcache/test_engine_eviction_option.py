"""The engines' one-call APIs take the eviction policy (``eviction=``, a name in ``mmcache.eviction.POLICIES``): it
reaches the pool each builds (``pool.policy.name``), and an unknown name raises ``InvalidConfig`` before anything
changes. M*: ``PrefixReuse`` (the node's KV pool, built by M*'s ``build_resource``) and ``enable_encoder_reuse`` (each
encoder node's own store); transformers: ``enable_prefix_cache`` (continuous batching) and
``PagedKVCache.for_model``."""

import pytest
import torch

from mmcache import EncoderStore, PagePool
from mmcache.errors import InvalidConfig, InvalidRequest
from mmcache.eviction import DEFAULT_POLICY, POLICIES
from mmcache.mstar.requirement import why_unavailable

OTHER = next(name for name in POLICIES if name != DEFAULT_POLICY)
needs_mstar = pytest.mark.skipif(why_unavailable() is not None, reason=str(why_unavailable()))

pytestmark = pytest.mark.usefixtures("one_thread")


# -- M* ---------------------------------------------------------------------------------------------------------------
@needs_mstar
@pytest.mark.parametrize("name", [None, *POLICIES])
def test_prefix_reuse_s_policy_orders_the_node_s_kv_pool(name):
    from mstar_toy_ar import PrefixReuse, node, serve, weights

    reuse = PrefixReuse(model="toy@0") if name is None else PrefixReuse(model="toy@0", eviction=name)
    on = node(weights(), pages=8, reuse=reuse)
    assert on.kv.pool.policy.name == (name or DEFAULT_POLICY)
    for i in range(3):                                          # evictions run under it
        serve(on, f"r{i}", [10 * i + j for j in range(1, 14)], 1)
    assert on.kv.stats("main").evicted_pages > 0


@needs_mstar
def test_prefix_reuse_refuses_an_unknown_policy_before_a_resource_is_built():
    from mmcache.mstar.kv_resource import PrefixReuse

    with pytest.raises(InvalidConfig, match="unknown eviction policy 'nope'"):
        PrefixReuse(model="toy@0", eviction="nope")


def whisper_model(folder):
    """M*'s own ``WhisperModel`` over a tiny checkpoint (as ``test_mstar_encoder_models`` builds it)."""
    from mstar.model.whisper.config import WhisperModelConfig
    from mstar.model.whisper.whisper_model import WhisperModel
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=30, vocab_size=128, max_target_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    torch.manual_seed(0)
    WhisperForConditionalGeneration(cfg).save_pretrained(folder)
    model = object.__new__(WhisperModel)  # its constructor resolves a hub snapshot; the rest is M*'s own
    model.local_dir, model.config, model._submodule_cache = str(folder), \
        WhisperModelConfig.from_pretrained(str(folder)), {}
    return model


@needs_mstar
@pytest.mark.parametrize("name", [None, OTHER])
def test_enable_encoder_reuse_s_policy_orders_each_node_s_own_store(tmp_path, name):
    from mmcache.mstar import enable_encoder_reuse

    model = whisper_model(tmp_path)
    kwargs = {} if name is None else {"eviction": name}
    enable_encoder_reuse(model, capacity_bytes=1 << 20, page_bytes=4096, **kwargs)
    assert model.get_submodule("audio_encoder", "cpu").store.pool.policy.name == (name or DEFAULT_POLICY)


@needs_mstar
def test_enable_encoder_reuse_leaves_a_given_store_its_pool_s_policy(tmp_path):
    from mmcache.mstar import enable_encoder_reuse

    model, shared = whisper_model(tmp_path), EncoderStore(pool=PagePool(64, (4096,), torch.uint8, eviction="lru"))
    enable_encoder_reuse(model, store_for=lambda node, sub: shared, eviction="lfu")
    assert model.get_submodule("audio_encoder", "cpu").store is shared and shared.pool.policy.name == "lru"


@needs_mstar
def test_enable_encoder_reuse_refuses_an_unknown_policy_before_the_model_is_touched(tmp_path):
    from mmcache.mstar import enable_encoder_reuse
    from mmcache.mstar.encoder_items import items_for
    from mmcache.mstar.encoder_node import CachedEncoderNode

    model = whisper_model(tmp_path)
    get = model.get_submodule
    with pytest.raises(InvalidConfig, match="unknown eviction policy"):
        enable_encoder_reuse(model, eviction="nope")
    assert model.get_submodule == get and not getattr(model, "_mmcache_encoder_reuse", False)
    sub = get("audio_encoder", "cpu")
    with pytest.raises(InvalidConfig, match="unknown eviction policy"):
        CachedEncoderNode(sub, items_for(sub), eviction="nope")  # refused here, not when its store is first made
    with pytest.raises(InvalidRequest, match="eviction or store"):
        CachedEncoderNode(sub, items_for(sub), EncoderStore(1 << 16, 4096), eviction="lru")


def test_an_encoder_store_s_own_pool_takes_the_policy():
    assert EncoderStore(1 << 16, 4096).pool.policy.name == DEFAULT_POLICY
    assert EncoderStore(1 << 16, 4096, eviction=OTHER).pool.policy.name == OTHER
    with pytest.raises(InvalidConfig):
        EncoderStore(1 << 16, 4096, eviction="nope")
    with pytest.raises(InvalidRequest, match="eviction or pool"):
        EncoderStore(pool=PagePool(4, (64,), torch.uint8), eviction=OTHER)


# -- transformers -----------------------------------------------------------------------------------------------------
def engine_cache(model):
    """A continuous-batching cache of ``model`` built as the engine builds one; returns its full-attention
    allocator."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    config = ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=64, allow_block_sharing=True,
                                      max_memory_percent=0.5)
    cache = PagedAttentionCache(model.config.get_text_config(), config, "cpu", DistributedHelper(None, None),
                                dtype=torch.float32)
    return cache.cache_allocators["full_attention"]


@pytest.mark.parametrize("name", [None, OTHER])
def test_continuous_batching_s_policy_orders_each_engine_s_pool(tiny_llama, name):
    pytest.importorskip("transformers.generation.continuous_batching")
    from mmcache.hf.continuous_batching import enable_prefix_cache

    kwargs = {} if name is None else {"eviction": name}
    with enable_prefix_cache(tiny_llama, **kwargs) as mm:
        engine_cache(tiny_llama)
        assert mm.cache.pool.policy.name == (name or DEFAULT_POLICY)


def test_continuous_batching_refuses_an_unknown_policy_before_anything_is_installed(tiny_llama):
    pytest.importorskip("transformers.generation.continuous_batching")
    from mmcache.hf import continuous_batching

    with pytest.raises(InvalidConfig, match="unknown eviction policy"):
        continuous_batching.enable_prefix_cache(tiny_llama, eviction="nope")
    assert id(tiny_llama.config.get_text_config(decoder=True)) not in continuous_batching._BOUND


@pytest.mark.parametrize("name", [None, *POLICIES])
def test_paged_kv_s_policy_orders_its_pool(tiny_llama, name):
    from mmcache.hf.paged_kv import PagedKVCache

    kwargs = {} if name is None else {"eviction": name}
    assert PagedKVCache.for_model(tiny_llama, 8, 4, **kwargs).pool.policy.name == (name or DEFAULT_POLICY)


def test_paged_kv_refuses_an_unknown_policy(tiny_llama):
    from mmcache.hf.paged_kv import PagedKVCache

    with pytest.raises(InvalidConfig, match="unknown eviction policy"):
        PagedKVCache.for_model(tiny_llama, 8, 4, eviction="nope")
