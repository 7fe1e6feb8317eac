"""M*'s own Wan 2.2 text encoder node (``Wan22TextEncoderSubmodule`` over a tiny random UMT5, loaded by
``Wan22Model.get_submodule`` from a local folder) with reuse turned on by the one call (``enable_encoder_reuse``),
served as M*'s worker serves it (``EngineManager.build``). Requests are the model's own: ``process_prompt`` tokenizes
made-up text-to-video prompts and the fixed CFG negative (``made_media``) with a real 32k-piece T5-style tokenizer,
and ``get_initial_forward_pass_args`` makes the step metadata. Outputs are bit-identical to a second model without
the call in batches mixing hits and misses; the negative hits from the second request on; forward counts prove the
skip; pins last until the engine removes the request; tenants' salts keep them apart."""

import pytest

from made_media import NEGATIVE, PROMPTS
from mstar_encoder_checkpoints import wan22_model, wan22_text
from mstar_encoder_helpers import ForwardCount, assert_equal_outputs, engine, require_mstar, served_node

require_mstar()

from mmcache.mstar.encoder_items import Wan22TextItems  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode, cache_encoder_nodes  # noqa: E402

NODE, WALK = "text_encoder", "encode_text"
SIZE = {"height": 64, "width": 64, "num_frames": 5}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return wan22_text(tmp_path_factory.mktemp("wan22"))


@pytest.fixture(scope="module")
def prompts(folder):
    """Each prompt's ``text_inputs`` (its ids and the negative's) as the data worker's ``process_prompt`` makes them."""
    model = wan22_model(folder)
    return [model.process_prompt(p, ["text"], ["video"], negative_prompt=NEGATIVE, **SIZE)["text_inputs"]
            for p in PROMPTS]


def first_pass(model, salt=None, guidance_scale=5.0):
    """The conductor's first pass of a text-to-video request: its step metadata (``route_salt``, part of the one
    call, copies ``model_kwargs["mmcache_salt"]`` into it)."""
    from types import SimpleNamespace
    kwargs = {"guidance_scale": guidance_scale, **SIZE, **({} if salt is None else {"mmcache_salt": salt})}
    return model.get_initial_forward_pass_args(partition_name="default", input_modalities=["text"],
                                               output_modalities=["video"],
                                               input_signals={"text_inputs": [SimpleNamespace(uuid="t")]},
                                               model_kwargs=kwargs)


def served(folder, reuse=True):
    """``(model, engine, node)``: M*'s Wan 2.2 model (with the one call unless ``reuse`` is False), the worker's
    engine over its text encoder, and the node that engine holds."""
    model = wan22_model(folder)
    return (model, *served_node(model, NODE, reuse, capacity_bytes=1 << 20))


def requests(prompts, rows, prefix="r"):
    return {f"{prefix}{i}": {"text_inputs": list(prompts[i])} for i in rows}


def test_one_call_cfg_negative_hits_from_second_request_and_outputs_match(folder, prompts):
    """The one call wraps the text encoder the worker's engine holds; the negative and a repeated prompt are served
    from the store (UMT5 runs only for new prompts) and every output equals reuse off bit for bit."""
    on, wrapped, cached = served(folder)
    off, plain, _ = served(folder, reuse=False)
    assert isinstance(cached, CachedEncoderNode) and cached is on.get_submodule(NODE)
    count = ForwardCount(cached.node.text_encoder)
    meta = first_pass(on).step_metadata

    first = wrapped.run(NODE, WALK, requests(prompts, [0]), meta)
    assert count.calls == 2 and cached.counters.misses == 2 and cached.counters.hits == 0

    # a batch mixing hits (r0's prompt again, the negative) and misses (new prompts, one repeated inside the batch)
    reqs = {f"b{n}": {"text_inputs": list(prompts[i])} for n, i in enumerate([0, 1, 2, 1, 3])}
    got = wrapped.run(NODE, WALK, reqs, meta)
    want = plain.run(NODE, WALK, reqs, first_pass(off).step_metadata)
    assert_equal_outputs(got, want)
    assert count.calls == 2 + 3  # prompts 1, 2, 3 once each; prompt 0 and the negative from the store
    c = cached.counters
    # joins: 4 repeats of the negative and 1 of prompt 1 inside the batch
    assert (c.hits, c.misses, c.joins, c.forward_calls) == (2, 2 + 3, 4 + 1, 2)
    assert_equal_outputs(first, plain.run(NODE, WALK, requests(prompts, [0]), meta))
    ptrs = [t.data_ptr() for out in got.values() for ts in out.values() for t in ts]
    assert len(ptrs) == len(set(ptrs))  # no two requests share a tensor


def test_negative_hits_on_every_request_after_the_first(folder, prompts):
    """Six requests one by one: each prompt is encoded once, the shared negative only for the first."""
    on, wrapped, cached = served(folder)
    count = ForwardCount(cached.node.text_encoder)
    for i in range(6):
        wrapped.run(NODE, WALK, requests(prompts, [i]), first_pass(on).step_metadata)
    assert count.calls == 6 + 1 and cached.counters.hits == 5  # each prompt once, the negative once


def test_cfg_off_keeps_the_placeholder(folder, prompts):
    """With CFG off the negative is not encoded; the lower-level API (``cache_encoder_nodes`` with the model's item
    split given) serves the same outputs as the plain node."""
    model = wan22_model(folder)
    node = model.get_submodule(NODE, "cpu")
    (cached,) = cache_encoder_nodes({NODE: node}, {NODE: Wan22TextItems(48)}, capacity_bytes=1 << 20,
                                    page_bytes=4096).values()
    meta = first_pass(model, guidance_scale=1.0).step_metadata
    reqs = {"a": {"text_inputs": list(prompts[4])}, "b": {"text_inputs": list(prompts[4])}}
    got = engine({NODE: cached}).run(NODE, WALK, reqs, meta)
    assert_equal_outputs(got, engine({NODE: node}).run(NODE, WALK, reqs, meta))
    assert got["a"]["text_embeds_neg"][0].numel() == 1 and len(cached.store) == 1


def test_pins_last_until_the_engine_removes_the_request(folder, prompts):
    """A request's two outputs stay pinned until the engine removes it; the entries outlive the pins."""
    on, wrapped, cached = served(folder)
    wrapped.run(NODE, WALK, requests(prompts, [5, 6]), first_pass(on).step_metadata)
    assert cached.pinned("r5") == 2 and cached.pinned("r6") == 2
    held = cached.store.pool.counts.copy()
    wrapped.remove_request("r5")
    assert cached.pinned("r5") == 0 and cached.pinned("r6") == 2
    assert int((held - cached.store.pool.counts).sum()) > 0  # r5's owners were dropped, the entries stay
    wrapped.remove_request("r6")
    assert len(cached.store) == 3


def test_salt_routed_from_model_kwargs_keeps_tenants_apart(folder, prompts):
    """The one call routes the request's ``model_kwargs["mmcache_salt"]`` (``route_salt``) into the step metadata
    of the first pass and of the passes after it; the text node keys by it: tenants never share an output, a tenant
    hits its own."""
    from types import SimpleNamespace
    on, wrapped, cached = served(folder)
    args = first_pass(on, "tenant-a")
    assert args.step_metadata["mmcache_salt"] == b"tenant-a"
    meta = args.full_metadata
    meta.kwargs.update(args.step_metadata)  # what the conductor does after each pass
    later = on.get_partition_forward_pass_args("default", meta, {"text_embeds_pos": [SimpleNamespace(uuid="p")],
                                                                 "text_embeds_neg": [SimpleNamespace(uuid="n")]})
    assert later.step_metadata["mmcache_salt"] == b"tenant-a"
    assert "mmcache_salt" not in first_pass(on).step_metadata
    for n, salt in enumerate(("tenant-a", b"tenant-b", "tenant-a")):
        wrapped.run(NODE, WALK, requests(prompts, [8], f"q{n}-"), first_pass(on, salt).step_metadata)
    assert cached.counters.misses == 4 and cached.counters.hits == 2
