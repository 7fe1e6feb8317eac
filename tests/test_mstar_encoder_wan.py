"""M*'s own Wan 2.2 text encoder node (``Wan22TextEncoderSubmodule`` over a tiny random UMT5, saved and loaded back)
under M*'s Engine, wrapped in ``CachedEncoderNode``: DiffusionDB prompts with the fixed CFG negative.
Outputs are bit-identical to the unwrapped node's in batches mixing hits and misses; the negative hits from the
second request on; forward counts prove the skip; pins last until the engine removes the request."""

import json

import pytest
import torch

from mstar_encoder_helpers import ForwardCount, assert_equal_outputs, engine, require_mstar, saved_model

require_mstar()

from mmcache.mstar.encoder_items import Wan22TextItems, items_for  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode, cache_encoder_nodes  # noqa: E402

NEGATIVE = "blurry, low quality, distorted, watermark, text"
WALK = "encode_text"


@pytest.fixture(scope="module")
def wan_nodes(tmp_path_factory):
    """Two Wan22TextEncoderSubmodule over the same tiny UMT5 weights: one plain, one to wrap."""
    from transformers import UMT5Config, UMT5EncoderModel

    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.submodules import Wan22TextEncoderSubmodule
    cfg = UMT5Config(vocab_size=32768, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                     relative_attention_num_buckets=8)
    root = tmp_path_factory.mktemp("wan-umt5")
    config = Wan22Config(text_max_seq_len=48, text_dim=32)
    return [Wan22TextEncoderSubmodule(saved_model(root, "umt5", cfg, UMT5EncoderModel), config) for _ in range(2)]


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    from conftest import shared_data
    data = shared_data()
    if data is None or not (data / "diffusiondb" / "diffusiondb_5k.jsonl").is_file():
        pytest.skip("DiffusionDB prompts not found: place ../shared/data/diffusiondb or set MMCACHE_DATA")
    from workloads.fixtures import text_tokenizer
    tok = text_tokenizer(None)
    with open(data / "diffusiondb" / "diffusiondb_5k.jsonl") as f:
        texts = [json.loads(line)["prompt"] for _, line in zip(range(12), f)]
    return [torch.tensor(ids) for ids in tok.encode(texts + [NEGATIVE])]


def requests(ids, rows, neg):
    return {f"r{i}": {"text_inputs": [ids[i], neg]} for i in rows}


def test_cfg_negative_hits_from_second_request_and_outputs_match(wan_nodes, prompts):
    plain_node, node = wan_nodes
    *ids, neg = prompts
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 20, page_bytes=4096)
    plain, wrapped = engine({"text_encoder": plain_node}), engine({"text_encoder": cached})
    count = ForwardCount(node.text_encoder)
    meta = {"guidance_scale": 5.0}

    first = wrapped.run("text_encoder", WALK, requests(ids, [0], neg), meta)
    assert count.calls == 2 and cached.counters.misses == 2 and cached.counters.hits == 0

    # a batch mixing hits (r0's prompt again, the negative) and misses (new prompts, one repeated inside the batch)
    rows = [0, 1, 2, 1, 3]
    reqs = {f"b{n}": {"text_inputs": [ids[i], neg]} for n, i in enumerate(rows)}
    got = wrapped.run("text_encoder", WALK, reqs, meta)
    want = plain.run("text_encoder", WALK, reqs, meta)
    assert_equal_outputs(got, want)
    assert count.calls == 2 + 3  # prompts 1, 2, 3 once each; prompt 0 and the negative from the store
    c = cached.counters
    # joins: 4 repeats of the negative and 1 of prompt 1 inside the batch
    assert (c.hits, c.misses, c.joins, c.forward_calls) == (2, 2 + 3, 4 + 1, 2)
    assert_equal_outputs(first, plain.run("text_encoder", WALK, requests(ids, [0], neg), meta))
    # no two requests share a tensor
    ptrs = [t.data_ptr() for out in got.values() for ts in out.values() for t in ts]
    assert len(ptrs) == len(set(ptrs))


def test_negative_hits_on_every_request_after_the_first(wan_nodes, prompts):
    plain_node, node = wan_nodes
    *ids, neg = prompts
    cached = CachedEncoderNode(node, Wan22TextItems(48), capacity_bytes=1 << 20, page_bytes=4096)
    wrapped = engine({"text_encoder": cached})
    count = ForwardCount(node.text_encoder)
    for i in range(6):
        wrapped.run("text_encoder", WALK, requests(ids, [i], neg), {"guidance_scale": 5.0})
    assert count.calls == 6 + 1 and cached.counters.hits == 5  # each prompt once, the negative once


def test_cfg_off_keeps_the_placeholder(wan_nodes, prompts):
    plain_node, node = wan_nodes
    *ids, neg = prompts
    (cached,) = cache_encoder_nodes({"text_encoder": node}, {"text_encoder": items_for(node)},
                                    capacity_bytes=1 << 20, page_bytes=4096).values()
    meta = {"guidance_scale": 1.0}
    reqs = {"a": requests(ids, [4], neg)["r4"], "b": requests(ids, [4], neg)["r4"]}
    got = engine({"text_encoder": cached}).run("text_encoder", WALK, reqs, meta)
    want = engine({"text_encoder": plain_node}).run("text_encoder", WALK, reqs, meta)
    assert_equal_outputs(got, want)


def test_pins_last_until_the_engine_removes_the_request(wan_nodes, prompts):
    _, node = wan_nodes
    *ids, neg = prompts
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 20, page_bytes=4096)
    wrapped = engine({"text_encoder": cached})
    wrapped.run("text_encoder", WALK, requests(ids, [5, 6], neg), {"guidance_scale": 5.0})
    assert cached.pinned("r5") == 2 and cached.pinned("r6") == 2
    held = cached.store.pool.counts.copy()
    wrapped.remove_request("r5")
    assert cached.pinned("r5") == 0 and cached.pinned("r6") == 2
    assert int((held - cached.store.pool.counts).sum()) > 0  # r5's owners were dropped, the entries stay
    wrapped.remove_request("r6")
    assert len(cached.store) == 3


def test_salt_keeps_tenants_apart(wan_nodes, prompts):
    _, node = wan_nodes
    *ids, neg = prompts
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 20, page_bytes=4096)
    wrapped = engine({"text_encoder": cached})
    for salt in (b"tenant-a", "tenant-b", b"tenant-a"):
        wrapped.run("text_encoder", WALK, requests(ids, [7], neg),
                                    {"guidance_scale": 5.0, "mmcache_salt": salt})
    assert cached.counters.misses == 4 and cached.counters.hits == 2


def test_salt_routed_from_model_kwargs_by_the_conductor_side_model(wan_nodes, prompts):
    """``route_salt`` on M*'s own ``Wan22Model`` (the conductor's instance): the request's
    ``model_kwargs["mmcache_salt"]`` lands in the step_metadata of the first pass and of the passes after it; the
    text node keys by it."""
    from types import SimpleNamespace

    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.wan22_model import Wan22Model

    from mmcache.mstar.salts import route_salt
    model = object.__new__(Wan22Model)  # the conductor side needs only its config, not the checkpoint
    model.config = Wan22Config()
    route_salt(model)
    route_salt(model)  # idempotent
    signals = {"text_inputs": [SimpleNamespace(uuid="t")]}

    def first_pass(salt):
        kwargs = {"guidance_scale": 5.0, "height": 64, "width": 64, "num_frames": 5}
        if salt is not None:
            kwargs["mmcache_salt"] = salt
        return model.get_initial_forward_pass_args(partition_name="default", input_modalities=["text"],
                                                   output_modalities=["video"], input_signals=signals,
                                                   model_kwargs=kwargs)

    args = first_pass("tenant-a")
    assert args.step_metadata["mmcache_salt"] == b"tenant-a"
    meta = args.full_metadata
    meta.kwargs.update(args.step_metadata)  # what the conductor does after each pass
    later = model.get_partition_forward_pass_args("default", meta, {"text_embeds_pos": [SimpleNamespace(uuid="p")],
                                                                    "text_embeds_neg": [SimpleNamespace(uuid="n")]})
    assert later.step_metadata["mmcache_salt"] == b"tenant-a"
    assert "mmcache_salt" not in first_pass(None).step_metadata

    _, node = wan_nodes
    *ids, neg = prompts
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 20, page_bytes=4096)
    wrapped = engine({"text_encoder": cached})
    for n, salt in enumerate(("tenant-a", "tenant-b", "tenant-a")):
        wrapped.run("text_encoder", WALK, {f"q{n}": requests(ids, [8], neg)["r8"]}, first_pass(salt).step_metadata)
    assert cached.counters.misses == 4 and cached.counters.hits == 2
