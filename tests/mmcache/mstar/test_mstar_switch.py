"""``enable_reuse`` on M*'s own Orpheus model (tiny config; its LLM submodule is M*'s ``OrpheusLLMSubmodule``): the
model's own ``KVSpec`` becomes a ``ReuseKVSpec`` that M*'s ``build_resource`` builds into a ``ReuseKVManager``, the
other specs are untouched, and the LLM node's own ``prepare_inputs``/``declare_step`` carry the seam: a second request
with a cached prefix gets its input cut to the suffix, its RoPE position moved past the hit by M*'s ``RopeManager``,
and its repetition penalty still tracking the whole prompt."""

import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar.communication.tensors import LocalTransferEngine  # noqa: E402
from mstar.distributed.communication import CommGroup  # noqa: E402
from mstar.engine.resources import KVStep, Segment, StepContext, StepRunner, SubmoduleStep  # noqa: E402
from mstar.engine.resources.base import EngineResourceInfo, build_resource  # noqa: E402
from mstar.engine.resources.kv.transfer import TransferEngineInfo  # noqa: E402
from mstar.model.orpheus.components.language_model import OrpheusForCausalLM  # noqa: E402
from mstar.model.orpheus.config import KV_CACHE, ROPE, SAMPLER, OrpheusModelConfig  # noqa: E402
from mstar.model.orpheus.orpheus_model import OrpheusModel  # noqa: E402
from mstar.model.orpheus.submodules import OrpheusLLMSubmodule  # noqa: E402

from mmcache.mstar import PrefixReuse, ReuseKVManager, ReuseKVSpec, enable_reuse  # noqa: E402
from mstar_toy_ar import fwd_info  # noqa: E402

CFG = OrpheusModelConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, hidden_size=16,
                         head_dim=8, intermediate_size=32, max_position_embeddings=256, vocab_size=300)


def orpheus():
    """M*'s ``OrpheusModel`` around a tiny LLM (its constructor resolves hub snapshots; the rest is M*'s own)."""
    with torch.device("meta"):
        lm = OrpheusForCausalLM(CFG, comm_group=CommGroup.trivial())
    model = object.__new__(OrpheusModel)
    model.config, model._submodule_cache = CFG, {"LLM": OrpheusLLMSubmodule(language_model=lm, config=CFG)}
    return model


def test_one_call_turns_reuse_on_for_orpheus():
    model = enable_reuse(orpheus(), PrefixReuse(model="orpheus-tiny@test"), nodes={"LLM": "main"},
                         kv_keys={KV_CACHE}, encoders=False)
    specs = {s.resource_key: s for s in model.get_node_resources()}
    assert type(specs[KV_CACHE]) is ReuseKVSpec and type(specs[ROPE]).__name__ == "PositionSpec"
    specs[KV_CACHE].config.max_num_pages, specs[KV_CACHE].config.page_size = 16, 4
    info = EngineResourceInfo(device=torch.device("cpu"), kv_dtype=torch.float32, dependencies=dict(specs),
                              transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")))
    kv, rope = build_resource(specs[KV_CACHE], info), build_resource(specs[ROPE], info)
    assert isinstance(kv, ReuseKVManager)
    runner = StepRunner({KV_CACHE: kv, ROPE: rope})
    node = model.get_submodule("LLM")
    resources = {KV_CACHE: kv, ROPE: rope}
    prompt = torch.arange(10, 23)

    def prefill(rid):
        runner.ingest_request(rid)
        inp = node.prepare_inputs(graph_walk="prefill", fwd_info=fwd_info(rid), inputs={"text_inputs": [prompt]},
                                  resources=resources)
        s = node.declare_step("prefill", [rid], [inp])
        kv_only = SubmoduleStep(segments=[Segment(rid, "main", inp.input_seq_len)], steps={KV_CACHE: KVStep()})
        kv_only.set_ctx(StepContext(request_ids=[rid], graph_walk="prefill", slot=0, capture=False))
        assert runner.admit(kv_only).ok
        runner.plan(kv_only)
        kv.write_kv(torch.zeros(inp.input_seq_len, 1, 8), torch.zeros(inp.input_seq_len, 1, 8), 0, "main")
        runner.commit(kv_only)
        return inp, s

    first, _ = prefill("a")
    assert first.input_seq_len == 13
    second, step = prefill("b")
    # 2 pages of 4 were cached: a prefill is never cut to one row (M*'s attention would take it for a decode step,
    # whose plan Orpheus's select_last_hidden cannot read)
    assert second.input_seq_len == 5 and torch.equal(second.input_ids, prompt[8:])
    assert rope.position("b", "main") == 8                                           # as a cold prefill leaves it
    assert torch.equal(step.steps[SAMPLER].prefill_tracked_tokens["b"], prompt)      # the penalty sees everything
