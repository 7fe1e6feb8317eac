"""Cached vision towers (CLIP, SigLIP, LLaVA tower + projector) and the Wan umT5 prompt encoder, on tiny random
models saved with save_pretrained and loaded back with from_pretrained: cached outputs equal uncached ones bit for
bit, hits skip decode and forward (counted with forward hooks and a decode spy), distinct inputs never share an
entry, bad media and wrong-shaped outputs leave the store as it was."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

import digests
from conftest import save_tiny
from encoders.text import CachedPromptEncoder
from encoders.vision import CachedVisionEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidMedia
from mmcache.module_fingerprint import module_fingerprint

PX = 32  # image side of the tiny towers: 4 x 4 patches of 8 px
L = 16  # max_sequence_length of the tiny Wan pipeline
NEGATIVE = "Bright tones, overexposed, static, blurred details, subtitles, worst quality, low quality"


def png(seed: int, size=(48, 40)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def store(**kwargs) -> EncoderStore:
    return EncoderStore(1 << 20, 1024, **kwargs)


def tiny_clip_config():
    from transformers import CLIPVisionConfig
    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            patch_size=8, image_size=PX)


@pytest.fixture
def count_forwards():
    """``count_forwards(*modules)`` -> a one-element list counting their forward calls until the test ends."""
    handles = []

    def count(*modules) -> list:
        calls = [0]
        handles.extend(m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for m in modules)
        return calls

    yield count
    for handle in handles:
        handle.remove()


# -- models: built from configs with random weights, saved, loaded back ---------------------------------------------


@pytest.fixture(scope="session")
def towers(tmp_path_factory):
    """name -> (model, image processor, modules whose forwards a hit must skip)."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionModel,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipImageProcessorPil,
        SiglipVisionConfig,
        SiglipVisionModel,
    )
    clip_proc = CLIPImageProcessorPil(size={"shortest_edge": PX}, crop_size={"height": PX, "width": PX})
    built = {
        "clip": (lambda: CLIPVisionModel(tiny_clip_config()), clip_proc),
        "siglip": (lambda: SiglipVisionModel(SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                                                num_hidden_layers=2, num_attention_heads=4,
                                                                patch_size=8, image_size=PX)),
                   SiglipImageProcessorPil(size={"height": PX, "width": PX})),
        "llava": (lambda: LlavaForConditionalGeneration(LlavaConfig(
            vision_config=tiny_clip_config(), image_token_id=99,
            text_config=LlamaConfig(vocab_size=100, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))), clip_proc),
    }
    classes = {"clip": CLIPVisionModel, "siglip": SiglipVisionModel, "llava": LlavaForConditionalGeneration}
    loaded = {}
    for name, (build, proc) in built.items():
        folder = save_tiny(tmp_path_factory, name, build, proc)
        model = classes[name].from_pretrained(folder).eval()
        hooked = (model.model.vision_tower, model.model.multi_modal_projector) if name == "llava" else (model,)
        loaded[name] = model, type(proc).from_pretrained(folder), hooked
    return loaded


@pytest.fixture(scope="session")
def wan(tmp_path_factory):
    """The tiny WanPipeline the image-gen workload builds (umT5 encoder, a real 32k vocabulary in T5 form, tiny
    transformer and VAE), saved and loaded back through from_pretrained."""
    from diffusers import WanPipeline

    from workloads import fixtures

    return WanPipeline.from_pretrained(fixtures.tiny_wan(tmp_path_factory.mktemp("models")))


def reference(model, processor, image: Image.Image) -> torch.Tensor:
    """What a user computes without mmcache: the processor and the model's own API on one image."""
    pixels = processor(images=image, return_tensors="pt").pixel_values
    with torch.inference_mode():
        if hasattr(model, "get_image_features"):
            return model.get_image_features(pixel_values=pixels).pooler_output[0]
        return model(pixel_values=pixels).last_hidden_state[0]


# -- vision --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["clip", "siglip", "llava"])
def test_vision_hit_equals_miss_equals_uncached_and_skips_decode_and_forward(towers, name, count_forwards, monkeypatch,
                                                                            tmp_path):
    model, proc, hooked = towers[name]
    calls, decodes, real_open = count_forwards(*hooked), [0], digests.open_image

    def open_image(data):  # the real decoder, counted
        decodes[0] += 1
        return real_open(data)

    monkeypatch.setattr(digests, "open_image", open_image)
    data = png(1)
    want = reference(model, proc, Image.open(io.BytesIO(data)))
    enc = CachedVisionEncoder(model, proc, s := store())
    assert torch.equal(CachedVisionEncoder(model, proc, None)(data), want)  # the uncached baseline
    before = calls[0], decodes[0]
    miss = enc(data)
    assert (calls[0] - before[0], decodes[0] - before[1]) == (len(hooked), 1)
    (path := tmp_path / "a.png").write_bytes(data)
    hits = [enc(data), enc(path), enc(bytearray(data))]  # a file, its path and its bytes share one entry
    assert (calls[0] - before[0], decodes[0] - before[1]) == (len(hooked), 1), "a hit decoded or ran the model"
    assert all(torch.equal(x, want) for x in [miss, *hits])
    image = s.stats().to_dict()["by_modality"]["image"]
    assert (image["hits"], image["misses"]) == (3, 1)
    hits[0].add_(1)  # a caller's tensor never aliases the store
    assert torch.equal(enc(data), want)
    pil = Image.open(io.BytesIO(data)).convert("RGB")  # decoded input: its own entry, the same features
    assert torch.equal(enc(pil), want) and len(s) == 2
    first, other, again = enc.features_for([data, png(2), data])
    assert torch.equal(first, want) and torch.equal(again, want) and not torch.equal(other, want)


def test_llava_cached_features_replace_pixel_values_exactly(towers):
    from transformers.modeling_outputs import BaseModelOutputWithPooling
    model, proc, _ = towers["llava"]
    data = png(3)
    enc = CachedVisionEncoder(model, proc, store())
    enc(data)
    features = enc(data)  # a hit
    ids = torch.tensor([[1, 5, *[model.config.image_token_id] * features.shape[0], 7, 8]])
    pixels = proc(images=Image.open(io.BytesIO(data)), return_tensors="pt").pixel_values
    with torch.inference_mode():
        want = model(input_ids=ids, pixel_values=pixels).logits
        got = model(input_ids=ids, mm_encoder_outputs={"image": BaseModelOutputWithPooling(pooler_output=[features])}
                    ).logits
    assert torch.equal(got, want)


def test_real_images_never_share_an_output(towers, data_dir):
    """sglang-omni #258/#260: two different images through one processor must never meet in the cache."""
    paths = sorted((data_dir / "mmmu" / "images").glob("*.png"))
    if len(paths) < 2:
        pytest.skip(f"need two MMMU images in {data_dir / 'mmmu' / 'images'}")
    a, b = paths[0], paths[-1]
    shared = store()
    for name in ("clip", "siglip"):  # two encoders on one store: their fingerprints keep them apart too
        model, proc, _ = towers[name]
        enc = CachedVisionEncoder(model, proc, shared)
        want = {p: reference(model, proc, Image.open(p)) for p in (a, b)}
        assert not torch.equal(want[a], want[b])
        assert enc.key(a) != enc.key(b)
        for p in (a, b, a, b, b, a):
            assert torch.equal(enc(p), want[p])
    assert len(shared) == 4 and shared.stats().totals.hits == 8

    model, proc, _ = towers["clip"]  # one image, two processor settings: two entries, each exact
    other = type(proc)(**{**proc.to_dict(), "resample": Image.Resampling.BILINEAR})
    for p in (proc, other, proc, other):
        assert torch.equal(CachedVisionEncoder(model, p, shared)(a), reference(model, p, Image.open(a)))
    assert len(shared) == 5


def test_corrupt_or_missing_image_raises_invalid_media_and_stores_nothing(towers, count_forwards, tmp_path):
    model, proc, hooked = towers["clip"]
    calls = count_forwards(*hooked)
    s, good = store(), png(4)
    enc = CachedVisionEncoder(model, proc, s)
    want = enc(good)
    before = len(s), s.stats().totals.bytes_stored, calls[0]
    bad = [good[: len(good) // 2], good[:60], b"\x89PNG\r\n\x1a\n" + bytes(100), b"not an image", tmp_path / "nope.png"]
    for data in bad:
        with pytest.raises(InvalidMedia):
            enc(data)
    with pytest.raises(InvalidMedia):
        enc(1234)
    assert (len(s), s.stats().totals.bytes_stored, calls[0]) == before
    assert torch.equal(enc(good), want) and calls[0] == before[2]


def test_wrong_shaped_output_is_refused_and_stored_entries_stay(towers):
    model, proc, _ = towers["clip"]
    data = png(5)
    s = store()
    enc = CachedVisionEncoder(model, proc, s)
    want = enc(data)
    key = enc.key(data)
    for wrong in (want[:-1], want.to(torch.float64), (want, want)):  # same key and ids, another shape or type
        with pytest.raises(EncoderOutputError):
            s.put(key, wrong)
    assert len(s) == 1 and torch.equal(enc(data), want)

    checked = store(expect=((PX * PX // 64 + 1, 32), torch.float32))  # the tower's [patches + CLS, hidden]
    enc = CachedVisionEncoder(model, proc, checked)
    assert torch.equal(enc(data), want)
    with pytest.raises(EncoderOutputError):
        checked.put(enc.key(png(6)), torch.zeros(3, 32))
    assert len(checked) == 1 and enc.key(png(6)) not in checked and torch.equal(enc(data), want)


def test_fingerprint_names_the_weights_not_the_object(tmp_path):
    from transformers import CLIPVisionModel

    from workloads import fixtures

    with fixtures.seeded(1):
        a = CLIPVisionModel(tiny_clip_config())
    a.save_pretrained(tmp_path)
    again, fingerprint = CLIPVisionModel.from_pretrained(tmp_path), module_fingerprint(a)
    assert module_fingerprint(again) == fingerprint
    with torch.no_grad():
        list(again.parameters())[-1][0] += 1e-3  # one weight, anywhere in the model
    assert module_fingerprint(again) != fingerprint
    assert module_fingerprint(a.to(torch.bfloat16)) != fingerprint


# -- Wan umT5 prompt encoder -----------------------------------------------------------------------------------------


def pipeline_encode(pipe, prompt, negative, **kwargs):
    """The pipeline's own encode, under no_grad as ``WanPipeline.__call__`` runs it (with grad enabled, sdpa on the
    CPU takes another kernel and differs in the last bits)."""
    with torch.no_grad():
        return pipe.encode_prompt(prompt, negative, **{"max_sequence_length": L, **kwargs})


def test_prompt_encoder_equals_the_pipelines_encode_and_hits_skip_the_encoder(wan, count_forwards):
    pipe = wan
    calls = count_forwards(pipe.text_encoder)
    enc = CachedPromptEncoder.from_pipeline(pipe, s := store(), max_sequence_length=L)
    prompt = "a cat walking on grass,   cinematic lighting"
    want = pipeline_encode(pipe, prompt, NEGATIVE)
    before = calls[0]
    for _ in range(3):
        got = enc.encode_prompt(prompt, NEGATIVE)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and got[0].shape == (1, L, 32)
    assert calls[0] - before == 2, "only the first request runs the encoder"
    assert torch.equal(enc.encode(" a cat walking on grass, cinematic lighting "), want[0])  # cleans alike: a hit
    assert calls[0] - before == 2 and s.stats().totals.hits == 5

    uncached = CachedPromptEncoder.from_pipeline(pipe, None, max_sequence_length=L)
    two = pipeline_encode(pipe, prompt, NEGATIVE, num_videos_per_prompt=2)
    for e in (enc, uncached):
        assert all(torch.equal(g, w) for g, w in zip(e.encode_prompt(prompt, NEGATIVE, num_videos_per_prompt=2), two))
        assert e.encode_prompt(prompt, do_classifier_free_guidance=False)[1] is None
        assert torch.equal(e.encode_prompt(prompt)[1], pipeline_encode(pipe, prompt, None)[1])  # default negative ""
    batch = ["a cat", "a robot made from code"]  # one forward per prompt, in both runs
    assert all(torch.equal(g, w) for g, w in zip(enc.encode_prompt(batch, NEGATIVE),
                                                 uncached.encode_prompt(batch, NEGATIVE)))


def test_pipeline_output_is_unchanged_by_cached_embeddings(wan):
    pipe = wan
    enc = CachedPromptEncoder.from_pipeline(pipe, store(), max_sequence_length=L)
    args = dict(height=16, width=16, num_frames=9, num_inference_steps=2, guidance_scale=6.0, max_sequence_length=L,
                output_type="pt")
    prompt = "a portrait of a female robot"
    want = pipe(prompt=prompt, negative_prompt=NEGATIVE, generator=torch.Generator().manual_seed(0), **args).frames
    for _ in range(2):  # a miss, then a hit
        embeds, negative = enc.encode_prompt(prompt, NEGATIVE)
        got = pipe(prompt_embeds=embeds, negative_prompt_embeds=negative, generator=torch.Generator().manual_seed(0),
                   **args).frames
        assert torch.equal(got, want)


def test_negative_prompt_hits_from_the_second_request_on(wan, count_forwards):
    pipe = wan
    calls = count_forwards(pipe.text_encoder)
    s = store()
    enc = CachedPromptEncoder.from_pipeline(pipe, s, max_sequence_length=L)
    seen = []
    for prompt in ["a cat", "a robot", "a cat", "sunset over grass"]:
        before = calls[0]
        enc.encode_prompt(prompt, NEGATIVE)
        text = s.stats().to_dict()["by_modality"]["text"]
        seen.append((calls[0] - before, text["hits"], text["misses"]))
    assert seen == [(2, 0, 2), (1, 1, 3), (0, 3, 3), (1, 4, 4)]
    assert len(s) == 4


def test_prompt_keys_follow_the_tokens_and_the_length(wan):
    pipe = wan
    s = store()
    enc = CachedPromptEncoder.from_pipeline(pipe, s, max_sequence_length=L)
    long = " ".join(["a cat walking on grass"] * 8)
    assert enc.key(long) == enc.key(long + " and more words past the cut")  # truncated to the same ids
    assert enc.key("a cat") != enc.key("a robot") and enc.key("a cat").verify_ids != enc.key("a robot").verify_ids
    other = CachedPromptEncoder.from_pipeline(pipe, s, max_sequence_length=2 * L)  # another padded forward
    assert other.key("a cat") != enc.key("a cat")
    assert torch.equal(other.encode("a cat"), pipeline_encode(pipe, "a cat", None, max_sequence_length=2 * L)[0])
    assert torch.equal(enc.encode("a cat"), pipeline_encode(pipe, "a cat", None)[0]) and len(s) == 2
