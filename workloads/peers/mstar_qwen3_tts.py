"""M*'s real Qwen3-TTS Talker node (mstar-ai 0.2.1, ``TalkerSubmodule`` over ``Qwen3TTSTalkerModel`` and its
``Qwen3TTSCodePredictor``) under M*'s real ``Engine`` on CPU, for the tests.

The checkpoint: a tiny random one in the official layout, written to a folder (``save_checkpoint``):
``config.json`` (``tts_model_type``, ``talker_config`` with its ``code_predictor_config``) read by M*'s own
``Qwen3TTSModelConfig.from_pretrained``, and ``model.safetensors`` with every tensor under ``talker.*`` (q/k/v and
gate/up unfused, as the hub checkpoint has them) loaded by M*'s own ``Qwen3TTSModel.get_submodule("Talker")``
(``iter_safetensors_shards``, ``load_hf_weights`` with its fused-shard rules, ``_verify_loaded``). The Codec node (the
speech-tokenizer decoder, from the ``qwen-tts`` package) is not built: its input is the Talker's codes.

Everything on the path is M*'s but flashinfer's and triton's kernels (``workloads.peers.mstar_cpu_kernels``) and
the CodePredictor's two triton kernels (``mstar.utils.attention``'s ``apply_rope_pos_ids`` and ``decode_attn_nhd``,
bound by name in ``components/talker.py``), stood in by ``install_code_predictor_kernels``.

A request is ``talker_prefill`` (the mixed text/codec rows ``TalkerSubmodule._build_prefill`` makes: 3 ChatML role
rows, 5 or 6 codec tag rows with the language and the speaker, the first text token) then ``talker_decode``, one row a
frame (the previous frame's summed codec embeddings plus the next text token's projection).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.model.qwen3_tts.config import TALKER_KV, TALKER_POS, Qwen3TTSModelConfig  # noqa: E402
from mstar.model.qwen3_tts.qwen3_tts_model import Qwen3TTSModel  # noqa: E402

from mmcache.mstar import PrefixReuse  # noqa: E402
from workloads.peers.mstar_checkpoint import random_hub_tensors  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

TALKER, LABEL = "Talker", "main"  # the node and the label its steps write
PREFILL, DECODE = "talker_prefill", "talker_decode"
ROLE = (151644, 77091, 198)  # <|im_start|>assistant\n, what ``_build_prefill`` requires first
SUFFIX = (151645, 198, 151644, 77091, 198)  # and last

# Qwen3's shape (GQA, per-head QK norm, plain RoPE at theta 1e6), tiny. The codec vocabulary stays 3072 (M* masks
# its top 1024 ids, where the control and speaker ids live) and the text vocabulary 151936 (the ChatML ids above).
TALKER_CONFIG = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                     intermediate_size=64, head_dim=16, max_position_embeddings=1024, vocab_size=3072,
                     text_hidden_size=16, text_vocab_size=151936, num_code_groups=4,
                     code_predictor_config=dict(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                                hidden_size=32, intermediate_size=64, head_dim=16, vocab_size=2048,
                                                num_code_groups=4, max_position_embeddings=64))
CONFIG_JSON = {"tts_model_type": "custom_voice", "talker_config": TALKER_CONFIG}


def save_checkpoint(folder: Path) -> Path:
    """A tiny random Qwen3-TTS CustomVoice checkpoint (``config.json`` + ``model.safetensors``, tensors by
    ``workloads.peers.mstar_checkpoint.random_hub_tensors``) in a folder under ``folder``, under the repo's seeding
    rule (``workloads.fixtures.saved``: the same folder name, the same weights)."""
    from mstar.model.qwen3_tts.components.talker import Qwen3TTSCodePredictor, Qwen3TTSTalkerModel
    from safetensors.torch import save_file

    from workloads import fixtures

    text = json.dumps(CONFIG_JSON, sort_keys=True)

    def save(f: Path) -> None:
        (f / "config.json").write_text(text)
        cfg = Qwen3TTSModelConfig.from_pretrained(f)
        t, cp = cfg.talker, cfg.code_predictor
        with torch.device("meta"):
            talker, predictor = Qwen3TTSTalkerModel(cfg), Qwen3TTSCodePredictor(cfg)
        g = torch.Generator().manual_seed(0)
        state = {"talker." + k: v for k, v in random_hub_tensors(
            talker, (t.num_attention_heads, t.num_key_value_heads, t.head_dim), g).items()}
        state.update({"talker.code_predictor." + k: v for k, v in random_hub_tensors(
            predictor, (cp.num_attention_heads, cp.num_key_value_heads, cp.head_dim), g).items()})
        save_file(state, str(f / "model.safetensors"))

    return fixtures.saved(folder, "qwen3-tts", text, save)


def dense_reference(checkpoint: Path):
    """transformers' ``Qwen3Model`` (fp32, eval) holding the Talker backbone's tensors in ``checkpoint`` (its
    ``talker.model.*``: the Talker is a Qwen3 over the rows it is fed), and the codec head's weight."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3Model

    t = Qwen3TTSModelConfig.from_pretrained(checkpoint).talker
    config = Qwen3Config(vocab_size=t.vocab_size, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                         num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
                         num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
                         max_position_embeddings=t.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta})
    saved = load_file(str(Path(checkpoint) / "model.safetensors"))
    model = Qwen3Model(config)
    state = {k: saved["talker.model." + k] for k in model.state_dict() if not k.startswith("embed_tokens.")}
    left = model.load_state_dict(state, strict=False)
    if left.unexpected_keys or left.missing_keys != ["embed_tokens.weight"]:  # the Talker is fed rows, not ids
        raise ValueError(f"the Talker backbone does not fill Qwen3Model: {left}")
    return model.eval(), saved["talker.codec_head.weight"]


def qwen3_tts_model(checkpoint: Path) -> Qwen3TTSModel:
    """M*'s ``Qwen3TTSModel`` over the folder ``checkpoint``, its config read by M*'s ``from_pretrained``. Its
    constructor also loads the hub tokenizer (the tests feed ids), so the instance is made without it; every method
    is M*'s."""
    model = object.__new__(Qwen3TTSModel)
    model.model_path_hf = model.local_dir = str(checkpoint)
    model.cache_dir, model._submodule_cache = None, {}
    model.config = Qwen3TTSModelConfig.from_pretrained(checkpoint)
    return model


# -- the CodePredictor's triton kernels -------------------------------------------------------------------------------
def apply_rope_pos_ids(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, rope_theta: float = 10000.0):
    """``mstar.utils.attention.apply_rope_pos_ids``: rotate-half RoPE in place on ``q`` [M, Hq, D] and ``k``
    [M, Hkv, D] at ``position_ids`` [M], in fp32; returns (q, k)."""
    from workloads.peers.mstar_cpu_kernels import rope_frequencies, rotate_halves

    zero = torch.tensor(0.0)
    rotate_halves(q, k, position_ids, rope_frequencies(q.shape[-1], rope_theta, 1.0, zero, zero))
    return q, k


def decode_attn_nhd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: int,
                    sm_scale: float | None = None) -> torch.Tensor:
    """``mstar.utils.attention.decode_attn_nhd``: one query a batch row (``q`` [B, 1, Hq, D] or [B, Hq, D]) over the
    first ``cache_len`` positions of its own ``k_cache``/``v_cache`` [B, S, Hkv, D], fp32, in ``q``'s dtype and
    shape."""
    squeeze = q.dim() == 4
    x = q.squeeze(1) if squeeze else q
    group = x.shape[1] // k_cache.shape[2]
    scale = sm_scale if sm_scale is not None else 1.0 / x.shape[-1] ** 0.5
    keys = k_cache[:, :cache_len].float().repeat_interleave(group, dim=2)  # [B, S, Hq, D]
    values = v_cache[:, :cache_len].float().repeat_interleave(group, dim=2)
    weights = ((keys * x.float()[:, None]).sum(-1) * scale).softmax(dim=1)  # [B, S, Hq]
    out = (weights[..., None] * values).sum(1).to(q.dtype)
    return out.unsqueeze(1) if squeeze else out


def install_code_predictor_kernels(patch) -> None:
    """Put the two stand-ins where ``components/talker.py`` looks them up (it imports them by name)."""
    from mstar.model.qwen3_tts.components import talker

    patch.setattr(talker, "apply_rope_pos_ids", apply_rope_pos_ids)
    patch.setattr(talker, "decode_attn_nhd", decode_attn_nhd)


# -- the engine -------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class TalkerEngine:
    """M*'s ``Engine`` loaded with the Talker node: ``sub`` its submodule, ``kv`` its KV resource, ``fed`` rid -> the
    rows the last ``walk`` computed for it (``input_seq_len`` after the reuse seam's cut), ``rows`` rid -> those
    rows (the ``input_embeds`` M*'s ``prepare_inputs`` made, as the seam left them)."""

    engine: Engine
    model: Qwen3TTSModel
    sub: object
    kv: object
    fed: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)


def talker_engine(checkpoint: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                  dtype: torch.dtype = torch.bfloat16) -> TalkerEngine:
    """The engine as M*'s worker builds it (``get_node_resources`` with the KV spec sized ``pages`` x
    ``page_size``, ``get_submodule("Talker")`` loading ``checkpoint``, ``load_model``, ``warmup``); with ``reuse``,
    ``enable_reuse`` first. bf16: M*'s default (autocast and KV in bf16); fp32 (KV and RoPE too) for a dense
    reference."""
    model = qwen3_tts_model(checkpoint)  # enable_reuse (in cpu_engine) turns reuse on in place
    engine, nodes = cpu_engine(model, [TALKER], pages=pages, page_size=page_size, dtype=dtype, kv_key=TALKER_KV,
                               rope_key=TALKER_POS, reuse=reuse)
    sub = nodes[TALKER]
    return TalkerEngine(engine, model, sub, sub.node_resources[TALKER_KV])


def greedy(model: Qwen3TTSModel) -> dict:
    """Per-request resource configs as the model's own ``get_request_resource_configs`` makes them, greedy at both
    levels (``do_sample``/``subtalker_dosample`` off), the Talker's repetition penalty kept, EOS ignored."""
    return model.get_request_resource_configs({}, {"do_sample": False, "subtalker_dosample": False,
                                                   "ignore_eos": True})


def prompt_ids(text: list[int]) -> torch.Tensor:
    """The Talker's ``text_inputs`` for ``text`` (token ids): the ChatML assistant turn ``process_prompt`` makes."""
    return torch.tensor([*ROLE, *text, *SUFFIX], dtype=torch.long)


def walk(te: TalkerEngine, graph_walk: str, feeds: dict, sampled) -> dict:
    """One batch of the Talker on ``graph_walk``. ``feeds``: rid -> ``(text ids, speaker id, language id)`` on the
    prefill, rid -> the previous frame's ``talker_input_embeds`` on decode. ``sampled``: the stand-in sampler's
    record (one call for codec group 0, then one for each residual group). Returns rid -> (the frame's codes, the
    group-0 logits the sampler was handed, the next step's ``talker_input_embeds``)."""
    if graph_walk == PREFILL:
        inputs = {rid: {"text_inputs": [prompt_ids(text)], "speaker_id": [torch.tensor([speaker])],
                        "language_id": [torch.tensor([language])]} for rid, (text, speaker, language) in feeds.items()}
    else:
        inputs = {rid: {"talker_input_embeds": [x]} for rid, x in feeds.items()}
    calls = len(sampled.tokens)
    meta = {"is_prefill": graph_walk == PREFILL, "talker_max_tokens": 1 << 20}
    b = run_batch(te.engine, TALKER, graph_walk, inputs, greedy(te.model), meta)
    assert len(sampled.tokens) == calls + te.model.config.num_code_groups, "one sampler call per codec group"
    te.fed = {rid: int(inp.input_seq_len) for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    te.rows = {rid: inp.input_embeds for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    out = b.outputs
    return {rid: (out[rid]["codec_tokens"][0], sampled.logits[calls][i], out[rid]["talker_input_embeds"][0])
            for i, rid in enumerate(b.request_ids)}
