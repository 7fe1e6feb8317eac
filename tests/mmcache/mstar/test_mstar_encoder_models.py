"""The encoder nodes of M* 0.2.1's models that run on the CPU, with reuse turned on by the one call
(``enable_encoder_reuse``) on M*'s own ``Model`` and served the way M*'s worker serves them (``EngineManager.build``:
``get_submodule``, the node's ``to(device, dtype)``, ``Engine.load_model``): Whisper's and Higgs Audio's audio
encoders, Pi0.5's SigLIP ViT, V-JEPA 2's video encoder, Wan 2.2's and Cosmos3's VAE encoders (the first frame / the
conditioning clip), BAGEL's ViT (its SDPA fallback, flash-attn absent). Each from a tiny random checkpoint in the
model's own layout, loaded by M*'s own loader (``mstar_encoder_checkpoints``). A first batch misses; a second mixes
two hits, two misses and a repeat of a miss: every request's outputs are ``torch.equal`` to those of a second
instance of the model without the call, and the hook on the tower counts exactly the misses' forwards (one sub-batch
when the node batches, one per miss when not). Qwen3-Omni's encoders and Wan 2.2's text encoder go through the one
call in ``test_mstar_encoder_{vision,audio,wan}.py``."""

import pytest
import torch

from mstar_encoder_checkpoints import SERVED, same_parameters, whisper
from mstar_encoder_helpers import ForwardCount, assert_equal_outputs, engine, require_mstar, worker_engine

require_mstar()

from mmcache.mstar import enable_encoder_reuse  # noqa: E402
from mmcache.mstar.encoder_items import items_for  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", SERVED)
def test_one_call_mixed_batches_bit_identical_and_only_misses_run(name, tmp_path_factory):
    """Through the one call, the worker's engine holds the wrapped node (made once, kept by its ``to``), outputs
    equal reuse off bit for bit, only the misses run the tower, and removing the requests releases every pin."""
    case = SERVED[name](tmp_path_factory.mktemp(name))
    on, off = case.model(), case.model()
    enable_encoder_reuse(on, capacity_bytes=1 << 24, page_bytes=4096)
    enable_encoder_reuse(on)  # idempotent
    cached = on.get_submodule(case.node, "cpu")
    assert isinstance(cached, CachedEncoderNode) and on.get_submodule(case.node, "cpu") is cached  # made once
    assert same_parameters(case.weights(cached.node), case.reference)  # M*'s loader read the checkpoint
    wrapped, plain = worker_engine(on, [case.node]), worker_engine(off, [case.node])
    assert wrapped.engine._submodules[case.node].submodule is cached  # the node's to() kept the wrapper
    assert not isinstance(plain.engine._submodules[case.node].submodule, CachedEncoderNode)
    count = ForwardCount(case.tower(cached.node))
    x = [case.request(s) for s in range(4)]
    batches = [{"a0": x[0], "a1": x[1]}, {"b0": x[0], "b1": x[2], "b2": x[1], "b3": x[2], "b4": x[3]}]
    for n, reqs in enumerate(batches):
        before = count.calls
        got = wrapped.run(case.node, case.walk, reqs, case.step_metadata)
        ran = count.calls - before
        want = plain.run(case.node, case.walk, reqs, case.step_metadata)
        assert_equal_outputs(got, want)
        misses = 2  # a0/a1 in the first batch; x2 (twice) and x3 in the second
        assert ran in (1, misses), (name, n, ran)  # one sub-batch, or one forward per miss
    c = cached.counters
    assert (c.hits, c.misses, c.joins, c.forward_items) == (2, 4, 1, 4)
    for rid in (*batches[0], *batches[1]):
        wrapped.remove_request(rid)
    assert not cached._pins and set(cached.store.pool.counts[cached.store.pool.counts > 0].tolist()) == {1}


def _whisper_node(root):
    """M*'s Whisper encoder node (loaded by ``WhisperModel.get_submodule``) and its tower, for the tests of the
    wrapper itself."""
    case = whisper(root)
    node = case.model().get_submodule(case.node, "cpu")
    return case, node, case.tower(node)


def test_the_node_and_a_direct_store_caller_share_one_flight(tmp_path_factory):
    """A miss the node is computing is joined by a concurrent ``EncoderStore.get_or_compute`` on the same key (the
    store's one in-flight table): the tower runs once and both get its output."""
    import threading

    from conftest import wait_for
    from mstar_encoder_helpers import batch
    case, node, tower = _whisper_node(tmp_path_factory.mktemp("whisper"))
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 24, page_bytes=4096)
    wrapped = engine({"enc": cached})
    count, started, go = ForwardCount(tower), threading.Event(), threading.Event()
    tower.register_forward_pre_hook(lambda *_: (started.set(), go.wait(10)) and None)
    x = case.request(7)
    b = batch("enc", case.walk, {"a": x})
    key = cached.prepare_inputs(case.walk, b.per_request_info["a"], x).kwargs["prepared"].keys[0]
    out = {}
    node_thread = threading.Thread(target=lambda: out.update(wrapped.run("enc", case.walk, {"a": x})))
    node_thread.start()
    started.wait(10)
    store_thread = threading.Thread(target=lambda: out.update(
        direct=cached.store.get_or_compute(key, lambda: pytest.fail("the node's flight must be joined"))))
    store_thread.start()
    wait_for(lambda: cached.store.stats().totals.joins == 1)
    go.set()
    node_thread.join(10)
    store_thread.join(10)
    assert count.calls == 1 and out["direct"].source == "joined"
    assert torch.equal(out["direct"].value["encoder_states"][0], out["a"]["encoder_states"][0])


def test_bad_input_is_refused_before_any_state_changes(tmp_path_factory):
    """Nodes that own engine resources, nodes whose outputs must not be reused, and a bad salt: a clear mmcache error,
    nothing stored, the rest of the batch served."""
    from mstar.model.bagel.submodules import VAEEncoderSubmodule
    from mstar.model.whisper.submodules import WhisperDecoderSubmodule

    from mmcache.errors import InvalidRequest
    from mstar_encoder_helpers import batch
    with pytest.raises(InvalidRequest, match="declares engine steps"):
        CachedEncoderNode(object.__new__(WhisperDecoderSubmodule), None)
    with pytest.raises(InvalidRequest, match="samples its latent"):
        items_for(object.__new__(VAEEncoderSubmodule))
    with pytest.raises(InvalidRequest, match="NodeSubmodule"):
        CachedEncoderNode(torch.nn.Linear(2, 2), None)
    case, node, _ = _whisper_node(tmp_path_factory.mktemp("whisper"))
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    eng = engine({"enc": cached}).engine
    for rid in ("good", "bad"):
        eng.add_request(rid)
    b = batch("enc", case.walk, {"good": case.request(1), "bad": case.request(2)})
    b.per_request_info["bad"].step_metadata["mmcache_salt"] = 7
    eng.prepare_inputs(b)
    assert "InvalidRequest" in b.failed_requests["bad"] and list(b.request_ids) == ["good"]
    out = eng.exec_and_postprocess(b)
    assert set(out) == {"good"} and len(cached.store) == 1 and cached.counters.misses == 1
