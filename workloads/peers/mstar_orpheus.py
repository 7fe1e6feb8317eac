"""M*'s real Orpheus (mstar-ai 0.2.1), both nodes, under M*'s real ``Engine`` on CPU: for the tests, the benchmark
and the M* replays (``workloads.harness.mstar_serving``).

The weights: a tiny random Llama written by transformers (``LlamaForCausalLM.save_pretrained``, drawn under the
repo's seeding rule) from the same architecture as a tiny ``OrpheusModelConfig``, loaded by M*'s own
``OrpheusModel.get_submodule("LLM")`` -> ``load_weights`` (M*'s loader reads a local folder of safetensors; its hub
lookup gives the folder back as is); and, for the ``snac_decoder`` node, M*'s own ``SNAC`` class built from a tiny
config with random weights (``snac_config``), saved as the hub checkpoint is laid out (``config.json`` +
``pytorch_model.bin``) and loaded by M*'s ``get_submodule("snac_decoder")`` -> ``SNAC.from_pretrained`` from that
folder (named by the config's ``snac_model_id``). Everything then is M*'s: ``OrpheusLLMSubmodule`` and its
``OrpheusForCausalLM``, ``SNACDecoderSubmodule`` and its ``SNAC``, the model's own resource specs (``KVSpec``,
``AttentionSpec``, ``SamplerSpec``, ``PositionSpec``) built by ``Engine.load_model``, ``warmup``, and per step
``prepare_inputs`` -> ``exec_and_postprocess`` (declare, admit, plan, forward, commit) -> ``finalize_batch``, as M*'s
worker drives it. Only flashinfer's and triton's kernels are stood in (``workloads.peers.mstar_cpu_kernels``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.resources import SamplingReqConfig  # noqa: E402
from mstar.model.orpheus.config import KV_CACHE, ROPE, SAMPLER, OrpheusModelConfig  # noqa: E402
from mstar.model.orpheus.orpheus_model import OrpheusModel  # noqa: E402

from mmcache.mstar import PrefixReuse  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

# Llama 3.2's shape (GQA, llama3.1 RoPE scaling, RMSNorm, SwiGLU), tiny; 2 layers so the layer cursor moves
CFG = OrpheusModelConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         head_dim=8, intermediate_size=64, max_position_embeddings=1024, vocab_size=320,
                         pad_token_id=0)
LABEL = "main"  # the label OrpheusLLMSubmodule's steps write
LLM, SNAC_NODE = "LLM", "snac_decoder"  # Orpheus's node names


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


def snac_config(sampling_rate: int = 24000) -> dict:
    """``hubertsiuzdak/snac_24khz``'s config (hop 512 = 2*4*8*8, codebooks of 4096 at strides 4, 2, 1, no local
    attention, depthwise convolutions) with tiny widths, and its noise blocks off: the real decoder adds
    ``torch.randn`` noise scaled by a learned layer, so its audio differs from call to call; without it the audio is
    a function of the codes. M*'s ``SNACDecoderSubmodule`` reads codes modulo 4096 and slices samples 2048:4096 of
    a 4-frame window, so the hop and codebook size stay as in the checkpoint."""
    return dict(sampling_rate=sampling_rate, encoder_dim=4, encoder_rates=[2, 4, 8, 8], latent_dim=None,
                decoder_dim=32, decoder_rates=[8, 8, 4, 2], attn_window_size=None, codebook_size=4096,
                codebook_dim=8, vq_strides=[4, 2, 1], noise=False, depthwise=True)


def save_snac(folder: Path, config: dict | None = None) -> Path:
    """M*'s ``SNAC`` of ``config`` (default ``snac_config()``) with random weights, saved in ``folder`` as the hub
    checkpoint is (``config.json``, ``pytorch_model.bin``), under the repo's seeding rule."""
    from mstar.model.orpheus.components.snac import SNAC

    from workloads import fixtures

    config = config or snac_config()
    text = json.dumps(config, sort_keys=True)

    def save(f: Path) -> None:
        (f / "config.json").write_text(text)
        torch.save(SNAC(**config).state_dict(), f / "pytorch_model.bin")

    return fixtures.saved(folder, "orpheus-snac", text, save)


def orpheus_model(weights: Path, cfg: OrpheusModelConfig = CFG, snac: Path | None = None) -> OrpheusModel:
    """M*'s ``OrpheusModel`` over ``weights`` with config ``cfg`` (its SNAC checkpoint: the folder ``snac``). Its
    constructor only resolves the hub tokenizer (the replays tokenize themselves), so the instance is made without
    it; every method is M*'s."""
    model = object.__new__(OrpheusModel)
    if snac is not None:
        cfg = dataclasses.replace(cfg, snac_model_id=str(snac))
    model.config, model.model_path_hf, model.cache_dir, model._submodule_cache = cfg, str(weights), None, {}
    return model


@dataclasses.dataclass
class OrpheusEngine:
    """M*'s ``Engine`` loaded with Orpheus's LLM node (and its ``snac_decoder`` node when built with one); ``sub`` is
    the LLM's submodule, ``kv`` its KV resource, ``embedded`` the token count of each call of the LM's embedding
    (what the forward computed; a forward hook that only reads), ``fed`` rid -> the tokens the last ``engine_step``
    computed for it (what its ``prepare_inputs`` made, after the reuse seam cut a prompt to its uncached suffix)."""

    engine: Engine
    sub: object
    kv: object
    embedded: list = dataclasses.field(default_factory=list)
    fed: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.sub.embed_tokens.register_forward_hook(lambda mod, args, out: self.embedded.append(args[0].numel()))


def orpheus_engine(weights: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                   dtype: torch.dtype = torch.bfloat16, cfg: OrpheusModelConfig = CFG,
                   snac: Path | None = None) -> OrpheusEngine:
    """The engine as M*'s worker builds it: ``get_node_resources`` (its KV spec sized by the deployment's overrides,
    ``pages`` x ``page_size``), ``get_submodule("LLM")`` loading ``weights`` (and ``get_submodule("snac_decoder")``
    loading the SNAC checkpoint in folder ``snac``, when given: both nodes on one engine, the decoder in fp32 as it
    opts out of autocast), ``load_model`` and ``warmup``; with ``reuse``, ``enable_reuse`` first (one call: the KV
    spec becomes a ``ReuseKVSpec``, the node gets the seam). bf16 (M*'s default): autocast and KV in bf16. fp32: no
    autocast, KV in fp32 and RoPE in fp32 (M*'s ``RopeManager`` rotates fp32 in bf16 unless its config names
    ``rope_dtype``), for comparing with an fp32 reference."""
    engine, nodes = cpu_engine(orpheus_model(weights, cfg, snac), [LLM] + ([SNAC_NODE] if snac is not None else []),
                               pages=pages, page_size=page_size, dtype=dtype, kv_key=KV_CACHE, rope_key=ROPE,
                               reuse=reuse, label=LABEL)
    return OrpheusEngine(engine, nodes[LLM], nodes[LLM].node_resources[KV_CACHE])


def greedy(repetition_penalty: float = 1.3) -> dict:
    """Per-request resource configs: temperature 0 (the sampling stand-in is greedy), Orpheus's own penalty."""
    return {SAMPLER: SamplingReqConfig(temperature=0.0, top_p=1.0, repetition_penalty=repetition_penalty,
                                       ignore_eos=True)}


def engine_step(oe: OrpheusEngine, walk: str, feeds: dict[str, list[int]], sampled) -> dict[str, tuple]:
    """One batch of the LLM node on ``walk`` ("prefill" or "decode"). ``sampled``: the stand-in sampler's record.
    Returns rid -> (the token M*'s sampler picked, the logits it was handed, None when the record keeps none);
    ``oe.embedded[-1]`` is the tokens the step computed."""
    calls = len(sampled.tokens)
    b = run_batch(oe.engine, LLM, walk, {rid: {"text_inputs": [torch.as_tensor(ids, dtype=torch.long)]}
                                         for rid, ids in feeds.items()}, greedy())
    assert len(sampled.tokens) == calls + 1, "one sampler call per step"
    oe.fed = {rid: int(inp.input_seq_len) for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    logits, tokens = (sampled.logits[-1] if sampled.keep_logits else None), sampled.tokens[-1]
    got = {}
    for i, rid in enumerate(b.request_ids):  # the sampler's rows are the batch's requests, in order
        token = int(b.outputs[rid]["new_token"][0])
        assert token == int(tokens[i]), (rid, token, tokens)
        got[rid] = (token, None if logits is None else logits[i])
    return got
