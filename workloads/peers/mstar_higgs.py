"""M*'s real Higgs Audio LLM node (mstar-ai 0.2.1, ``HiggsAudioLLMSubmodule`` over ``HiggsAudioLLM``, a dense Qwen3)
under M*'s real ``Engine`` on CPU, for the tests.

The weights: a tiny random ``Qwen3ForCausalLM`` (transformers, drawn under the repo's seeding rule) of the same
architecture as a tiny ``HiggsAudioModelConfig``, written in the Higgs checkpoint's layout (flat ``embed_tokens.*``,
``layers.N.*``, ``norm.*``, the text head at ``audio_decoder_proj.text_lm_head.weight``) as one ``model.safetensors``,
and loaded by M*'s own ``HiggsAudioModel.get_submodule("LLM")`` (its ``_llm_remap`` and fused-shard loader).
``dense_reference`` loads the same tensors back into transformers' ``Qwen3ForCausalLM``. Everything on the path is
M*'s but flashinfer's and triton's kernels (``workloads.peers.mstar_cpu_kernels``). The audio encoder node is not
built: a ``prefill_audio`` step hands the LLM node ``audio_embeds`` as the encoder's output edge would.

A Higgs request is three prefill walks and a decode loop (``HiggsAudioModel._build_prefill_schedule``):
``prefill_text`` (the ChatML prompt up to ``<|audio_bos|>``), ``prefill_audio`` (the encoder's embeddings),
``prefill_text`` (``<|audio_eos|>`` to the assistant turn, the last prefill: it samples the first token), then
``decode``. Both text walks feed ``input_ids`` and ``input_embeds = embed_tokens(input_ids)``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.resources import SamplingReqConfig  # noqa: E402
from mstar.model.higgs_audio.config import KV_CACHE, ROPE, SAMPLER, HiggsAudioModelConfig  # noqa: E402
from mstar.model.higgs_audio.higgs_audio_model import HiggsAudioModel  # noqa: E402

from mmcache.mstar import PrefixReuse  # noqa: E402
from mmcache.mstar.higgs import higgs_reuse as full_reuse  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

# Qwen3's shape (GQA, per-head QK norm, plain RoPE at theta 1e6), tiny; 2 layers so the layer cursor moves
CFG = HiggsAudioModelConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, intermediate_size=64, vocab_size=320, max_position_embeddings=1024)
LLM, LABEL = "LLM", "main"  # Higgs's LLM node and the label its steps write
TEXT_WALK, AUDIO_WALK = "prefill_text", "prefill_audio"
HEAD = "audio_decoder_proj.text_lm_head.weight"  # where the Higgs checkpoint keeps the text LM head


def qwen3_config(cfg: HiggsAudioModelConfig = CFG):
    """The transformers ``Qwen3Config`` of ``cfg``'s text LLM."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
                       num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                       rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                       rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                       tie_word_embeddings=False, initializer_range=0.2)


def higgs_layout(name: str) -> str:
    """A ``Qwen3ForCausalLM`` parameter's name in the Higgs checkpoint."""
    return HEAD if name == "lm_head.weight" else name.removeprefix("model.")


def save_weights(folder: Path, cfg: HiggsAudioModelConfig = CFG) -> Path:
    """A random ``Qwen3ForCausalLM`` of ``cfg`` in the Higgs layout, ``model.safetensors`` in a folder under
    ``folder`` (the repo's seeding rule, ``workloads.fixtures.saved``: the same folder name, the same weights)."""
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    from workloads import fixtures

    config = qwen3_config(cfg)

    def save(f: Path) -> None:
        state = Qwen3ForCausalLM(config).state_dict()
        save_file({higgs_layout(k): v.contiguous() for k, v in state.items()}, str(f / "model.safetensors"))

    return fixtures.saved(folder, "higgs-llm", config.to_json_string(), save)


def dense_reference(weights: Path, cfg: HiggsAudioModelConfig = CFG):
    """transformers' ``Qwen3ForCausalLM`` (fp32, eval) holding the tensors in ``weights``."""
    from safetensors.torch import load_file
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(qwen3_config(cfg))
    saved = load_file(str(Path(weights) / "model.safetensors"))
    model.load_state_dict({k: saved[higgs_layout(k)] for k in model.state_dict()}, strict=True)
    return model.eval()


def higgs_model(weights: Path, cfg: HiggsAudioModelConfig = CFG) -> HiggsAudioModel:
    """M*'s ``HiggsAudioModel`` over the folder ``weights``. Its constructor only resolves the hub tokenizer and the
    Whisper feature extractor (the tests feed ids and embeddings), so the instance is made without it; every method
    is M*'s."""
    model = object.__new__(HiggsAudioModel)
    model.config, model.local_dir, model.model_path_hf, model.cache_dir = cfg, str(weights), str(weights), None
    model._submodule_cache = {}
    return model


@dataclasses.dataclass
class HiggsEngine:
    """M*'s ``Engine`` loaded with Higgs's LLM node: ``sub`` its submodule, ``kv`` its KV resource, ``fed`` rid -> the
    rows the last ``walk`` computed for it (``input_seq_len`` after the reuse seam's cut), ``rows`` rid -> how many
    ``input_ids`` and ``input_embeds`` rows it was handed (None where absent; the forward consumes the embeddings on
    a prefill walk)."""

    engine: Engine
    sub: object
    kv: object
    fed: dict = dataclasses.field(default_factory=dict)
    rows: dict = dataclasses.field(default_factory=dict)


def higgs_reuse(audio: bool = False, **kw) -> PrefixReuse:
    """Reuse for Higgs's LLM: its text walks are named by their ids (they feed the embedding of exactly those); with
    ``audio``, its audio walk by its media digest too (``mmcache.mstar.higgs.higgs_reuse``)."""
    if audio:
        return full_reuse("higgs-tiny@test", **kw)
    return PrefixReuse(model="higgs-tiny@test", id_walks=(TEXT_WALK,), **kw)


def higgs_engine(weights: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                 dtype: torch.dtype = torch.bfloat16, cfg: HiggsAudioModelConfig = CFG) -> HiggsEngine:
    """The engine as M*'s worker builds it (``get_node_resources`` with the KV spec sized ``pages`` x ``page_size``,
    ``get_submodule("LLM")`` loading ``weights``, ``load_model``, ``warmup``); with ``reuse``, ``enable_reuse``
    first. bf16: M*'s default (autocast and KV in bf16); fp32 (KV and RoPE too) for the dense reference."""
    engine, nodes = cpu_engine(higgs_model(weights, cfg), [LLM], pages=pages, page_size=page_size, dtype=dtype,
                               kv_key=KV_CACHE, rope_key=ROPE, reuse=reuse)
    sub = nodes[LLM]
    return HiggsEngine(engine, sub, sub.node_resources[KV_CACHE])


def greedy() -> dict:
    """Per-request resource configs as Higgs's ``get_request_resource_configs`` makes them: greedy, no penalty."""
    return {SAMPLER: SamplingReqConfig(temperature=0.0, top_p=1.0, ignore_eos=True)}


def walk(he: HiggsEngine, graph_walk: str, feeds: dict[str, torch.Tensor], sampled, last_prefill: bool = False):
    """One batch of the LLM node on ``graph_walk``: ``feeds`` rid -> token ids (text walks, decode) or audio
    embeddings (``prefill_audio``). ``sampled``: the stand-in sampler's record (M*'s sampler samples on every walk;
    Higgs's ``postprocess`` keeps the token of the last prefill and of decode only). Returns rid -> (the token
    sampled, the logits the sampler was handed)."""
    calls = len(sampled.tokens)
    name = "audio_embeds" if graph_walk == AUDIO_WALK else "text_inputs"
    meta = {"is_prefill": graph_walk != "decode", "is_last_prefill": last_prefill}
    b = run_batch(he.engine, LLM, graph_walk, {rid: {name: [x]} for rid, x in feeds.items()}, greedy(), meta)
    assert len(sampled.tokens) == calls + 1, "one sampler call per step"
    he.fed = {rid: int(inp.input_seq_len) for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    he.rows = {rid: tuple(None if x is None else int(x.shape[0]) for x in (inp.input_ids, inp.input_embeds))
               for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    return {rid: (int(sampled.tokens[-1][i]), sampled.logits[-1][i]) for i, rid in enumerate(b.request_ids)}
