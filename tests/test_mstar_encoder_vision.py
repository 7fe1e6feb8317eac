"""M*'s own Qwen3-Omni ``VisionEncoderSubmodule`` (a tiny random HF vision encoder, sdpa) under M*'s Engine,
wrapped in ``CachedEncoderNode``, over MMMU images preprocessed by M*'s data worker and Qwen3-Omni's own
``process_prompt`` with the digest hook installed: the digest of the bytes as sent travels to the node as the
``image_digest`` graph input. Bit-identical to the unwrapped node in a batch mixing hits and misses; two different
images behind identical placeholders never share an output."""

import pytest
import torch

from mstar_encoder_helpers import (ForwardCount, assert_equal_outputs, data_worker, engine,
                                   install_flashinfer_standin, preprocess, qwen3_omni_model, qwen3_omni_processors,
                                   require_mstar, tiny_qwen3_omni_encoders)

require_mstar()

from mmcache.mstar.encoder_items import items_for  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402
from mmcache.mstar.media_digests import install_digests, route_digests  # noqa: E402

WALK = "prefill_vision"


@pytest.fixture(scope="module")
def mmmu_images():
    from conftest import shared_data
    data = shared_data()
    if data is None or not (data / "mmmu" / "images").is_dir():
        pytest.skip("MMMU images not found: place ../shared/data/mmmu or set MMCACHE_DATA")
    return sorted((data / "mmmu" / "images").glob("*.png"))[:4]


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    install_flashinfer_standin(mp)
    from mstar.model.qwen3_omni.submodules import VisionEncoderSubmodule
    root = tmp_path_factory.mktemp("q3o")
    nodes = [VisionEncoderSubmodule(tiny_qwen3_omni_encoders(root)[0], config=None) for _ in range(2)]
    image_processor, feature_extractor = qwen3_omni_processors()
    worker = data_worker(qwen3_omni_model(image_processor, feature_extractor))
    install_digests(worker, {"image": image_processor, "audio": feature_extractor})
    yield nodes, worker
    mp.undo()


def node_inputs(tensors):
    return {name: tensors[name] for name in ("pixel_values", "image_grid_thw", "image_digest")}


def test_mixed_batch_bit_identical_and_forwards_skipped(vision, mmmu_images):
    (plain_node, node), worker = vision
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    plain, wrapped = engine({"vision_encoder": plain_node}), engine({"vision_encoder": cached})
    count = ForwardCount(node.vision_encoder)
    tensors = [preprocess(worker, f"p{i}", "image", p) for i, p in enumerate(mmmu_images)]
    assert all(t["image_digest"][0].dtype == torch.uint8 and t["image_digest"][0].numel() == 16 for t in tensors)

    wrapped.run("vision_encoder", WALK, {"a0": node_inputs(tensors[0]), "a1": node_inputs(tensors[1])})
    assert count.calls == 2
    rows = {"b0": 0, "b1": 2, "b2": 1, "b3": 3, "b4": 2}  # hits 0 and 1; misses 2 and 3, 2 twice
    reqs = {rid: node_inputs(tensors[i]) for rid, i in rows.items()}
    got = wrapped.run("vision_encoder", WALK, reqs)
    want = plain.run("vision_encoder", WALK, reqs)
    assert_equal_outputs(got, want)
    assert count.calls == 2 + 2
    assert (cached.counters.hits, cached.counters.misses, cached.counters.joins) == (2, 4, 1)


def test_different_images_behind_identical_placeholders_never_share(vision, mmmu_images, tmp_path):
    from PIL import Image
    (plain_node, node), worker = vision
    paths = []
    for i, src in enumerate(mmmu_images[:2]):  # the same size: the same grid, the same number of placeholders
        paths.append(tmp_path / f"same-size-{i}.png")
        Image.open(src).convert("RGB").resize((96, 64)).save(paths[-1])
    a, b = (preprocess(worker, f"s{i}", "image", p) for i, p in enumerate(paths))
    assert torch.equal(a["image_grid_thw"][0], b["image_grid_thw"][0])
    assert not torch.equal(a["image_digest"][0], b["image_digest"][0])
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    wrapped, plain = engine({"vision_encoder": cached}), engine({"vision_encoder": plain_node})
    reqs = {"x": node_inputs(a), "y": node_inputs(b)}
    wrapped.run("vision_encoder", WALK, reqs)
    got = wrapped.run("vision_encoder", WALK, reqs)  # both hits
    assert cached.counters.hits == 2
    assert_equal_outputs(got, plain.run("vision_encoder", WALK, reqs))
    assert not torch.equal(got["x"]["vision_embeds"][0], got["y"]["vision_embeds"][0])


def test_the_same_bytes_give_the_same_digest_and_route_to_the_encoder(vision, mmmu_images):
    (_, _), worker = vision
    one, two = (preprocess(worker, f"d{i}", "image", mmmu_images[0]) for i in range(2))
    assert torch.equal(one["image_digest"][0], two["image_digest"][0])
    model = worker.model
    route_digests(model)
    signals = worker.tensor_manager.infos["d0"]  # what the conductor receives: one info per stored tensor
    schedule = model._build_thinker_prefill_schedule(["text", "image"], signals)
    vision_steps = [entry for walk, entry in schedule if walk == "prefill_vision"]
    assert vision_steps and vision_steps[0]["image_digest"] is signals["image_digest"][0]
    from mstar.conductor.request_info import CurrentForwardConductorMetadata
    meta = CurrentForwardConductorMetadata(input_modalities=["text", "image"], output_modalities=["text"],
                                           graph_walk=WALK, is_prefill=True,
                                           kwargs={"prefill_schedule": schedule, "prefill_step": 1})
    edges = model._get_thinker_prefill_inputs(meta, signals)
    assert any(e.name == "image_digest" and e.next_node == "vision_encoder" for e in edges)


def test_without_a_carried_digest_the_node_inputs_are_the_key(vision, mmmu_images):
    (plain_node, node), worker = vision
    t = preprocess(worker, "n0", "image", mmmu_images[1])
    bare = {"pixel_values": t["pixel_values"], "image_grid_thw": t["image_grid_thw"]}
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    wrapped = engine({"vision_encoder": cached})
    for rid in ("n0", "n1"):
        wrapped.run("vision_encoder", WALK, {rid: bare})
    assert (cached.counters.hits, cached.counters.misses) == (1, 1)


def test_tenant_salt_from_model_kwargs_is_folded_into_the_carried_digest(vision, mmmu_images):
    """The request's ``model_kwargs["mmcache_salt"]`` reaches the node's key through the digest the data worker
    sends: tenants never share an output, a tenant hits its own, no salt is the plain digest."""
    (_, node), worker = vision
    salts = [None, b"tenant-a", "tenant-b", "tenant-a"]
    sent = [preprocess(worker, f"t{i}", "image", mmmu_images[2], model_kwargs=None if s is None else
                       {"mmcache_salt": s}) for i, s in enumerate(salts)]
    d = [bytes(t["image_digest"][0].numpy()) for t in sent]
    assert len({d[0], d[1], d[2]}) == 3 and d[1] == d[3]
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    wrapped = engine({"vision_encoder": cached})
    for i, t in enumerate(sent):
        wrapped.run("vision_encoder", WALK, {f"t{i}": node_inputs(t)})
    assert (cached.counters.misses, cached.counters.hits) == (3, 1)
    from mmcache.errors import InvalidRequest
    with pytest.raises(InvalidRequest):
        preprocess(worker, "bad", "image", mmmu_images[2], model_kwargs={"mmcache_salt": 7})
