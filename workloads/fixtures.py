"""Every tiny model and tokenizer the workloads, tests and benchmarks build, in one place, with one seeding rule and
one save-then-load path.

Hubs are unreachable, so a model workload without ``options.model`` runs a small model built from its config with
random weights. Each is built once: ``saved`` writes it into ``model_dir/<kind>-<hash of what defines it>`` (through a
temporary folder renamed into place, so a concurrent or interrupted first run never leaves half a model there) and
every run loads it back with ``from_pretrained``, like a real checkpoint.

Seeding rule: weights are drawn under ``seeded(SEED)``, which forks the torch RNG (CPU) and seeds the fork, so the
global RNG a caller uses is never touched and a given key always holds the same weights.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
import xxhash

SEED = 0                 # the weights of every tiny model (fixed, so their saved folders are reused)
IMAGE_PX, PATCH_PX = 64, 8  # tiny CLIP tower of the tiny LLaVA: 64 placeholders per image
TEXT_VOCAB = 32768       # the Mistral SentencePiece vocabulary the tiny text models are sized for


# ------------------------------------------------------------------------------------------------ seeding, saving
@contextlib.contextmanager
def seeded(seed: int = SEED) -> Iterator[None]:
    """Run the body on a forked, seeded torch RNG (CPU): deterministic draws, the caller's RNG state unchanged."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def saved(model_dir: str | Path, kind: str, key: str, save: Callable[[Path], None]) -> Path:
    """``model_dir/<kind>-<xxh64 of key>``, written by ``save(folder)`` under ``seeded()`` the first time and reused
    after (a folder that exists is complete: it appears by one rename)."""
    folder = Path(model_dir) / f"{kind}-{xxhash.xxh64_hexdigest(key.encode())}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        with seeded():
            save(tmp)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.is_dir():  # else another process got there first
            raise
    return folder


def load_model(cls, options, kind: str, config, *, build: Callable | None = None,
               extra: Callable[[Path], None] | None = None, model_types: Sequence[str] = ()):
    """``(model, folder)`` in eval mode, loaded with ``cls.from_pretrained``: ``options.model`` if given (its
    ``model_type`` one of ``model_types`` when they are named, else ``ValueError``), else the tiny
    ``build(config)`` (default ``cls.from_config``) saved by ``saved`` (``extra(folder)`` adds files next to the
    weights, e.g. an image processor)."""
    from transformers import AutoConfig

    def save(folder: Path) -> None:
        (build or cls.from_config)(config).save_pretrained(folder)
        if extra is not None:
            extra(folder)

    folder = options.model
    if folder is None:
        folder = saved(options.model_dir, kind, config.to_json_string(), save)
    elif model_types and (found := AutoConfig.from_pretrained(folder).model_type) not in model_types:
        raise ValueError(f"{folder} holds a {found!r} model; this workload runs {', '.join(model_types)} models")
    return cls.from_pretrained(folder).eval(), folder


# ------------------------------------------------------------------------------------------------------ tokenizers
class HFTokenizer:
    """A model folder's own transformers tokenizer behind the calls the loaders make on a SentencePiece processor.
    Apart from ``workloads.traces.tokenizer`` (which reads a trace's tokenizer file): a model needs its tokenizer
    exactly as ``AutoTokenizer`` loads it, with its special ids (``eos_id`` for CSM's segments)."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"]

    def bos_id(self) -> int:
        return next(t for t in (self.tok.bos_token_id, self.tok.eos_token_id, 0) if t is not None)

    def eos_id(self) -> int:
        return next(t for t in (self.tok.eos_token_id, 0) if t is not None)


def text_tokenizer(folder: Path | None):
    """The tokenizer of a user's model folder when it has one, else the SentencePiece model of ``mistral_common``
    (what the tiny models' vocabulary is sized for)."""
    from workloads.traces.tokenizer import load_tokenizer

    if folder is not None and any((Path(folder) / f).is_file() for f in
                                  ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        from transformers import AutoTokenizer
        return HFTokenizer(AutoTokenizer.from_pretrained(folder))
    return load_tokenizer()


def t5_style_tokenizer(folder: Path):
    """A real 32k-piece SentencePiece vocabulary (Mistral's, shipped in ``mistral_common``) as a fast tokenizer with
    T5's conventions (``</s>`` appended, a ``<pad>`` token), saved to ``folder`` and loaded back. Byte fallback keeps
    it lossless, so distinct prompts never share token ids and hit rates are those of the text. Merges are recovered
    from the vocabulary as transformers' SentencePieceExtractor does (which needs protobuf)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from workloads.traces.tokenizer import load_tokenizer

    spm = load_tokenizer()
    vocab = {spm.id_to_piece(i): i for i in range(spm.get_piece_size())}
    merges = sorted((vocab[p], vocab[p[:k]], vocab[p[k:]], p[:k], p[k:]) for p in vocab for k in range(1, len(p))
                    if p[:k] in vocab and p[k:] in vocab)
    bpe = Tokenizer(models.BPE({**vocab, "<pad>": len(vocab)}, [m[3:] for m in merges], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    bpe.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    bpe.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bpe.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="</s>", pad_token="<pad>"
                            ).save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# ------------------------------------------------------------------------------------------- tiny Llama and LLaVA
def tiny_llama_config(vocab_size: int = TEXT_VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1 << 17)


def tiny_llava_config(vocab_size: int = TEXT_VOCAB):
    """CLIP tower (hidden 32, 2 layers, 64 x 64 px in 8 px patches) + projector + tiny Llama; the image token is the
    last id, past the text vocabulary."""
    from transformers import CLIPVisionConfig, LlavaConfig

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              patch_size=PATCH_PX, image_size=IMAGE_PX)
    return LlavaConfig(vision_config=vision, text_config=tiny_llama_config(vocab_size + 1), image_token_id=vocab_size)


def tiny_clip_processor(px: int = IMAGE_PX):
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil(size={"shortest_edge": px}, crop_size={"height": px, "width": px})


def tiny_llava_next_video_config(vocab_size: int = TEXT_VOCAB):
    """LLaVA-NeXT-Video over the tiny LLaVA's CLIP tower and Llama: each 64 px frame's 8 x 8 patches pooled 2 x 2
    into 16 rows; the image and video tokens are the two ids past the text vocabulary."""
    from transformers import LlavaNextVideoConfig

    tower = tiny_llava_config(vocab_size).vision_config
    return LlavaNextVideoConfig(vision_config=tower, text_config=tiny_llama_config(vocab_size + 2),
                                image_token_id=vocab_size, video_token_id=vocab_size + 1,
                                image_grid_pinpoints=[[IMAGE_PX, IMAGE_PX]], spatial_pool_stride=2)


def tiny_video_processor(px: int = IMAGE_PX):
    from transformers import LlavaNextVideoVideoProcessor

    return LlavaNextVideoVideoProcessor(size={"shortest_edge": px}, crop_size={"height": px, "width": px})


def load_llama(options):
    """``(causal LM, folder)``: ``options.model``, else the tiny Llama."""
    from transformers import AutoModelForCausalLM

    return load_model(AutoModelForCausalLM, options, "tiny-llama", tiny_llama_config())


def load_llava(options):
    """``(LLaVA model, image processor, folder)``: ``options.model``, else the tiny LLaVA with its CLIP processor."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model, folder = load_model(AutoModelForImageTextToText, options, "tiny-llava", tiny_llava_config(),
                               extra=tiny_clip_processor().save_pretrained, model_types=("llava",))
    return model, AutoImageProcessor.from_pretrained(folder), folder


def load_llava_next_video(options):
    """``(LLaVA-NeXT-Video model, video processor, folder)``: ``options.model``, else the tiny one with its video
    processor."""
    from transformers import AutoVideoProcessor, LlavaNextVideoForConditionalGeneration

    model, folder = load_model(LlavaNextVideoForConditionalGeneration, options, "tiny-llava-next-video",
                               tiny_llava_next_video_config(), build=LlavaNextVideoForConditionalGeneration,
                               extra=tiny_video_processor().save_pretrained,
                               model_types=("llava_next_video",))
    return model, AutoVideoProcessor.from_pretrained(folder), folder


# ------------------------------------------------------------------------------------------------------- tiny CSM
def tiny_csm_config():
    """A CSM small enough for a CPU test: 8 codebooks of 64 codes, a 2-layer backbone over the 32,768-piece Mistral
    vocabulary, a 1-layer depth decoder and a narrow Mimi with the real frame rate (12.5 Hz at 24 kHz)."""
    from transformers import CsmConfig, MimiConfig
    from transformers.models.csm.configuration_csm import CsmDepthDecoderConfig

    k, codes, hidden = 8, 64, 64
    mimi = MimiConfig(hidden_size=32, num_filters=4, codebook_size=codes, codebook_dim=16, num_quantizers=k,
                      vector_quantization_hidden_dimension=16, upsample_groups=32, num_hidden_layers=1,
                      intermediate_size=64, num_attention_heads=2, num_key_value_heads=2)
    depth = CsmDepthDecoderConfig(num_codebooks=k, backbone_hidden_size=hidden, vocab_size=codes, hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=k + 1)
    # audio tokens: two control pieces of the Mistral vocabulary ([control_12], [control_13]) that text never yields
    return CsmConfig(num_codebooks=k, vocab_size=codes, text_vocab_size=TEXT_VOCAB, hidden_size=hidden,
                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     codebook_pad_token_id=codes - 1, codebook_eos_token_id=0, audio_token_id=14,
                     audio_eos_token_id=15, bos_token_id=1, pad_token_id=0, depth_decoder_config=depth.to_dict(),
                     codec_config=mimi.to_dict())


def _build_csm(config):
    """A random-weight CSM. Mimi initialises its codebooks to zeros (every frame would quantize to code 0), so they
    are drawn at random."""
    from transformers import CsmForConditionalGeneration
    from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

    model = CsmForConditionalGeneration(config)
    for book in model.codec_model.modules():
        if isinstance(book, MimiEuclideanCodebook):
            book.embed_sum.normal_()
    return model


def load_csm(options):
    """``(CSM model, tokenizer, folder)``: ``options.model`` with its own tokenizer (an ``HFTokenizer``), else the
    tiny CSM with the Mistral SentencePiece tokenizer."""
    from transformers import CsmForConditionalGeneration

    model, folder = load_model(CsmForConditionalGeneration, options, "tiny-csm", tiny_csm_config(), build=_build_csm)
    return model, text_tokenizer(options.model), folder


# ------------------------------------------------------------------------------------------------------- tiny Wan
_WAN = {"text_encoder": dict(d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8, relative_attention_num_buckets=8),
        "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2,
                            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "vae": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                    temperal_downsample=[False, True, True]),
        "scheduler": dict(shift=7.0)}


def _save_wan(folder: Path) -> None:
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_style_tokenizer(folder / "tokenizer")
    WanPipeline(tokenizer=tokenizer,
                text_encoder=UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **_WAN["text_encoder"])),
                transformer=WanTransformer3DModel(**_WAN["transformer"]), vae=AutoencoderKLWan(**_WAN["vae"]),
                scheduler=FlowMatchEulerDiscreteScheduler(**_WAN["scheduler"])).save_pretrained(folder)


def tiny_wan(model_dir: str | Path) -> Path:
    """The folder of a tiny ``WanPipeline`` with random weights: a 2-layer umT5 encoder (d_model 32) behind the
    tokenizer of ``t5_style_tokenizer``, a 2-layer ``WanTransformer3DModel``, a small ``AutoencoderKLWan`` and a
    flow-matching scheduler."""
    return saved(model_dir, "tiny-wan", json.dumps(_WAN, sort_keys=True), _save_wan)


def load_wan(options):
    """``options.model`` (a Wan 2.x text-to-video pipeline folder), else the tiny pipeline, on CUDA when available,
    progress bars off."""
    from diffusers import WanPipeline

    folder = options.model if options.model is not None else tiny_wan(options.model_dir)
    pipe = WanPipeline.from_pretrained(folder).to("cuda" if torch.cuda.is_available() else "cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _save_wan_ti2v(folder: Path) -> None:
    from diffusers import WanImageToVideoPipeline, WanPipeline

    t2v = WanPipeline.from_pretrained(tiny_wan(folder.parent))
    WanImageToVideoPipeline(**t2v.components, expand_timesteps=True).save_pretrained(folder)


def tiny_wan_ti2v(model_dir: str | Path) -> Path:
    """The folder of a tiny Wan 2.2 TI2V-style ``WanImageToVideoPipeline``: the weights of ``tiny_wan`` with
    ``expand_timesteps`` (the first latent frame is the image's VAE latents; no CLIP image encoder)."""
    return saved(model_dir, "tiny-wan-ti2v", json.dumps({**_WAN, "expand_timesteps": True}, sort_keys=True),
                 _save_wan_ti2v)


def load_wan_ti2v(options, dtype: torch.dtype = torch.float32):
    """``(text-to-video, image-to-video)`` pipelines over one set of weights, as Wan 2.2 TI2V serves both:
    ``WanImageToVideoPipeline.from_pretrained`` of ``options.model`` (a TI2V folder: ``expand_timesteps`` and no
    image encoder, else ``ValueError``) or of the tiny one, and a ``WanPipeline`` over its components; in ``dtype``,
    on CUDA when available, progress bars off."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    folder = options.model if options.model is not None else tiny_wan_ti2v(options.model_dir)
    i2v = WanImageToVideoPipeline.from_pretrained(folder, dtype=dtype)
    if not i2v.config.expand_timesteps or i2v.image_encoder is not None:
        raise ValueError(f"{folder} is not a Wan 2.2 TI2V pipeline (expand_timesteps, no image encoder)")
    i2v.to("cuda" if torch.cuda.is_available() else "cpu")
    t2v = WanPipeline(**{k: v for k, v in i2v.components.items() if k in
                         ("tokenizer", "text_encoder", "transformer", "vae", "scheduler")})
    for pipe in (t2v, i2v):
        pipe.set_progress_bar_config(disable=True)
    return t2v, i2v


# ------------------------------------------------------------------------------------------------ speaker encoder
def tiny_speaker_encoder(model_dir: str | Path, **config):
    """``(SpeakerEncoder, folder)``: an x-vector of ``SpeakerEncoderConfig(**config)`` with random weights and
    non-trivial BatchNorm statistics (so loading them is exercised), saved and loaded back."""
    import dataclasses

    from encoders.speaker import SpeakerEncoder, SpeakerEncoderConfig

    cfg = SpeakerEncoderConfig(**config)

    def save(folder: Path) -> None:
        model = SpeakerEncoder(cfg)
        with torch.no_grad():
            for layer in model.frames:
                layer.norm.running_mean.uniform_(-0.5, 0.5), layer.norm.running_var.uniform_(0.5, 2.0)
        model.save_pretrained(folder)

    folder = saved(model_dir, "tiny-speaker", json.dumps(dataclasses.asdict(cfg), sort_keys=True), save)
    return SpeakerEncoder.from_pretrained(folder), folder
