"""Tiny random checkpoints in the layouts M* 0.2.1's own loaders read, and M*'s ``Model`` over each, for the tests that
turn encoder reuse on with the one call (``enable_encoder_reuse``) and serve the node through M*'s worker path.

``SERVED[name](root)`` -> ``Served``: ``model()`` is a fresh M* ``Model`` over the saved folder (reuse on and reuse off
each get their own), whose ``get_submodule(node)`` builds the encoder node with M*'s own code: ``from_pretrained`` of
a subfolder (Wan 2.2, Cosmos3), ``load_weights_from_hf_shards`` (Whisper, Higgs Audio), ``load_hf_weights`` after a
meta build and ``to_empty`` (Pi0.5, V-JEPA 2), ``_load_into`` of ``ema.safetensors`` (BAGEL). Constructors that
resolve a hub snapshot, tokenizer or processor are skipped (``object.__new__`` and the attributes they set), as the
``workloads.peers`` harnesses do. ``reference`` is the seeded module the folder was written from and ``weights(node)``
the node's module that must hold the same parameters after M*'s load (``same_parameters``).

Wan 2.2's text encoder (``wan22_text``) and Qwen3-Omni's encoders (``qwen3_omni_encoders``), whose tests also run the
model's own prompt and media processing, give their folder and M*'s ``Model`` over it."""

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from workloads import fixtures


@dataclasses.dataclass
class Served:
    model: Callable[[], object]  # a fresh M* Model over the checkpoint
    node: str  # the encoder node's name
    walk: str
    request: Callable[[int], dict]  # distinct node inputs per seed
    tower: Callable[[object], torch.nn.Module]  # M*'s node -> the module whose forward is one encoder run
    weights: Callable[[object], torch.nn.Module]  # M*'s node -> the module holding what was saved
    reference: torch.nn.Module  # the module the checkpoint was written from
    step_metadata: dict | None = None


def same_parameters(loaded: torch.nn.Module, reference: torch.nn.Module) -> bool:
    """Every parameter of ``reference`` is in ``loaded`` under its name, bit for bit (in the dtype M* loaded it in:
    Wan 2.2's VAE encoder loads in bf16)."""
    got = dict(loaded.named_parameters())
    return all(name in got and torch.equal(got[name].detach(), p.detach().to(got[name].dtype))
               for name, p in reference.named_parameters())


def _randn(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _written(root: Path, kind: str, key: str, build: Callable[[], torch.nn.Module],
             write: Callable[[Path, torch.nn.Module], None]) -> tuple[Path, torch.nn.Module]:
    """``build()`` under the repo's seeding rule and the folder ``write`` saved it to (``workloads.fixtures``)."""
    with fixtures.seeded():
        module = build().eval()
    return fixtures.saved(root, kind, key, lambda f: write(f, module)), module


def _safetensors(name: str = "model.safetensors", prefix: str = "", rename: Callable[[str], str] = lambda k: k):
    """A ``write`` that saves the module's state as one safetensors file, each key renamed and prefixed."""
    def write(folder: Path, module: torch.nn.Module) -> None:
        save_file({prefix + rename(k): v.contiguous() for k, v in module.state_dict().items()}, str(folder / name))
    return write


def _bare(cls, **attrs):
    """An M* ``Model`` of ``cls`` made without its constructor, with ``attrs`` set (every method is M*'s)."""
    model = object.__new__(cls)
    for name, value in {"cache_dir": None, "_submodule_cache": {}, **attrs}.items():
        setattr(model, name, value)
    return model


# -- one builder per model ----------------------------------------------------------------------------------------
def whisper(root: Path) -> Served:
    from mstar.model.whisper.config import WhisperModelConfig
    from mstar.model.whisper.whisper_model import WhisperModel
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16,
                        max_source_positions=30, vocab_size=128, max_target_positions=32, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    folder, whole = _written(root, "whisper", cfg.to_json_string(), lambda: WhisperForConditionalGeneration(cfg),
                             lambda f, m: m.save_pretrained(f))
    return Served(lambda: _bare(WhisperModel, local_dir=str(folder),
                                config=WhisperModelConfig.from_pretrained(str(folder))),
                  "audio_encoder", "encode", lambda s: {"audio_features": [_randn(s, 16, 60)]},
                  lambda node: node.audio_encoder, lambda node: node.audio_encoder, whole.model.encoder)


def higgs_audio(root: Path) -> Served:
    from mstar.model.higgs_audio.components.audio_tower import HiggsAudioFeatureProjector, HiggsAudioTower
    from mstar.model.higgs_audio.config import HiggsAudioModelConfig
    from mstar.model.higgs_audio.higgs_audio_model import HiggsAudioModel
    sizes = dict(hidden_size=32, audio_d_model=32, audio_encoder_layers=2, audio_encoder_attention_heads=2,
                 audio_encoder_ffn_dim=64, audio_num_mel_bins=16, audio_max_source_positions=64)
    cfg = HiggsAudioModelConfig(**sizes)
    # the checkpoint's names: audio_tower.* and audio_encoder_proj.* (higgs_audio_model.py, _create_encoder_submodule)
    folder, ref = _written(root, "higgs-audio-encoder", json.dumps(sizes, sort_keys=True), lambda: torch.nn.ModuleDict(
        {"audio_tower": HiggsAudioTower(cfg), "audio_encoder_proj": HiggsAudioFeatureProjector(cfg)}),
        _safetensors())
    return Served(lambda: _bare(HiggsAudioModel, config=cfg, local_dir=str(folder), model_path_hf=str(folder)),
                  "audio_encoder", "encode_audio",
                  lambda s: {"audio_features": [_randn(s, 2, 16, 40)], "audio_feature_lens": [torch.tensor([40, 24])]},
                  lambda node: node.audio_tower,
                  lambda node: torch.nn.ModuleDict({"audio_tower": node.audio_tower,
                                                    "audio_encoder_proj": node.projector}), ref)


PI05_VIT = dict(vit_hidden_size=32, vit_intermediate_size=64, vit_num_layers=2, vit_num_heads=2, vit_image_size=32,
                vit_patch_size=8)
_PALIGEMMA = "paligemma_with_expert.paligemma.model."


def _lerobot_siglip_name(name: str) -> str:
    """A ``Pi05SiglipEncoder`` parameter's name in lerobot/pi05_base (``Pi05Model._extract_siglip_state_dict``
    inverted; the tower under ``vision_tower.vision_model.``, the connector as ``multi_modal_projector.linear``)."""
    if name.startswith("connector."):
        return _PALIGEMMA + "multi_modal_projector.linear." + name.removeprefix("connector.")
    rest = name.removeprefix("vision_model.").removeprefix("vision_model.")
    return _PALIGEMMA + "vision_tower.vision_model." + rest


def _siglip_nests_its_transformer() -> bool:
    """transformers 4's ``SiglipVisionModel`` holds its transformer as ``.vision_model`` (the nesting M* 0.2.1's
    Pi0.5 loader renames into); transformers 5's is flat."""
    from transformers import SiglipVisionConfig, SiglipVisionModel
    return hasattr(SiglipVisionModel(SiglipVisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                                        num_attention_heads=1, image_size=8, patch_size=8)),
                   "vision_model")


def pi05(root: Path) -> Served:
    """Pi0.5's SigLIP node. M* 0.2.1's ``_extract_siglip_state_dict`` names the tower ``vision_model.vision_model.*``
    (transformers 4's nesting); under a transformers whose ``SiglipVisionModel`` is flat, ``load_hf_weights`` skips
    those keys without a word and the tower keeps ``to_empty``'s uninitialized memory (only the connector loads). The
    instance's extractor gets the names this transformers uses; the rest of ``_init_vit_components`` (meta build,
    ``to_empty``, the ``position_ids`` reset, ``load_hf_weights``) is M*'s."""
    from mstar.model.pi05.components.siglip import Pi05SiglipEncoder
    from mstar.model.pi05.pi05_model import Pi05Model

    from workloads.peers.mstar_pi05 import pi05_model, tiny_config
    cfg = dataclasses.replace(tiny_config(), **PI05_VIT)
    folder, ref = _written(root, "pi05-vit", json.dumps(PI05_VIT, sort_keys=True), lambda: Pi05SiglipEncoder(cfg),
                           _safetensors(rename=_lerobot_siglip_name))
    nested = _siglip_nests_its_transformer()

    def extract(flat):
        out = Pi05Model._extract_siglip_state_dict(flat)
        return out if nested else {k.replace("vision_model.vision_model.", "vision_model.", 1): v
                                   for k, v in out.items()}

    def model():
        m = pi05_model(folder)
        m.config, m._extract_siglip_state_dict = cfg, extract
        return m

    return Served(model, "vit_encoder", "prefill", lambda s: {"image_inputs": [_randn(s, 2, 3, 32, 32).clamp(-1, 1)]},
                  lambda node: node.encoder, lambda node: node.encoder, ref)


def vjepa2(root: Path) -> Served:
    from mstar.model.vjepa2.components.vit_encoder import VJEPA2Encoder
    from mstar.model.vjepa2.config import VJepa2Config
    from mstar.model.vjepa2.vjepa2_model import VJepa2Model
    sizes = dict(patch_size=8, crop_size=16, frames_per_clip=4, tubelet_size=2, hidden_size=32,
                 num_attention_heads=2, num_hidden_layers=2)
    cfg = VJepa2Config(**sizes)
    # the HF V-JEPA 2 layout: the encoder under encoder.* (weight_loader.py, load_vjepa2_hf_weights)
    folder, ref = _written(root, "vjepa2-encoder", json.dumps(sizes, sort_keys=True), lambda: VJEPA2Encoder(cfg),
                           _safetensors(prefix="encoder."))
    return Served(lambda: _bare(VJepa2Model, model_path_hf=str(folder), skip_weight_loading=False, config=cfg,
                                _repo_dir=folder, _ac_pt_path=None, encoder=None, predictor=None),
                  "video_encoder", "encode", lambda s: {"video_frames": [_randn(s, 4, 3, 16, 16)]},
                  lambda node: node.encoder, lambda node: node.encoder, ref)


WAN_VAE = dict(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1, temperal_downsample=[False],
               latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])


def _wan_vae(root: Path):
    """A folder holding a tiny ``AutoencoderKLWan`` under ``vae/`` (where Wan 2.2 and Cosmos3 read it), and it."""
    from diffusers import AutoencoderKLWan
    return _written(root, "wan-vae", json.dumps(WAN_VAE, sort_keys=True), lambda: AutoencoderKLWan(**WAN_VAE),
                    lambda f, m: m.save_pretrained(f / "vae"))


def wan22_vae(root: Path) -> Served:
    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.wan22_model import Wan22Model
    folder, ref = _wan_vae(root)

    def model():
        m = Wan22Model(str(folder))  # its constructor reads nothing from the folder
        m.config = Wan22Config(vae_z_dim=WAN_VAE["z_dim"])
        return m

    return Served(model, "vae_encoder", "encode_image", lambda s: {"image_inputs": [_randn(s, 3, 16, 16).sigmoid()]},
                  lambda node: node.vae.encoder, lambda node: node.vae, ref)


def cosmos3_vae(root: Path) -> Served:
    from mstar.model.cosmos3.config import Cosmos3Config, Cosmos3VAEConfig
    from mstar.model.cosmos3.cosmos3_model import Cosmos3Model
    folder, ref = _wan_vae(root)
    config = Cosmos3Config(vae=Cosmos3VAEConfig(scale_factor_spatial=2, scale_factor_temporal=1),
                           latent_channel=WAN_VAE["z_dim"])
    return Served(lambda: _bare(Cosmos3Model, model_path_hf=str(folder), skip_weight_loading=False, config=config,
                                _repo_dir=None, _vae=None, _yaml_config_overrides={}),
                  "vae_encoder", "vae_encode", lambda s: {"image_inputs": [_randn(s, 3, 16, 16).sigmoid()]},
                  lambda node: node.vae.encoder, lambda node: node.vae, ref,
                  {"height": 16, "width": 16, "num_frames": 1})


BAGEL_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, patch_size=14,
                 image_size=980)


def bagel_vit(root: Path) -> Served:
    """BAGEL's SigLIP2 ViT node through its SDPA fallback (flash-attn absent). Forwards are counted on the connector,
    which runs once a forward (the tower runs through its ``encode``, not ``forward``)."""
    from mstar.model.bagel.bagel_model import _BagelViTEMA
    from mstar.model.bagel.components.modeling_utils import BagelMLPconnector, PositionEmbedding
    from mstar.model.bagel.components.vit_encoder import BagelVisionModel
    from mstar.model.bagel.config import BagelAutoEncoderConfig, BagelModelConfig, BagelViTConfig

    from workloads.peers.mstar_bagel import LLM_CFG, bagel_model
    vit = BagelViTConfig(**BAGEL_VIT)
    cfg = BagelModelConfig(vae_config=BagelAutoEncoderConfig(), vit_config=vit, **LLM_CFG)

    def build():
        tower = BagelVisionModel(vit)
        tower.vision_model.embeddings.convert_conv2d_to_linear(vit)  # as BagelModel loads it
        return _BagelViTEMA(tower, BagelMLPconnector(vit.hidden_size, cfg.hidden_size, cfg.connector_act),
                            PositionEmbedding(cfg.vit_max_num_patch_per_side, cfg.hidden_size))

    folder, ref = _written(root, "bagel-vit", json.dumps(BAGEL_VIT, sort_keys=True), build,
                           _safetensors("ema.safetensors"))

    def model():
        m = bagel_model(folder)
        m.config = cfg
        return m

    return Served(model, "vit_encoder", "prefill_vit",
                  lambda s: {"image_inputs": [_randn(s, 3, 24, 32).sigmoid()]}, lambda node: node.connector,
                  lambda node: _BagelViTEMA(node.vit_model, node.connector, node.vit_pos_embed), ref)


WAN_TEXT = dict(vocab_size=32768, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                relative_attention_num_buckets=8)


def wan22_text(root: Path) -> Path:
    """A Wan 2.2 folder with a tiny random UMT5 under ``text_encoder/`` and a real 32k-piece T5-style tokenizer under
    ``tokenizer/`` (``workloads.fixtures.t5_style_tokenizer``), where ``Wan22Model`` reads them."""
    from transformers import UMT5Config, UMT5EncoderModel
    cfg = UMT5Config(**WAN_TEXT)

    def write(folder: Path, module) -> None:
        module.save_pretrained(folder / "text_encoder")
        fixtures.t5_style_tokenizer(folder / "tokenizer")

    return _written(root, "wan22-text", cfg.to_json_string(), lambda: UMT5EncoderModel(cfg), write)[0]


def wan22_model(folder: Path, text_max_seq_len: int = 48):
    """M*'s ``Wan22Model`` over ``folder`` (its own constructor: it reads nothing until a node or the tokenizer is
    asked for), sized to the tiny UMT5."""
    from mstar.model.wan22.config import Wan22Config
    from mstar.model.wan22.wan22_model import Wan22Model
    model = Wan22Model(str(folder))
    model.config = Wan22Config(text_max_seq_len=text_max_seq_len, text_dim=WAN_TEXT["d_model"])
    return model


Q3O_AUDIO = dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32, output_dim=32,
                 downsample_hidden_size=16)


def qwen3_omni_encoders(root: Path) -> tuple[Path, torch.nn.ModuleDict]:
    """A Qwen3-Omni folder as M*'s encoder loaders read it: ``config.json`` (a ``Qwen3OmniMoeConfig`` whose thinker
    holds the tiny audio and vision configs; the vision tower is the tiny thinker's, ``workloads.peers.
    mstar_qwen3_omni.VISION_SIZES``) and ``model.safetensors`` with ``thinker.audio_tower.*`` and
    ``thinker.visual.*``; and the towers it was written from (``audio_tower``, ``visual``)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeVisionEncoder,
    )

    from workloads.peers.mstar_qwen3_omni import VISION_SIZES
    cfg = Qwen3OmniMoeConfig(thinker_config={"audio_config": Q3O_AUDIO, "vision_config": VISION_SIZES})
    thinker = cfg.thinker_config

    def build():
        return torch.nn.ModuleDict({
            "audio_tower": Qwen3OmniMoeAudioEncoder._from_config(thinker.audio_config, attn_implementation="sdpa"),
            "visual": Qwen3OmniMoeVisionEncoder._from_config(thinker.vision_config, attn_implementation="sdpa")})

    def write(folder: Path, module) -> None:
        cfg.save_pretrained(folder)
        _safetensors(prefix="thinker.")(folder, module)

    return _written(root, "qwen3-omni-encoders", cfg.to_json_string(), build, write)


def sdpa_encoder_towers(monkeypatch) -> None:
    """M*'s Qwen3-Omni loaders build the encoder towers with ``attn_implementation="flash_attention_2"``
    (qwen3_omni_model.py:1576-1578, 1621-1623), which transformers refuses without the flash-attn package (no CPU
    build); on the CPU they get transformers' sdpa attention instead, the rest of ``_create_{audio,vision}_encoder_
    submodule`` as M* has it. Undone with ``monkeypatch``."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoder,
        Qwen3OmniMoeVisionEncoder,
    )
    for cls in (Qwen3OmniMoeAudioEncoder, Qwen3OmniMoeVisionEncoder):
        real = cls._from_config.__func__
        monkeypatch.setattr(cls, "_from_config", classmethod(
            lambda c, config, real=real, **kw: real(c, config, **{**kw, "attn_implementation": "sdpa"})))


SERVED = {"whisper": whisper, "higgs_audio": higgs_audio, "pi05": pi05, "vjepa2": vjepa2, "wan22_vae": wan22_vae,
          "cosmos3_vae": cosmos3_vae, "bagel_vit": bagel_vit}
