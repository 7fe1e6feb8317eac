"""A hit known before decoding skips the decode and the preprocessing: M*'s data worker (with Qwen3-Omni's own
``process_prompt``) asks the node's store through the in-process presence oracle; the second request with an image
decodes nothing and runs no processor, yet the thinker-side inputs and the encoder node's outputs are bit-identical
to the decoded path. The encoder nodes are the ones the one call (``enable_encoder_reuse``) makes of M*'s own
Qwen3-Omni model (tiny towers loaded from a local folder), served on one worker engine; the media are made by the
tests (``made_media``)."""

import dataclasses

import pytest
import torch

import made_media
from mstar_encoder_helpers import (
    CpuEngine,
    ForwardCount,
    assert_equal_outputs,
    data_worker,
    load_audio_16k,
    preprocess,
    qwen3_omni_model,
    qwen3_omni_on_cpu,
    require_mstar,
    worker_engine,
)

require_mstar()

from mmcache.mstar import enable_encoder_reuse  # noqa: E402
from mmcache.mstar.decode_skip import store_oracle  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402
from mmcache.mstar.media_digests import install_digests, route_digests  # noqa: E402

THINKER_SIDE = ("text_inputs", "image_grid_thw", "image_digest")


class Counting:
    """An HF processor whose calls are counted (attributes pass through)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    return made_media.images(root / "images")[:2], made_media.voices(root / "voices", 1)


@dataclasses.dataclass
class Setup:
    """The worker's engine over the encoder nodes with the one call (``wrapped``, its nodes ``cached``) and without
    (``bare``); a data worker with the presence oracle on those nodes (``worker``) and one without (``reference``);
    the counted image processor and feature extractor; one entry in ``decodes`` per image decode."""

    wrapped: CpuEngine
    cached: dict
    bare: CpuEngine
    worker: object
    reference: object
    image_proc: object
    feature_extractor: object
    decodes: list


NODES = ("vision_encoder", "audio_encoder")


@pytest.fixture
def setup(tmp_path_factory, monkeypatch):
    weights, _, image_processor, feature_extractor = qwen3_omni_on_cpu(monkeypatch, tmp_path_factory.mktemp("q3o"))
    counted = Counting(image_processor), Counting(feature_extractor)
    on, off = (qwen3_omni_model(image_processor, feature_extractor, weights) for _ in range(2))
    enable_encoder_reuse(on, capacity_bytes=1 << 22, page_bytes=4096)
    wrapped, bare = worker_engine(on, NODES), worker_engine(off, NODES)
    cached = {name: wrapped.engine._submodules[name].submodule for name in NODES}
    assert all(isinstance(node, CachedEncoderNode) for node in cached.values())

    def make_worker(known):
        model = qwen3_omni_model(*counted)
        model.load_audio = load_audio_16k  # M*'s own needs torchcodec (not installed here)
        worker = data_worker(model)
        install_digests(worker, {"image": image_processor, "audio": feature_extractor}, known=known)
        return worker

    oracle = store_oracle({"image": (cached["vision_encoder"], "prefill_vision"),
                           "audio": (cached["audio_encoder"], "prefill_audio")})
    decodes = []
    import torchvision
    real_decode = torchvision.io.decode_image
    monkeypatch.setattr(torchvision.io, "decode_image", lambda *a, **k: decodes.append(1) or real_decode(*a, **k))
    return Setup(wrapped, cached, bare, make_worker(oracle), make_worker(None), *counted, decodes)


def test_a_known_image_is_neither_decoded_nor_preprocessed_and_outputs_are_bit_identical(setup, media):
    worker, reference, image_proc, decodes = setup.worker, setup.reference, setup.image_proc, setup.decodes
    wrapped, bare = setup.wrapped, setup.bare
    images, _ = media
    node = setup.cached["vision_encoder"]
    count = ForwardCount(node.node.vision_encoder)
    node_inputs = lambda t: {n: t[n] for n in ("pixel_values", "image_grid_thw", "image_digest")}  # noqa: E731

    first = preprocess(worker, "r1", "image", images[0])
    assert (len(decodes), image_proc.calls) == (1, 1)
    wrapped.run("vision_encoder", "prefill_vision", {"r1": node_inputs(first)})
    node.cleanup_request("r1")

    second = preprocess(worker, "r2", "image", images[0])
    assert (len(decodes), image_proc.calls) == (1, 1)  # the skip: no decode, no image processor
    assert node.pinned("r2") == 1  # held by the oracle until the node's cleanup
    want = preprocess(reference, "ref", "image", images[0])  # the decoded path, no oracle
    for name in THINKER_SIDE:
        assert len(second[name]) == len(want[name])
        assert all(torch.equal(a, b) for a, b in zip(second[name], want[name])), name
    assert second["pixel_values"][0].numel() == 0  # a stand-in the node never reads

    got = wrapped.run("vision_encoder", "prefill_vision", {"r2": node_inputs(second)})
    assert count.calls == 1 and node.counters.hits == 1  # served from the store
    ref = bare.run("vision_encoder", "prefill_vision", {"ref": node_inputs(want)})
    assert_equal_outputs({"x": got["r2"]}, {"x": ref["ref"]})
    node.cleanup_request("r2")
    assert node.pinned("r2") == 0

    model = worker.model  # the thinker's schedule still gets the grid and the digest for the vision step
    route_digests(model)
    signals = worker.tensor_manager.infos["r2"]
    steps = [e for w, e in model._build_thinker_prefill_schedule(["text", "image"], signals) if w == "prefill_vision"]
    assert len(steps) == 1 and {"pixel_values", "image_grid_thw", "image_digest"} <= set(steps[0])

    preprocess(worker, "r3", "image", images[1])  # another image: decoded (the reference pass made it 2 before)
    assert (len(decodes), image_proc.calls) == (3, 3)


def test_a_known_audio_skips_the_feature_extractor_and_the_node_inputs_match(setup, media):
    worker, reference, feature_extractor = setup.worker, setup.reference, setup.feature_extractor
    wrapped, bare = setup.wrapped, setup.bare
    _, wavs = media
    node = setup.cached["audio_encoder"]
    node_inputs = lambda t: {n: t[n] for n in ("audio_features", "audio_seqlens", "audio_digest")}  # noqa: E731
    first = preprocess(worker, "a1", "audio", wavs[0], text=None)
    wrapped.run("audio_encoder", "prefill_audio", {"a1": node_inputs(first)})
    calls = feature_extractor.calls
    second = preprocess(worker, "a2", "audio", wavs[0], text=None)
    assert feature_extractor.calls == calls
    want = preprocess(reference, "ref", "audio", wavs[0], text=None)
    for name in ("text_inputs", "audio_seqlens", "audio_digest"):
        assert all(torch.equal(a, b) for a, b in zip(second[name], want[name])), name
    got = wrapped.run("audio_encoder", "prefill_audio", {"a2": node_inputs(second)})
    ref = bare.run("audio_encoder", "prefill_audio", {"ref": node_inputs(want)})
    assert_equal_outputs({"x": got["a2"]}, {"x": ref["ref"]})
    assert node.counters.hits == 1


def test_nothing_is_skipped_when_the_store_dropped_the_output(setup, media):
    images, _ = media
    preprocess(setup.worker, "c1", "image", images[0])  # decoded; the node never ran, so the store holds nothing
    preprocess(setup.worker, "c2", "image", images[0])
    assert (len(setup.decodes), setup.image_proc.calls) == (2, 2)
    assert setup.cached["vision_encoder"].pinned("c2") == 0


def test_salted_requests_skip_only_for_their_own_tenant(setup, media):
    """The salt is folded into the carried digest, so the oracle asks about exactly the key the node will look up: a
    tenant's second request skips (and hits), another tenant's same image is decoded and misses."""
    worker, image_proc, decodes, wrapped = setup.worker, setup.image_proc, setup.decodes, setup.wrapped
    images, _ = media
    node = setup.cached["vision_encoder"]
    node_inputs = lambda t: {n: t[n] for n in ("pixel_values", "image_grid_thw", "image_digest")}  # noqa: E731
    for n, salt in enumerate(("tenant-a", "tenant-a", "tenant-b")):
        t = preprocess(worker, f"s{n}", "image", images[1], model_kwargs={"mmcache_salt": salt})
        wrapped.run("vision_encoder", "prefill_vision", {f"s{n}": node_inputs(t)})
        wrapped.remove_request(f"s{n}")
    assert (len(decodes), image_proc.calls) == (2, 2)  # tenant-a once, tenant-b once; tenant-a's second skipped
    assert (node.counters.misses, node.counters.hits) == (2, 1)
