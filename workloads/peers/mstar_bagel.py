"""M*'s real BAGEL LLM node (mstar-ai 0.2.1, ``LLMSubmodule`` over ``BagelForCausalLM``, the mixture-of-transformers
Qwen2: understanding experts for text and ViT rows, generation experts for VAE rows) under M*'s real ``Engine`` on
CPU, for the tests.

The checkpoint: a tiny random ``ema.safetensors`` in BAGEL's layout (``language_model.model.layers.N.*`` with q/k/v
and gate/up unfused, the ``*_moe_gen`` experts beside them, ``language_model.lm_head.weight``, ``llm2vae.*``,
``vae2llm.*``, ``time_embedder.*``, ``latent_pos_embed.*``), tensors by ``workloads.peers.mstar_checkpoint.
random_hub_tensors``, loaded by M*'s own ``BagelModel.get_submodule("LLM")`` (``_load_into`` with
``LLAMA_STACKED_PARAMS``). The model's snapshot folder is given as ``repo`` (what ``_download_hf`` sets) and its
config as a tiny ``BagelModelConfig``: its constructor asks the hub for both and for the Qwen2 tokenizer, so the
instance is made without it. The ViT and VAE encoder nodes are not built: an image walk hands the LLM ``img_emb``
as the encoder's output edge would.

An understanding request with an image is ``prefill_text`` (system prompt and the user turn's opening),
``prefill_vit`` (``<|vision_start|>``, the ViT rows, ``<|vision_end|>``, attended bidirectionally at one position;
the last prefill: it samples the first token), ``prefill_text`` (the question and the assistant turn's opening), then
``decode`` (``BagelModel._build_prefill_schedule``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.resources import SamplingReqConfig  # noqa: E402
from mstar.model.bagel.bagel_model import BagelModel  # noqa: E402
from mstar.model.bagel.config import BagelAutoEncoderConfig, BagelModelConfig, BagelViTConfig  # noqa: E402

from mmcache.mstar import PrefixReuse  # noqa: E402
from workloads.peers.mstar_checkpoint import random_hub_tensors  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

LLM, LABEL, KV, ROPE, SAMPLER = "LLM", "main", "kv", "rope", "sampler"
TEXT_WALK, VIT_WALK, VAE_WALK = "prefill_text", "prefill_vit", "prefill_vae"
BOI, EOI, BOS, EOS = 300, 301, 302, 303  # <|vision_start|>, <|vision_end|>, ... in the tiny vocabulary
# Qwen2's shape (GQA, QK norm, q/k/v biases), tiny; 2 layers so the layer cursor moves
LLM_CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=320, max_position_embeddings=1024)


def tiny_config() -> BagelModelConfig:
    return BagelModelConfig(vae_config=BagelAutoEncoderConfig(), vit_config=BagelViTConfig(), **LLM_CFG)


def save_checkpoint(folder: Path) -> Path:
    """A tiny random ``ema.safetensors`` in BAGEL's layout in a folder under ``folder``, under the repo's seeding rule
    (``workloads.fixtures.saved``)."""
    import json

    from mstar.model.bagel.bagel_model import _BagelGenAuxEMA, _BagelLLMEMA
    from mstar.model.bagel.components.language_model import BagelForCausalLM
    from mstar.model.bagel.components.modeling_utils import PositionEmbedding, TimestepEmbedder
    from safetensors.torch import save_file

    from workloads import fixtures

    cfg = tiny_config()

    def save(f: Path) -> None:
        with torch.device("meta"):
            llm = _BagelLLMEMA(BagelForCausalLM(cfg), torch.nn.Linear(cfg.hidden_size, cfg.patch_latent_dim))
            aux = _BagelGenAuxEMA(torch.nn.Linear(cfg.patch_latent_dim, cfg.hidden_size),
                                  TimestepEmbedder(cfg.hidden_size), PositionEmbedding(cfg.max_latent_size,
                                                                                       cfg.hidden_size))
        heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
        g = torch.Generator().manual_seed(0)
        tensors = {**random_hub_tensors(llm, heads, g), **random_hub_tensors(aux, heads, g)}
        save_file(tensors, str(f / "ema.safetensors"))

    return fixtures.saved(folder, "bagel-llm", json.dumps(LLM_CFG, sort_keys=True), save)


def bagel_model(repo: Path) -> BagelModel:
    """M*'s ``BagelModel`` over the snapshot folder ``repo``, made without its constructor (which resolves the hub
    config and tokenizer); every method is M*'s."""
    model = object.__new__(BagelModel)
    model.config, model.cache_dir, model.model_path_hf, model.repo = tiny_config(), None, str(repo), Path(repo)
    model.boi_token_id, model.eoi_token_id, model.bos_token_id, model.eos_token_id = BOI, EOI, BOS, EOS
    model._submodule_cache, model._has_cfg_parallel = {}, False
    model.llm_initialized = model.vae_initialized = False
    return model


@dataclasses.dataclass
class BagelEngine:
    """M*'s ``Engine`` loaded with BAGEL's LLM node: ``sub`` its submodule, ``kv`` its KV resource, ``rope`` its
    position resource, ``fed`` rid -> the rows the last ``walk`` computed for it (after the reuse seam's cut)."""

    engine: Engine
    sub: object
    kv: object
    rope: object
    fed: dict = dataclasses.field(default_factory=dict)


def bagel_engine(repo: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                 dtype: torch.dtype = torch.bfloat16) -> BagelEngine:
    """The engine as M*'s worker builds it for the LLM node (``cpu_engine``; with ``reuse``, ``enable_reuse``
    first)."""
    engine, nodes = cpu_engine(bagel_model(repo), [LLM], pages=pages, page_size=page_size, dtype=dtype, kv_key=KV,
                               rope_key=ROPE, reuse=reuse)
    sub = nodes[LLM]
    return BagelEngine(engine, sub, sub.node_resources[KV], sub.node_resources[ROPE])


def greedy() -> dict:
    """Per-request resource configs: greedy (the sampling stand-in), BAGEL's default repetition penalty."""
    return {SAMPLER: SamplingReqConfig(temperature=0.0, top_p=1.0, repetition_penalty=1.05, ignore_eos=True)}


def walk(be: BagelEngine, graph_walk: str, feeds: dict[str, torch.Tensor], sampled, **metadata):
    """One batch of the LLM node on ``graph_walk``: ``feeds`` rid -> token ids (text walks, decode) or the encoder's
    image rows (``prefill_vit``, ``prefill_vae``). ``metadata``: the conductor's step metadata (``requires_cfg``,
    ``sample_prefill_token``). Returns rid -> (the token sampled, the logits the sampler was handed), empty for a
    walk that samples nothing (``prefill_vae``). ``RuntimeError`` naming the reason when the step's admit failed."""
    calls = len(sampled.tokens)
    name = "img_emb" if graph_walk in (VIT_WALK, VAE_WALK) else "text_inputs"
    meta = {"is_prefill": graph_walk != "decode", **metadata}
    b = run_batch(be.engine, LLM, graph_walk, {rid: {name: [x]} for rid, x in feeds.items()}, greedy(), meta)
    be.fed = {rid: int(inp.input_seq_len) for rid, inp in zip(b.request_ids, b.inputs, strict=True)}
    if b.admit_error is not None:  # nothing ran: M*'s worker drives the step again later
        raise RuntimeError(f"{graph_walk}: admit failed: {type(b.admit_error).__name__}")
    if len(sampled.tokens) == calls:
        return {}
    return {rid: (int(sampled.tokens[-1][i]), sampled.logits[-1][i]) for i, rid in enumerate(b.request_ids)}
