"""M*'s real Pi0.5 LLM node (mstar-ai 0.2.1, ``Pi05LLMSubmodule``: the PaliGemma prefix expert and the action expert
on one KV resource) under M*'s real ``Engine`` on CPU, for the tests.

The checkpoint: a tiny random one in the lerobot/pi05_base layout (``paligemma_with_expert.paligemma.model.
language_model.*`` with q/k/v and gate/up unfused, the tied ``paligemma.lm_head.weight`` that M* loads as
``embed_tokens``, ``paligemma_with_expert.gemma_expert.model.*``, ``action_in_proj``/``action_out_proj``,
``time_mlp_in``/``time_mlp_out``), one ``model.safetensors`` in a folder, loaded by M*'s own
``Pi05Model.get_submodule("LLM")`` (``_lerobot_remap`` and ``load_hf_weights`` with its fused-shard rules). The
model's snapshot folder is given as ``_repo_dir`` (what ``_ensure_repo`` returns once resolved) and its config as a
tiny ``Pi05Config``: its constructor asks the hub for both and for the PaliGemma tokenizer, so the instance is made
without it. The SigLIP node is not built: a prefill hands the LLM ``img_emb`` as the encoder's output edge would.

A request is ``prefill`` (``[image rows x sqrt(H), text ids embedded x H]``, attended bidirectionally and committed)
then ``action_gen``, ``num_flow_steps`` Euler steps of the action expert over ``action_horizon`` rows that attend
to the prefix KV and write scratch KV that is never committed (``KVStep(commit=False)``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.model.pi05.config import LLM_KV, LLM_POS, Pi05Config  # noqa: E402
from mstar.model.pi05.pi05_model import Pi05Model, _Pi05LLMWeightContainer  # noqa: E402

from mmcache.mstar import PrefixReuse  # noqa: E402
from workloads.peers.mstar_checkpoint import random_hub_tensors  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

LLM, LABEL = "LLM", "main"  # the node and the label its steps write
PREFILL, ACTION = "prefill", "action_gen"
# Gemma's shape (MQA, GELU-tanh, Gemma RMSNorm; adaRMS in the action expert), tiny
CFG = dict(num_layers=2, num_qo_heads=4, num_kv_heads=1, head_dim=16, hidden_size=32, pali_intermediate_size=64,
           vocab_size=512, action_hidden_size=16, action_intermediate_size=32, num_flow_steps=3, action_horizon=4,
           action_dim=4, max_position_embeddings=256)


def tiny_config() -> Pi05Config:
    return dataclasses.replace(Pi05Config(), **CFG)


def lerobot_name(name: str) -> str:
    """A ``_Pi05LLMWeightContainer`` parameter's name in the lerobot checkpoint (``Pi05Model._lerobot_remap``
    inverted)."""
    if name == "embed_tokens.weight":
        return "paligemma_with_expert.paligemma.lm_head.weight"
    if name.startswith("paligemma."):
        return "paligemma_with_expert.paligemma.model.language_model." + name.removeprefix("paligemma.")
    if name.startswith("action_expert."):
        return "paligemma_with_expert.gemma_expert.model." + name.removeprefix("action_expert.")
    for ours, theirs in (("time_mlp.linear_in.", "time_mlp_in."), ("time_mlp.linear_out.", "time_mlp_out.")):
        if name.startswith(ours):
            return theirs + name.removeprefix(ours)
    return name  # action_in_proj.*, action_out_proj.*


def save_checkpoint(folder: Path) -> Path:
    """A tiny random lerobot-layout ``model.safetensors`` in a folder under ``folder`` (tensors by
    ``workloads.peers.mstar_checkpoint.random_hub_tensors``, Gemma's norms around 0 as they scale by 1 + w), under
    the repo's seeding rule (``workloads.fixtures.saved``)."""
    import json

    from mstar.model.pi05.components.action_expert import Pi05ActionExpert, Pi05TimeMLP
    from mstar.model.pi05.components.paligemma import Pi05PaliGemmaExpert
    from safetensors.torch import save_file

    from workloads import fixtures

    cfg = tiny_config()

    def save(f: Path) -> None:
        with torch.device("meta"):
            container = _Pi05LLMWeightContainer(
                torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), Pi05PaliGemmaExpert(cfg),
                Pi05ActionExpert(cfg), torch.nn.Linear(cfg.action_dim, cfg.action_hidden_size),
                torch.nn.Linear(cfg.action_hidden_size, cfg.action_dim), Pi05TimeMLP(cfg.action_hidden_size))
        heads = (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim)
        tensors = random_hub_tensors(container, heads, torch.Generator().manual_seed(0), norm_offset=0.0)
        state = {lerobot_name(k): v for k, v in tensors.items()}
        save_file(state, str(f / "model.safetensors"))

    return fixtures.saved(folder, "pi05", json.dumps(CFG, sort_keys=True), save)


def pi05_model(checkpoint: Path) -> Pi05Model:
    """M*'s ``Pi05Model`` over the folder ``checkpoint`` with the tiny config; every method is M*'s."""
    model = object.__new__(Pi05Model)
    model.model_path_hf, model.cache_dir, model.skip_weight_loading = str(checkpoint), None, False
    model._yaml_config_overrides, model.config, model.tokenizer = {}, tiny_config(), None
    model._repo_dir, model._lerobot_flat, model._submodule_cache = Path(checkpoint), None, {}
    for part in ("embed_tokens", "paligemma", "action_expert", "action_in_proj", "action_out_proj", "time_mlp",
                 "siglip"):
        setattr(model, part, None)
    return model


@dataclasses.dataclass
class Pi05Engine:
    """M*'s ``Engine`` loaded with Pi0.5's LLM node: ``sub`` its submodule, ``kv`` its KV resource, ``fed`` rid -> the
    rows the last ``walk`` computed for it (``input_seq_len`` after the reuse seam's cut)."""

    engine: Engine
    model: Pi05Model
    sub: object
    kv: object
    fed: dict = dataclasses.field(default_factory=dict)


def pi05_engine(checkpoint: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                dtype: torch.dtype = torch.bfloat16) -> Pi05Engine:
    """The engine as M*'s worker builds it (``get_node_resources`` with the KV spec sized ``pages`` x ``page_size``,
    ``get_submodule("LLM")`` loading ``checkpoint``, ``load_model``, ``warmup``); with ``reuse``, ``enable_reuse``
    first. bf16: M*'s default autocast and KV dtype (the node keeps its norms in fp32 itself)."""
    model = pi05_model(checkpoint)  # enable_reuse (in cpu_engine) turns reuse on in place
    engine, nodes = cpu_engine(model, [LLM], pages=pages, page_size=page_size, dtype=dtype, kv_key=LLM_KV,
                               rope_key=LLM_POS, reuse=reuse)
    sub = nodes[LLM]
    return Pi05Engine(engine, model, sub, sub.node_resources[LLM_KV])


def prefill(pe: Pi05Engine, feeds: dict) -> None:
    """One prefill batch: ``feeds`` rid -> (image rows [n, hidden], text ids)."""
    inputs = {rid: {"img_emb": [img], "text_inputs": [torch.as_tensor(ids, dtype=torch.long)]}
              for rid, (img, ids) in feeds.items()}
    b = run_batch(pe.engine, LLM, PREFILL, inputs, {}, {"is_prefill": True})
    pe.fed = {rid: int(inp.input_seq_len) for rid, inp in zip(b.request_ids, b.inputs, strict=True)}


def act(pe: Pi05Engine, rids: list[str]) -> dict:
    """The ``action_gen`` loop for ``rids`` batched: ``num_flow_steps`` Euler steps from M*'s own seeded noise.
    Returns rid -> the actions [horizon, action_dim] of every step."""
    state = {rid: {} for rid in rids}  # the first step draws its noise (``fwd_info.random_seed``)
    out = {rid: [] for rid in rids}
    for _ in range(pe.model.config.num_flow_steps):
        b = run_batch(pe.engine, LLM, ACTION, state, {}, {"is_prefill": False})
        state = {rid: {"noisy_actions": b.outputs[rid]["noisy_actions"],
                       "timestep_index": b.outputs[rid]["timestep_index"]} for rid in rids}
        for rid in rids:
            out[rid].append(b.outputs[rid]["noisy_actions"][0])
    return out
