"""M*'s real Qwen3-Omni talker node (mstar-ai 0.2.1, ``TalkerSubmodule`` over ``Qwen3OmniTalkerModel``: MoE layers
with a shared expert, its text and hidden projections of the thinker's states) under M*'s real ``Engine`` on CPU, for
the tests: what the talker computes from the ``thinker_states``/``thinker_mask`` edge a thinker walk sends it.

Like ``workloads.peers.mstar_qwen3_omni`` (whose tiny thinker config this extends), call it after
``workloads.peers.mstar_cpu_kernels.install``. The talker is tiny (two layers of 4 experts, hidden 32) and its weights
are drawn here under a fixed seed, not loaded: M*'s ``_create_talker_submodule`` (qwen3_omni_model.py:1433) streams
them from a checkpoint's ``talker.*`` tensors, which the thinker's fixture does not write; everything after the
weights (the submodule, its resources, ``prepare_inputs``' projections, the forward, paged attention through the
stand-ins) is M*'s. Only ``talker_prefill`` is driven: the talker's later walks sample codec tokens through the code
predictor, which reads nothing more of the thinker's prefill.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.distributed.communication import CommGroup  # noqa: E402
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.resources import SamplingReqConfig  # noqa: E402

from workloads.peers import mstar_qwen3_omni as q  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

TALKER, PREFILL = "Talker", "talker_prefill"
TALKER_KV, TALKER_POS = "talker_kv", "talker_pos"  # mstar/model/qwen3_omni/config.py:22, 28
TALKER_TEXT = dict(vocab_size=3072, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                   shared_expert_intermediate_size=32, head_dim=128)
CODE_PREDICTOR = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
TTS_IDS = dict(tts_pad_token_id=300, tts_bos_token_id=301, tts_eos_token_id=302)  # inside the tiny vocabulary


@dataclasses.dataclass
class TalkerEngine:
    """M*'s ``Engine`` loaded with the talker node: ``sub`` its submodule, ``kv`` its KV resource, ``hidden`` the
    talker backbone's output of each forward (a forward hook that only reads)."""

    engine: Engine
    sub: object
    kv: object
    hidden: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.sub.model.register_forward_hook(lambda mod, args, out: self.hidden.append(out.detach().clone()))


def talker_engine(weights: Path, pages: int = 64, page_size: int = 4, seed: int = 0) -> TalkerEngine:
    """The talker node of the tiny Qwen3-Omni on M*'s CPU engine, weights drawn under ``seed`` (bf16, as served)."""
    from mstar.model.qwen3_omni import config as c
    from mstar.model.qwen3_omni.components.talker import Qwen3OmniCodePredictor, Qwen3OmniTalkerModel
    from mstar.model.qwen3_omni.submodules import TalkerSubmodule

    model = q.omni_model(weights)
    cfg = model.config
    for name, value in TTS_IDS.items():
        setattr(cfg, name, value)
    cfg.talker_text = c.TalkerTextConfig(**TALKER_TEXT)
    cfg.talker = dataclasses.replace(cfg.talker, thinker_hidden_size=q.TEXT_SIZES["hidden_size"])
    cfg.code_predictor = dataclasses.replace(cfg.code_predictor, **CODE_PREDICTOR)
    torch.manual_seed(seed)
    talker, predictor = Qwen3OmniTalkerModel(cfg, comm_group=CommGroup.trivial()), Qwen3OmniCodePredictor(cfg)
    for p in (*talker.parameters(), *predictor.parameters()):
        torch.nn.init.normal_(p, 0.0, 0.2)
    sub = TalkerSubmodule(talker_model=talker.to(torch.bfloat16).eval(),
                          code_predictor=predictor.to(torch.bfloat16).eval(), config=cfg)
    sub.init_tts_embeds(torch.nn.Embedding(q.TEXT_SIZES["vocab_size"], q.TEXT_SIZES["hidden_size"]))
    model._submodule_cache[TALKER] = sub  # M*'s get_submodule hands out its cached submodule
    engine, nodes = cpu_engine(model, [TALKER], pages=pages, page_size=page_size, dtype=torch.bfloat16,
                               kv_key=TALKER_KV, rope_key=TALKER_POS)
    return TalkerEngine(engine, nodes[TALKER], nodes[TALKER].node_resources[TALKER_KV])


def configs() -> dict:
    greedy = SamplingReqConfig(temperature=0.0, top_p=1.0, ignore_eos=True)
    return {"talker_sampler": greedy, "code_sampler": greedy}


def prefill(te: TalkerEngine, rid: str, edge: tuple) -> torch.Tensor:
    """One ``talker_prefill`` step of ``rid`` on the ``(thinker_states, thinker_mask)`` a thinker walk sent it;
    returns the talker backbone's hidden states for those rows."""
    states, mask = edge
    b = run_batch(te.engine, TALKER, PREFILL, {rid: {"thinker_states": [states], "thinker_mask": [mask]}},
                  configs(), {"audio_output": True})
    if b.admit_error is not None:
        raise RuntimeError(f"{PREFILL}: admit failed: {type(b.admit_error).__name__}")
    return te.hidden[-1]


def kv_rows(te: TalkerEngine, rid: str) -> torch.Tensor:
    """The K/V the talker's stream of ``rid`` holds, every layer, position by position."""
    stream = te.kv._streams[rid][q.LABEL]
    tensor = te.kv.kv_cache.tensor  # [layers, pages, 2, page size, heads, head dim]
    pages = tensor[:, stream.page_indices].movedim(2, 1)  # [layers, 2, pages, page size, ...]
    return pages.flatten(2, 3)[:, :, :stream.stored_len]
