"""M*'s real Orpheus LLM (mstar-ai 0.2.1) under M*'s real ``Engine`` on CPU, for the tests and the benchmark.

The weights: a tiny random Llama written by transformers (``LlamaForCausalLM.save_pretrained``, drawn under the
repo's seeding rule) from the same architecture as a tiny ``OrpheusModelConfig``, loaded by M*'s own
``OrpheusModel.get_submodule("LLM")`` -> ``load_weights`` (M*'s loader reads a local folder of safetensors; its hub
lookup gives the folder back as is). Everything then is M*'s: ``OrpheusLLMSubmodule`` and its
``OrpheusForCausalLM``, the model's own resource specs (``KVSpec``, ``AttentionSpec``, ``SamplerSpec``,
``PositionSpec``) built by ``Engine.load_model``, ``warmup``, and per step ``prepare_inputs`` ->
``exec_and_postprocess`` (declare, admit, plan, forward, commit) -> ``finalize_batch``, as M*'s worker drives it.
Only flashinfer's and triton's kernels are stood in (``mstar_torch_kernels.install``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar.communication.tensors import LocalTransferEngine  # noqa: E402
from mstar.conductor.request_info import CurrentForwardPassInfo  # noqa: E402
from mstar.distributed.communication import CommGroup, WorkerParallelGroups  # noqa: E402
from mstar.engine.engine import Engine, ExecutingBatch  # noqa: E402
from mstar.engine.resources import SamplingReqConfig, StepContext  # noqa: E402
from mstar.engine.resources.kv.transfer import TransferEngineInfo  # noqa: E402
from mstar.model.orpheus.config import KV_CACHE, ROPE, SAMPLER, OrpheusModelConfig  # noqa: E402
from mstar.model.orpheus.orpheus_model import OrpheusModel  # noqa: E402

from mmcache.mstar import PrefixReuse, enable_reuse  # noqa: E402

# Llama 3.2's shape (GQA, llama3.1 RoPE scaling, RMSNorm, SwiGLU), tiny; 2 layers so the layer cursor moves
CFG = OrpheusModelConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         head_dim=8, intermediate_size=64, max_position_embeddings=1024, vocab_size=320,
                         pad_token_id=0)
LABEL = "main"  # the label OrpheusLLMSubmodule's steps write


def llama_config(cfg: OrpheusModelConfig = CFG):
    """The transformers ``LlamaConfig`` of ``cfg``'s language model (what Orpheus's checkpoint is)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                       num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
                       max_position_embeddings=2 * cfg.rope_scaling["original_max_position_embeddings"],
                       rope_parameters={**cfg.rope_scaling, "rope_theta": cfg.rope_theta},
                       initializer_range=0.2, pad_token_id=cfg.pad_token_id)


def save_weights(folder: Path, cfg: OrpheusModelConfig = CFG) -> Path:
    """A random ``LlamaForCausalLM`` of ``cfg`` saved as safetensors in ``folder`` (under the repo's seeding rule,
    ``workloads.fixtures.saved``: the same folder name always holds the same weights)."""
    from transformers import LlamaForCausalLM

    from workloads import fixtures

    config = llama_config(cfg)
    return fixtures.saved(folder, "orpheus-llm", config.to_json_string(),
                          lambda f: LlamaForCausalLM(config).save_pretrained(f))


def orpheus_model(weights: Path, cfg: OrpheusModelConfig = CFG) -> OrpheusModel:
    """M*'s ``OrpheusModel`` over ``weights`` with config ``cfg``. Its constructor only resolves the hub tokenizer
    (not needed: the tests feed token ids), so the instance is made without it; every method is M*'s."""
    model = object.__new__(OrpheusModel)
    model.config, model.model_path_hf, model.cache_dir, model._submodule_cache = cfg, str(weights), None, {}
    return model


@dataclasses.dataclass
class OrpheusEngine:
    """M*'s ``Engine`` loaded with Orpheus's LLM node; ``sub`` is the node's submodule, ``kv`` its KV resource,
    ``embedded`` the token count of each call of the LM's embedding (what the forward computed; a forward hook
    that only reads)."""

    engine: Engine
    sub: object
    kv: object
    embedded: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.sub.embed_tokens.register_forward_hook(lambda mod, args, out: self.embedded.append(args[0].numel()))


def orpheus_engine(weights: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                   dtype: torch.dtype = torch.bfloat16) -> OrpheusEngine:
    """The engine as M*'s worker builds it for the LLM node: ``get_node_resources`` (its KV spec sized by the
    deployment's overrides, ``pages`` x ``page_size``), ``get_submodule("LLM")`` loading ``weights``, ``load_model``
    and ``warmup``; with ``reuse``, ``enable_reuse`` first (one call: the KV spec becomes a ``ReuseKVSpec``, the
    node gets the seam). bf16 (M*'s default): autocast and KV in bf16. fp32: no autocast, KV in fp32 and RoPE in fp32
    (M*'s ``RopeManager`` rotates fp32 in bf16 unless its config names ``rope_dtype``), for comparing with an fp32
    reference."""
    model = orpheus_model(weights)
    if reuse is not None:
        model = enable_reuse(model, reuse, nodes={"LLM": LABEL}, kv_keys={KV_CACHE}, encoders=False)
    specs = model.get_node_resources()
    for spec in specs:
        if spec.resource_key == KV_CACHE:
            spec.apply_yaml_overrides(max_num_pages=pages, page_size=page_size)
        if spec.resource_key == ROPE and dtype == torch.float32:
            spec.config.rope_dtype = torch.float32
    autocast = None if dtype == torch.float32 else dtype
    sub = model.get_submodule("LLM", device="cpu", tp_group=CommGroup.trivial(), autocast_dtype=autocast)
    engine = Engine(autocast_dtype=autocast)
    engine.load_model({"LLM": sub}, specs=specs,
                      parallel_groups=WorkerParallelGroups(num_workers=1, global_rank=0), device=torch.device("cpu"),
                      transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")), kv_cache_type=dtype)
    engine.warmup()
    return OrpheusEngine(engine, sub, sub.node_resources[KV_CACHE])


def greedy(repetition_penalty: float = 1.3) -> dict:
    """Per-request resource configs: temperature 0 (the sampling stand-in is greedy), Orpheus's own penalty."""
    return {SAMPLER: SamplingReqConfig(temperature=0.0, top_p=1.0, repetition_penalty=repetition_penalty,
                                       ignore_eos=True)}


def fwd_info(rid: str, walk: str, configs: dict) -> CurrentForwardPassInfo:
    return CurrentForwardPassInfo(request_id=rid, graph_walk=walk, fwd_index=0, random_seed=0, max_tokens=1 << 20,
                                  resource_configs=configs)


def engine_step(oe: OrpheusEngine, walk: str, feeds: dict[str, list[int]], sampled) -> dict[str, tuple]:
    """One batch of the LLM node on ``walk`` ("prefill" or "decode") as M*'s worker runs it: ``prepare_inputs``,
    ``exec_and_postprocess``, ``finalize_batch``. ``sampled``: the stand-in sampler's record. Returns rid -> (the
    token M*'s sampler picked, the logits it was handed); ``oe.embedded[-1]`` is the tokens the step computed."""
    configs = greedy()
    infos = {rid: fwd_info(rid, walk, configs) for rid in feeds}
    b = ExecutingBatch(node_name="LLM", per_request_info=infos,
                       per_request_input_tensors={rid: {"text_inputs": [torch.as_tensor(ids, dtype=torch.long)]}
                                                  for rid, ids in feeds.items()},
                       step_context=StepContext(request_ids=tuple(feeds), graph_walk=walk, slot=0, capture=False))
    oe.engine.prepare_inputs(b)
    assert not b.failed_requests, b.failed_requests
    calls = len(sampled.logits)
    out = oe.engine.exec_and_postprocess(b)
    oe.engine.finalize_batch(b)
    assert len(sampled.logits) == calls + 1, "one sampler call per step"
    logits, tokens = sampled.logits[-1], sampled.tokens[-1]
    got = {}
    for i, rid in enumerate(b.request_ids):  # the sampler's rows are the batch's requests, in order
        token = int(out[rid]["new_token"][0])
        assert token == int(tokens[i]), (rid, token, tokens)
        got[rid] = (token, logits[i])
    return got
