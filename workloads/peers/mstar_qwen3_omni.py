"""M*'s real Qwen3-Omni thinker node (mstar-ai 0.2.1, ``ThinkerSubmodule`` over ``Qwen3OmniThinkerModel``: MoE and
dense layers, QK-norm, interleaved 3D MRoPE, deepstack) under M*'s real ``Engine`` on CPU, for the tests.

Importing anything of ``mstar.model.qwen3_omni`` needs a ``flashinfer`` module (components/talker.py:18 imports it
at module level), so this harness imports M*'s Qwen3-Omni classes only inside its functions: call them after
``workloads.peers.mstar_cpu_kernels.install`` (a test's monkeypatch), which puts the CPU stand-ins there. The
thinker's path reaches only the paged-attention wrappers and the sampler among them: its MRoPE is M*'s own torch
(``components/rope.py``: ``compute_3d_cos_sin``, ``apply_interleaved_mrope``), not flashinfer's RoPE. (The talker's
code predictor calls ``flashinfer.rope.apply_rope_pos_ids``, talker.py:435; the talker is not built here.)

The weights: transformers' ``Qwen3OmniMoeThinkerTextModel`` of a tiny ``Qwen3OmniMoeTextConfig`` (one MoE layer of 4
experts, one dense layer; head_dim 128 so the MRoPE sections [24, 20, 20] interleave as in the checkpoint) and an LM
head, drawn under the repo's seeding rule and written in the hub checkpoint's layout (``thinker.model.*`` with one
tensor per expert projection, ``thinker.lm_head.weight``) as one ``model.safetensors``, loaded by M*'s own
``Qwen3OmniModel.get_submodule("Thinker")`` (``_thinker_remap``, the stacked expert and QKV rules).
``dense_reference`` is that transformers model on the same tensors. Without ``vision``, the encoders are not built:
an audio or vision walk hands the thinker ``audio_embeds``, or ``vision_embeds``, ``deepstack`` and
``image_grid_thw``, as the encoder's output edges would.

The vision node (``thinker_engine(vision=...)``, for the ``vlm-mstar`` replay): M*'s own ``VisionEncoderSubmodule``
over transformers' ``Qwen3OmniMoeVisionEncoder`` at a tiny config (``VISION_SIZES``: 2 blocks, deepstack on both,
output width the thinker's), its weights saved under ``thinker.visual.*`` as the hub checkpoint holds them and loaded
by M*'s own ``load_weights_from_hf_shards``, on the same engine as the thinker. It is built here rather than by M*'s
``get_submodule("vision_encoder")`` because that builds the tower with ``attn_implementation="flash_attention_2"``
(qwen3_omni_model.py:1621-1623), which transformers refuses without the flash-attn package (no CPU build: "the
package for FlashAttention2 doesn't seem to be installed"); here the tower is transformers' sdpa attention, the rest
of ``_create_vision_encoder_submodule`` (qwen3_omni_model.py:1590-1633) as M* has it. ``image_tensors`` turns an
image into the node's inputs as M*'s data worker does (``Model.load_image``, then ``process_prompt``'s image
processor call).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from mmcache.errors import InvalidMedia
from mmcache.mstar.requirement import require_mstar

require_mstar()
from mstar.engine.engine import Engine  # noqa: E402
from mstar.engine.resources import SamplingReqConfig  # noqa: E402

from mmcache.mstar import PrefixReuse, enable_encoder_reuse  # noqa: E402
from mmcache.mstar.qwen3_omni import qwen3_omni_reuse  # noqa: E402
from workloads.peers.mstar_engine import cpu_engine, run_batch  # noqa: E402

THINKER, LABEL = "Thinker", "main"  # the thinker node and the label its steps write
# M*'s resource keys for the thinker (mstar/model/qwen3_omni/config.py:21-31; constants, not imported: see above)
THINKER_KV, THINKER_POS, THINKER_SAMPLER = "thinker_kv", "thinker_pos", "thinker_sampler"
TEXT, AUDIO, VISION, DECODE = "prefill_text", "prefill_audio", "prefill_vision", "thinker_decode"
TEXT_SIZES = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], rms_norm_eps=1e-6,
                  rope_theta=1e6)
# the special ids inside the tiny vocabulary: sentinels, ChatML roles
SPECIAL = dict(audio_start_token_id=303, audio_end_token_id=304, vision_start_token_id=305,
               vision_end_token_id=306)
ROLES = dict(im_start_token_id=310, im_end_token_id=311, system_token_id=312, user_token_id=313,
             assistant_token_id=314)
DEEPSTACK = 2  # deepstack features on layers 0 and 1
VISION_NODE = "vision_encoder"
VISION_SIZES = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2,
                    spatial_merge_size=2, out_hidden_size=TEXT_SIZES["hidden_size"], num_position_embeddings=64,
                    deepstack_visual_indexes=list(range(DEEPSTACK)))
# the image processor's pixel budget: at most 8 x 8 patches of 16 pixels, 16 merged rows per image
IMAGE_PIXELS = dict(min_pixels=32 * 32, max_pixels=128 * 128)


def _require_flashinfer() -> None:
    if "flashinfer" not in sys.modules:
        raise RuntimeError("install the CPU stand-ins first (workloads.peers.mstar_cpu_kernels.install): "
                           "mstar.model.qwen3_omni imports flashinfer at module level")


def model_config():
    """M*'s ``Qwen3OmniModelConfig`` of the tiny thinker (talker, code2wav and encoders keep their defaults: not
    built)."""
    _require_flashinfer()
    from mstar.model.qwen3_omni import config as c

    text = c.ThinkerTextConfig(**TEXT_SIZES)
    return c.Qwen3OmniModelConfig(**ROLES, thinker_text=text, thinker=c.ThinkerConfig(**SPECIAL),
                                  talker=c.TalkerConfig(accept_hidden_layer=1),
                                  vision=c.VisionEncoderConfig(deepstack_visual_indexes=tuple(range(DEEPSTACK))))


def text_config():
    """transformers' ``Qwen3OmniMoeTextConfig`` of the same thinker (interleaved MRoPE, sections [24, 20, 20])."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

    sizes = {k: v for k, v in TEXT_SIZES.items() if k != "rope_theta"}
    return Qwen3OmniMoeTextConfig(**sizes, rope_parameters={"rope_type": "default", "rope_theta": TEXT_SIZES[
        "rope_theta"], "mrope_section": [24, 20, 20], "interleaved": True}, initializer_range=0.2,
        tie_word_embeddings=False)


def hub_layout(state: dict) -> dict:
    """transformers' thinker text model + LM head (``lm_head.weight``) as the hub checkpoint names them: under
    ``thinker.``, fused experts split into one tensor per expert and projection (gate rows first in
    ``gate_up_proj``)."""
    out = {}
    inter = TEXT_SIZES["moe_intermediate_size"]
    for name, t in state.items():
        key = "thinker." + (name if name == "lm_head.weight" else "model." + name)
        if name.endswith("mlp.experts.gate_up_proj"):
            for j in range(t.shape[0]):
                out[key.replace("gate_up_proj", f"{j}.gate_proj.weight")] = t[j, :inter].contiguous()
                out[key.replace("gate_up_proj", f"{j}.up_proj.weight")] = t[j, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for j in range(t.shape[0]):
                out[key.replace("down_proj", f"{j}.down_proj.weight")] = t[j].contiguous()
        else:
            out[key] = t.contiguous()
    return out


def _transformers_thinker():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextModel

    config = text_config()
    return config, Qwen3OmniMoeThinkerTextModel(config), torch.nn.Linear(config.hidden_size, config.vocab_size,
                                                                         bias=False)


def save_weights(folder: Path) -> Path:
    """The random thinker in the hub layout, ``model.safetensors`` in a folder under ``folder`` (the repo's seeding
    rule, ``workloads.fixtures.saved``: the same folder name, the same weights)."""
    from safetensors.torch import save_file

    from workloads import fixtures

    config = text_config()

    def save(f: Path) -> None:
        _, text, head = _transformers_thinker()
        for name, p in text.named_parameters():  # norms drawn around 1, everything else N(0, 0.2)
            torch.nn.init.normal_(p, 1.0 if name.endswith("norm.weight") else 0.0, 0.2)
        torch.nn.init.normal_(head.weight, 0.0, 0.2)
        state = {**text.state_dict(), "lm_head.weight": head.weight.detach()}
        save_file(hub_layout(state), str(f / "model.safetensors"))

    return fixtures.saved(folder, "qwen3-omni-thinker", config.to_json_string(), save)


def dense_reference(weights: Path):
    """transformers' ``Qwen3OmniMoeThinkerTextModel`` and LM head (fp32, eval) holding the tensors in ``weights``."""
    from safetensors.torch import load_file

    _, text, head = _transformers_thinker()
    saved = load_file(str(Path(weights) / "model.safetensors"))
    fused = {}
    inter = TEXT_SIZES["moe_intermediate_size"]
    for name in text.state_dict():
        key = "thinker.model." + name
        if name.endswith("mlp.experts.gate_up_proj"):
            j = range(TEXT_SIZES["num_experts"])
            fused[name] = torch.stack([torch.cat((saved[key.replace("gate_up_proj", f"{i}.gate_proj.weight")],
                                                  saved[key.replace("gate_up_proj", f"{i}.up_proj.weight")]))
                                       for i in j])
            assert fused[name].shape[1] == 2 * inter
        elif name.endswith("mlp.experts.down_proj"):
            fused[name] = torch.stack([saved[key.replace("down_proj", f"{i}.down_proj.weight")]
                                       for i in range(TEXT_SIZES["num_experts"])])
        else:
            fused[name] = saved[key]
    text.load_state_dict(fused, strict=True)
    head.load_state_dict({"weight": saved["thinker.lm_head.weight"]})
    return text.eval(), head.eval()


def vision_config():
    """transformers' ``Qwen3OmniMoeVisionEncoderConfig`` of the tiny vision tower."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeVisionEncoderConfig

    return Qwen3OmniMoeVisionEncoderConfig(**VISION_SIZES)


def _vision_tower():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    return Qwen3OmniMoeVisionEncoder._from_config(vision_config(), attn_implementation="sdpa")


def save_vision_weights(folder: Path) -> Path:
    """The random vision tower as the hub checkpoint names it (``thinker.visual.*``), ``model.safetensors`` in a
    folder under ``folder`` (the repo's seeding rule: the same folder name, the same weights)."""
    from safetensors.torch import save_file

    from workloads import fixtures

    def save(f: Path) -> None:
        state = {"thinker.visual." + k: v.contiguous() for k, v in _vision_tower().state_dict().items()}
        save_file(state, str(f / "model.safetensors"))

    return fixtures.saved(folder, "qwen3-omni-vision", vision_config().to_json_string(), save)


def vision_submodule(weights: Path):
    """M*'s ``VisionEncoderSubmodule`` over the tiny tower in ``weights``, loaded by M*'s own loader (see the module
    docstring for why the tower is built here)."""
    _require_flashinfer()
    from mstar.model.qwen3_omni.submodules import VisionEncoderSubmodule
    from mstar.model.utils import ModuleAndPrefix, load_weights_from_hf_shards

    tower = _vision_tower()
    load_weights_from_hf_shards(repo_dir=str(weights), modules=[ModuleAndPrefix(tower, prefix="thinker.visual")],
                                device="cpu")
    return VisionEncoderSubmodule(vision_encoder=tower.eval(), config=model_config())


def image_processor():
    """The image processor Qwen3-Omni's checkpoint ships (``Qwen2VLImageProcessor``: 16-pixel patches, 2 frames a
    temporal patch, 2 x 2 merge), held to ``IMAGE_PIXELS``."""
    from transformers import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(patch_size=VISION_SIZES["patch_size"], merge_size=VISION_SIZES["spatial_merge_size"],
                                 temporal_patch_size=VISION_SIZES["temporal_patch_size"], **IMAGE_PIXELS)


def image_tensors(model, processor, data: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values, image_grid_thw)`` of an encoded image as M*'s data worker makes them: M*'s
    ``Model.load_image`` decodes it to (C, H, W) floats in [0, 1] (base.py:455-461), then ``process_prompt``'s
    conversion to uint8 (H, W, C) and its image processor call (qwen3_omni_model.py:1130-1142, 1181-1185).
    ``InvalidMedia`` for bytes that do not decode."""
    try:
        img = model.load_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), "cpu").data
        u8 = (img * 255.0).clamp(0, 255).to(torch.uint8)
        u8 = u8.permute(1, 2, 0) if u8.dim() == 3 and u8.shape[0] in (1, 3) else u8
        out = processor(images=[u8.contiguous().numpy()], return_tensors="pt")
    except (RuntimeError, ValueError) as e:  # torchvision's decoder, the processor
        raise InvalidMedia(f"cannot decode image ({len(data):,} bytes): {e}") from e
    return out["pixel_values"], out["image_grid_thw"][0]


def serve_vision_on_cpu(model, weights: Path) -> None:
    """Make ``model.get_submodule("vision_encoder")`` return ``vision_submodule(weights)`` (made once), every other
    node M*'s own: the instance's method is wrapped, M*'s class is untouched."""
    get, made = model.get_submodule, {}

    def get_submodule(node_name, *args, **kwargs):
        if node_name != VISION_NODE:
            return get(node_name, *args, **kwargs)
        if VISION_NODE not in made:
            made[VISION_NODE] = vision_submodule(weights)
        return made[VISION_NODE]

    model.get_submodule = get_submodule


def omni_model(weights: Path):
    """M*'s ``Qwen3OmniModel`` over the folder ``weights``. Its constructor only resolves the hub snapshot, the
    tokenizer and the processor (the tests feed ids and embeddings), so the instance is made without it; every
    method is M*'s."""
    _require_flashinfer()
    from mstar.model.qwen3_omni.qwen3_omni_model import Qwen3OmniModel

    model = object.__new__(Qwen3OmniModel)
    model.config, model.local_dir, model.model_path_hf = model_config(), str(weights), str(weights)
    model.cache_dir, model._submodule_cache = None, {}
    return model


@dataclasses.dataclass
class ThinkerEngine:
    """M*'s ``Engine`` loaded with the thinker node: ``sub`` its submodule, ``kv`` its KV resource, ``pos`` its
    position resource (the MRoPE counter), ``fed`` rid -> what the last ``walk`` computed for it (the node inputs
    after the reuse seam's cut), ``hidden`` the final normed hidden states of each forward, its rows packed in batch
    order (a forward hook that only reads); of the last walk, rid -> its ``(thinker_states, thinker_mask)`` as the
    talker is sent them (``talker``, after M*'s postprocess; absent without audio output) and as M*'s postprocess
    was handed them (``raw``: every row, after the reuse seam put back the rows a cut held)."""

    engine: Engine
    sub: object
    kv: object
    pos: object
    vision: object = None  # the vision node as the engine holds it (``CachedEncoderNode`` with reuse on), if built
    fed: dict = dataclasses.field(default_factory=dict)
    hidden: list = dataclasses.field(default_factory=list)
    talker: dict = dataclasses.field(default_factory=dict)
    raw: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        self.sub.model.model.norm.register_forward_hook(lambda mod, args, out: self.hidden.append(out.detach()))


def thinker_reuse() -> PrefixReuse:
    """``mmcache.mstar.qwen3_omni.qwen3_omni_reuse`` for the tiny thinker."""
    return qwen3_omni_reuse("qwen3-omni-tiny@test", TEXT_SIZES["hidden_size"])


def thinker_engine(weights: Path, reuse: PrefixReuse | None = None, pages: int = 64, page_size: int = 4,
                   dtype: torch.dtype = torch.bfloat16, vision: Path | None = None,
                   encoder_bytes: int = 1 << 24) -> ThinkerEngine:
    """The engine as M*'s worker builds it (the model's specs, the KV spec sized ``pages`` x ``page_size``,
    ``get_submodule("Thinker")`` loading ``weights``, ``load_model``, ``warmup``); with ``reuse``, ``enable_reuse``
    first. bf16: M*'s default (autocast and KV in bf16); fp32 for the dense reference. ``vision``: the vision tower's
    weights (``save_vision_weights``), its node on the same engine; with ``reuse`` its outputs are reused too
    (``enable_encoder_reuse`` with a store of ``encoder_bytes``: what ``enable_reuse(encoders=True)`` does, sized)."""
    raw: dict = {}
    model = omni_model(weights)
    model.get_submodule = _recording_postprocess(model.get_submodule, raw)  # under the seam: sees what it restored
    if vision is not None:
        serve_vision_on_cpu(model, vision)
        if reuse is not None:
            enable_encoder_reuse(model, capacity_bytes=encoder_bytes, page_bytes=4096)
    engine, nodes = cpu_engine(model, [THINKER] + ([VISION_NODE] if vision is not None else []), pages=pages,
                               page_size=page_size, dtype=dtype, kv_key=THINKER_KV, rope_key=THINKER_POS, reuse=reuse)
    sub = nodes[THINKER]
    return ThinkerEngine(engine, sub, sub.node_resources[THINKER_KV], sub.node_resources[THINKER_POS],
                         nodes.get(VISION_NODE), raw=raw)


def talker_edge(outputs: dict) -> tuple | None:
    """``(thinker_states, thinker_mask)`` of one request's outputs, or None where it has none."""
    if "thinker_states" not in outputs:
        return None
    return outputs["thinker_states"][0], outputs["thinker_mask"][0]


def _recording_postprocess(get_submodule, raw: dict):
    """``get_submodule`` whose submodules record into ``raw`` (rid -> ``talker_edge``) the outputs their
    ``postprocess`` is handed (a copy of the references, before it selects and filters them)."""
    def get(node_name, *args, **kwargs):
        sub = get_submodule(node_name, *args, **kwargs)
        if node_name != THINKER:
            return sub
        post = sub.postprocess

        def postprocess(*a, **k):
            edge = talker_edge(k["outputs"])
            if edge is not None:
                raw[k["request_id"]] = edge
            return post(*a, **k)

        sub.postprocess = postprocess
        return sub

    return get


def greedy() -> dict:
    """Per-request resource configs: greedy (the sampling stand-in's only mode), no penalty, no stop."""
    return {THINKER_SAMPLER: SamplingReqConfig(temperature=0.0, top_p=1.0, ignore_eos=True)}


def walk_inputs(graph_walk: str, x) -> dict:
    """The thinker's inputs on ``graph_walk`` as its graph's edges bring them: token ids (text, decode), audio
    embeddings, or a vision item ``(rows, deepstack rows per layer, grid_thw)``."""
    if graph_walk in (TEXT, DECODE):
        return {"text_inputs": [x]}
    if graph_walk == AUDIO:
        return {"audio_embeds": [x]}
    rows, deepstack, grid = x
    return {"vision_embeds": [rows], "deepstack": list(deepstack), "image_grid_thw": [grid]}


def walk(te: ThinkerEngine, graph_walk: str, feeds: dict, sampled, last_prefill: bool = False,
         audio_output: bool = False) -> dict:
    """One batch of the thinker on ``graph_walk``: ``feeds`` rid -> what ``walk_inputs`` takes. ``sampled``: the
    stand-in sampler's record. ``audio_output``: the conductor's flag (the thinker then streams every row to the
    talker). Returns rid -> (the token sampled, the logits the sampler was handed, this request's rows of the final
    hidden states); token and logits are None where M* samples nothing (one request's forward samples on decode and
    the last prefill only; a batch of several samples on every walk). ``RuntimeError`` naming the reason when the
    step's admit failed."""
    calls = len(sampled.tokens)
    te.raw.clear()
    meta = {"is_prefill": graph_walk != DECODE, "is_last_prefill": last_prefill, "audio_output": audio_output}
    b = run_batch(te.engine, THINKER, graph_walk, {rid: walk_inputs(graph_walk, x) for rid, x in feeds.items()},
                  greedy(), meta)
    te.fed = dict(zip(b.request_ids, b.inputs, strict=True))
    te.talker = {rid: edge for rid in b.request_ids if (edge := talker_edge(b.outputs.get(rid, {}))) is not None}
    if b.admit_error is not None:  # nothing ran: M*'s worker drives the step again later
        raise RuntimeError(f"{graph_walk}: admit failed: {type(b.admit_error).__name__}")
    drew = len(sampled.tokens) > calls
    rows = te.hidden[-1].split([int(inp.input_seq_len) for inp in b.inputs])
    return {rid: (int(sampled.tokens[-1][i]) if drew else None, sampled.logits[-1][i] if drew else None, rows[i])
            for i, rid in enumerate(b.request_ids)}
