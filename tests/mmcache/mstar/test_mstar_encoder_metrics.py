"""The counters of cached M* encoder nodes appear on a real prometheus_client registry under the replays' names."""

import pytest
import torch

from mstar_encoder_helpers import engine, require_mstar, saved_model

require_mstar()
prometheus_client = pytest.importorskip("prometheus_client", reason="prometheus_client not installed")

from mmcache.mstar.encoder_items import items_for  # noqa: E402
from mmcache.mstar.encoder_metrics import EncoderNodeCollector  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402


def test_counters_on_a_registry(tmp_path):
    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.submodules import Wan22TextEncoderSubmodule
    from transformers import UMT5Config, UMT5EncoderModel
    umt5 = saved_model(tmp_path, "umt5", UMT5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                                    d_kv=8, relative_attention_num_buckets=8), UMT5EncoderModel)
    sub = Wan22TextEncoderSubmodule(umt5, Wan22Config(text_max_seq_len=8, text_dim=16))
    node = CachedEncoderNode(sub, items_for(sub), capacity_bytes=1 << 16, page_bytes=1024)
    eng = engine({"text_encoder": node})
    neg = torch.tensor([5, 6, 7])
    for i in range(3):
        reqs = {f"r{i}": {"text_inputs": [torch.tensor([i + 1]), neg]}}
        eng.run("text_encoder", "encode_text", reqs, {"guidance_scale": 5.0})
    registry = prometheus_client.CollectorRegistry()
    registry.register(EncoderNodeCollector([node]))
    get = lambda name: registry.get_sample_value(name, {"modality": "text"})  # noqa: E731
    assert get("mmcache_encoder_cache_queries_total") == 6
    assert get("mmcache_encoder_cache_hits_total") == 2
    assert get("mmcache_encoder_cache_misses_total") == 4
    assert get("mmcache_encoder_cache_joins_total") == 0
    assert get("mmcache_encoder_cache_saved_seconds_total") > 0
    assert get("mmcache_encoder_cache_bytes") == 4 * 8 * 16 * 4  # four [1, 8, 16] float32 entries
    assert b"mmcache_encoder_cache_hits_total{modality=\"text\"} 2.0" in prometheus_client.generate_latest(registry)
