"""M*'s own Qwen3-Omni vision encoder node (``VisionEncoderSubmodule`` over a tiny random tower, loaded by
``Qwen3OmniModel.get_submodule`` from a local folder) with reuse turned on by the one call (``enable_encoder_reuse``)
and served as M*'s worker serves it, over made PNG images (``made_media``) preprocessed by M*'s data worker and
Qwen3-Omni's own ``process_prompt`` with the digest hook installed: the digest of the bytes as sent travels to the
node as the ``image_digest`` graph input. Bit-identical to a second model without the call in a batch mixing hits
and misses; two different images behind identical placeholders never share an output."""

import pytest
import torch

import made_media
from mstar_encoder_checkpoints import same_parameters
from mstar_encoder_helpers import (
    ForwardCount,
    assert_equal_outputs,
    data_worker,
    preprocess,
    qwen3_omni_model,
    qwen3_omni_on_cpu,
    require_mstar,
    served_node,
)

require_mstar()

from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402
from mmcache.mstar.media_digests import install_digests, route_digests  # noqa: E402

NODE, WALK = "vision_encoder", "prefill_vision"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return made_media.images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """``(make, worker, reference)``: ``make()`` a fresh M* Qwen3-Omni model over the tiny encoders' folder, the
    data worker (its own model, the digest hook installed), the vision tower the folder was written from."""
    mp = pytest.MonkeyPatch()
    weights, towers, image_processor, feature_extractor = qwen3_omni_on_cpu(mp, tmp_path_factory.mktemp("q3o"))
    worker = data_worker(qwen3_omni_model(image_processor, feature_extractor))
    install_digests(worker, {"image": image_processor, "audio": feature_extractor})
    yield (lambda: qwen3_omni_model(image_processor, feature_extractor, weights)), worker, towers["visual"]
    mp.undo()


def node_inputs(tensors):
    return {name: tensors[name] for name in ("pixel_values", "image_grid_thw", "image_digest")}


def test_one_call_mixed_batch_bit_identical_and_forwards_skipped(vision, images):
    """The one call wraps the vision node M*'s loader built from the folder; a batch mixing hits, misses and a
    repeat runs the tower for the misses only and equals reuse off bit for bit."""
    make, worker, reference = vision
    (wrapped, cached), (plain, _) = served_node(make(), NODE), served_node(make(), NODE, reuse=False)
    assert isinstance(cached, CachedEncoderNode) and same_parameters(cached.node.vision_encoder, reference)
    count = ForwardCount(cached.node.vision_encoder)
    tensors = [preprocess(worker, f"p{i}", "image", p) for i, p in enumerate(images)]
    assert all(t["image_digest"][0].dtype == torch.uint8 and t["image_digest"][0].numel() == 16 for t in tensors)

    wrapped.run(NODE, WALK, {"a0": node_inputs(tensors[0]), "a1": node_inputs(tensors[1])})
    assert count.calls == 2
    rows = {"b0": 0, "b1": 2, "b2": 1, "b3": 3, "b4": 2}  # hits 0 and 1; misses 2 and 3, 2 twice
    reqs = {rid: node_inputs(tensors[i]) for rid, i in rows.items()}
    got = wrapped.run(NODE, WALK, reqs)
    want = plain.run(NODE, WALK, reqs)
    assert_equal_outputs(got, want)
    assert count.calls == 2 + 2
    assert (cached.counters.hits, cached.counters.misses, cached.counters.joins) == (2, 4, 1)


def test_different_images_behind_identical_placeholders_never_share(vision, tmp_path):
    """Two images of one size (one grid, the same placeholders) get different digests and different outputs."""
    make, worker, _ = vision
    paths = made_media.images(tmp_path, sizes=((96, 64), (96, 64)))  # the same grid, different pixels
    a, b = (preprocess(worker, f"s{i}", "image", p) for i, p in enumerate(paths))
    assert torch.equal(a["image_grid_thw"][0], b["image_grid_thw"][0])
    assert not torch.equal(a["image_digest"][0], b["image_digest"][0])
    (wrapped, cached), (plain, _) = served_node(make(), NODE), served_node(make(), NODE, reuse=False)
    reqs = {"x": node_inputs(a), "y": node_inputs(b)}
    wrapped.run(NODE, WALK, reqs)
    got = wrapped.run(NODE, WALK, reqs)  # both hits
    assert cached.counters.hits == 2
    assert_equal_outputs(got, plain.run(NODE, WALK, reqs))
    assert not torch.equal(got["x"]["vision_embeds"][0], got["y"]["vision_embeds"][0])


def test_the_same_bytes_give_the_same_digest_and_route_to_the_encoder(vision, images):
    """The same file gives the same digest, and the conductor's schedule routes it to the vision node."""
    _, worker, _ = vision
    one, two = (preprocess(worker, f"d{i}", "image", images[0]) for i in range(2))
    assert torch.equal(one["image_digest"][0], two["image_digest"][0])
    model = worker.model
    route_digests(model)
    signals = worker.tensor_manager.infos["d0"]  # what the conductor receives: one info per stored tensor
    schedule = model._build_thinker_prefill_schedule(["text", "image"], signals)
    vision_steps = [entry for walk, entry in schedule if walk == WALK]
    assert vision_steps and vision_steps[0]["image_digest"] is signals["image_digest"][0]
    from mstar.conductor.request_info import CurrentForwardConductorMetadata
    meta = CurrentForwardConductorMetadata(input_modalities=["text", "image"], output_modalities=["text"],
                                           graph_walk=WALK, is_prefill=True,
                                           kwargs={"prefill_schedule": schedule, "prefill_step": 1})
    edges = model._get_thinker_prefill_inputs(meta, signals)
    assert any(e.name == "image_digest" and e.next_node == NODE for e in edges)


def test_without_a_carried_digest_the_node_inputs_are_the_key(vision, images):
    """Without the digest hook's ``image_digest`` the node still reuses, keyed by its own inputs."""
    make, worker, _ = vision
    t = preprocess(worker, "n0", "image", images[1])
    bare = {"pixel_values": t["pixel_values"], "image_grid_thw": t["image_grid_thw"]}
    wrapped, cached = served_node(make(), NODE)
    for rid in ("n0", "n1"):
        wrapped.run(NODE, WALK, {rid: bare})
    assert (cached.counters.hits, cached.counters.misses) == (1, 1)


def test_tenant_salt_from_model_kwargs_is_folded_into_the_carried_digest(vision, images):
    """The request's ``model_kwargs["mmcache_salt"]`` reaches the node's key through the digest the data worker
    sends: tenants never share an output, a tenant hits its own, no salt is the plain digest."""
    make, worker, _ = vision
    salts = [None, b"tenant-a", "tenant-b", "tenant-a"]
    sent = [preprocess(worker, f"t{i}", "image", images[2], model_kwargs=None if s is None else
                       {"mmcache_salt": s}) for i, s in enumerate(salts)]
    d = [bytes(t["image_digest"][0].numpy()) for t in sent]
    assert len({d[0], d[1], d[2]}) == 3 and d[1] == d[3]
    wrapped, cached = served_node(make(), NODE)
    for i, t in enumerate(sent):
        wrapped.run(NODE, WALK, {f"t{i}": node_inputs(t)})
    assert (cached.counters.misses, cached.counters.hits) == (3, 1)
    from mmcache.errors import InvalidRequest
    with pytest.raises(InvalidRequest):
        preprocess(worker, "bad", "image", images[2], model_kwargs={"mmcache_salt": 7})
