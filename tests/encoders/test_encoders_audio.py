"""Cached Whisper encoder and speaker embedding on real (tiny, random-weight) models loaded from saved folders:
bit-exact reuse, skipped work on hits, separation of inputs, refusal of bad input and bad output."""

import io
import wave
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperModel
from transformers.modeling_outputs import BaseModelOutput

from conftest import save_tiny
from encoders.audio import CachedAudioEncoder
from encoders.speaker import CachedSpeakerEncoder, SpeakerEncoder
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidMedia
from mmcache.module_fingerprint import module_fingerprint
from workloads import fixtures

KINDS = ("audio", "speaker")
D_MODEL, POSITIONS, SPK_DIM = 32, 400, 24  # Whisper: 8 s chunks -> 800 mel frames -> 400 positions


def wav(seed: int, seconds=1.0, rate=16000, channels=1, width=2) -> bytes:
    """A PCM WAV written with the stdlib: a seeded tone plus noise, ``width`` bytes per sample."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = 0.4 * np.sin(2 * np.pi * (100 + 37 * seed) * t)[:, None] + 0.05 * rng.standard_normal((t.size, channels))
    full = 2 ** (8 * width - 1) - 1
    q = np.clip(np.round(x * full), -full, full).astype(np.int64)
    if width == 1:
        raw = (q + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = q.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = q.astype(f"<i{width}").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels), w.setsampwidth(width), w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.fixture(scope="session")
def whisper_dir(tmp_path_factory):
    config = WhisperConfig(d_model=D_MODEL, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                           decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=64, num_mel_bins=80,
                           max_source_positions=POSITIONS, max_target_positions=16, vocab_size=64, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=3, begin_suppress_tokens=None)
    return save_tiny(tmp_path_factory, "whisper", lambda: WhisperModel(config),
                     WhisperFeatureExtractor(feature_size=80, chunk_length=8))


@pytest.fixture(scope="session")
def whisper(whisper_dir):
    return WhisperModel.from_pretrained(whisper_dir).eval(), WhisperFeatureExtractor.from_pretrained(whisper_dir)


@pytest.fixture(scope="session")
def speaker_dir(tmp_path_factory):
    return fixtures.tiny_speaker_encoder(tmp_path_factory.mktemp("speaker"), channels=(48, 48, 48, 48, 96),
                                         embedding_dim=SPK_DIM)[1]


@pytest.fixture(scope="session")
def speaker_model(speaker_dir):
    return SpeakerEncoder.from_pretrained(speaker_dir)


@pytest.fixture
def make(whisper, speaker_model):
    """make(kind, store, **kw): a wrapper of the session's model of that kind."""
    def build(kind, store, **kw):
        return CachedAudioEncoder(*whisper, store, **kw) if kind == "audio" else \
            CachedSpeakerEncoder(speaker_model, store, **kw)
    return build


def new_store():
    return EncoderStore(16 << 20, 4096)


@pytest.fixture
def counted():
    """counted(enc): counts of ``enc``'s decode, features and encoder forward calls; the real stages still run. The
    forward hooks go at teardown (the models are shared by the session)."""
    handles = []

    def count(enc) -> Counter:
        calls = Counter()
        for stage in ("decode", "features"):
            def wrapped(*args, _run=getattr(enc, stage), _stage=stage):
                calls[_stage] += 1
                return _run(*args)
            setattr(enc, stage, wrapped)
        handles.append(enc.module.register_forward_hook(lambda *_: calls.update(["forward"])))
        return calls
    yield count
    for h in handles:
        h.remove()


def stored_state(store):
    """Entries, bytes, free pages and owners: equal before and after means nothing was stored, dropped or leaked."""
    return len(store), store.stats().totals.bytes_stored, store.pool.num_free, int(store.pool.counts.sum())


# -- bit-exact reuse -------------------------------------------------------------------------------------------------

INPUTS = {
    "16k mono 16-bit": dict(seed=1),
    "24k mono 16-bit": dict(seed=2, rate=24000),
    "44.1k stereo 24-bit": dict(seed=3, rate=44100, channels=2, width=3),
    "8k mono 8-bit": dict(seed=4, rate=8000, width=1),
    "22.05k 3ch 32-bit": dict(seed=5, rate=22050, channels=3, width=4),
    "longer than a Whisper chunk": dict(seed=6, seconds=9.5),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("spec", INPUTS.values(), ids=INPUTS)
def test_cached_equals_uncached_bit_for_bit(make, kind, spec, tmp_path):
    data = wav(**spec)
    path = tmp_path / "in.wav"
    path.write_bytes(data)
    off, on = make(kind, None), make(kind, new_store())
    expected = off(data)
    assert torch.equal(off(data), expected)  # the uncached pipeline is deterministic
    for given in (data, path, str(path)):  # a miss, then two hits: a file and its bytes share one entry
        assert torch.equal(got := on(given), expected) and got.dtype == expected.dtype
    assert on.store.stats().totals.misses == 1 and on.store.stats().totals.hits == 2


@pytest.mark.parametrize("kind", KINDS)
def test_waveform_input_is_cached_apart_from_its_file(make, kind):
    data = wav(7, rate=24000, channels=2)
    with wave.open(io.BytesIO(data)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").reshape(-1, 2).T / np.float32(32768)
    enc = make(kind, new_store())
    from_file, from_array = enc(data), enc((samples.astype(np.float32), 24000))
    assert torch.equal(from_file, from_array)  # the same samples computed twice, once per key
    assert torch.equal(enc((torch.from_numpy(samples.astype(np.float32)), 24000)), from_array)  # numpy = torch
    assert len(enc.store) == 2 and enc.store.stats().totals.hits == 1


def test_whisper_output_is_the_models_own_encoder_output(whisper):
    model, fe = whisper
    data = wav(8)
    with wave.open(io.BytesIO(data)) as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2") / np.float32(32768)
    with torch.inference_mode():
        ref = model.encoder(fe(samples, sampling_rate=16000, return_tensors="pt").input_features).last_hidden_state
    out = CachedAudioEncoder(model, fe, new_store())(data)
    assert out.shape == (1, POSITIONS, D_MODEL) and torch.equal(out, ref)


# -- a hit skips decode, features and encoder ------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_hit_skips_decode_features_and_encoder(make, counted, kind):
    enc = make(kind, new_store())
    calls = counted(enc)
    first = enc(wav(9, rate=24000))
    assert calls == {"decode": 1, "features": 1, "forward": 1}
    for _ in range(3):
        assert torch.equal(enc(wav(9, rate=24000)), first)
    assert calls == {"decode": 1, "features": 1, "forward": 1}
    enc((torch.zeros(16000), 16000))  # a waveform is not decoded, but featurised and encoded
    assert calls == {"decode": 1, "features": 2, "forward": 2}


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_requests_for_one_wav_compute_once(make, counted, kind):
    enc = make(kind, new_store())
    calls = counted(enc)
    data = wav(21, rate=24000)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: enc(data), range(8)))
    assert calls == {"decode": 1, "features": 1, "forward": 1}  # each other caller joined the flight or hit
    assert all(torch.equal(o, outs[0]) for o in outs) and len({o.data_ptr() for o in outs}) == 8


def test_seedtts_rows_replay_three_misses_three_hits(make, counted, data_dir):
    seed = data_dir / "seedtts"
    rows = [line.split("|") for line in (seed / "meta.lst").read_text().splitlines() if line.strip()]
    assert len(rows) == 6 and len({r[2] for r in rows}) == 3
    store = new_store()
    for kind in KINDS:
        uncached = {w: make(kind, None)(seed / w) for w in {r[2] for r in rows}}  # before counting: same module
        enc = make(kind, store)
        calls = counted(enc)
        for utt_id, prompt_text, prompt_wav, target_text in rows:
            assert torch.equal(enc(seed / prompt_wav), uncached[prompt_wav]), utt_id
        assert calls == {"decode": 3, "features": 3, "forward": 3}
        counters = store.stats().by_modality[kind]
        assert (counters.hits, counters.misses) == (3, 3)
    assert len(store) == 6


# -- separation ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_different_wavs_never_share_an_output(make, kind):
    variants = [wav(10), wav(11), wav(10, rate=22050), wav(10, channels=2), wav(10, width=3), wav(10, seconds=1.5)]
    one_sample = bytearray(variants[0])
    one_sample[-200] ^= 1  # one sample's low bit, well inside the last full frame
    variants.append(bytes(one_sample))
    enc, off = make(kind, new_store()), make(kind, None)
    outs = [enc(v) for v in variants]
    assert len(enc.store) == len(variants) and enc.store.stats().totals.hits == 0
    for v, out in zip(variants, outs):  # each cached answer is its own input's, on later hits too
        assert torch.equal(enc(v), off(v)) and torch.equal(out, off(v))
    for i in range(len(outs)):
        for j in range(i):
            assert not torch.equal(outs[i], outs[j]), (i, j)


@pytest.mark.parametrize("kind", KINDS)
def test_salt_and_weights_separate_entries(make, kind, whisper_dir, speaker_dir):
    store = new_store()
    a, b = make(kind, store), make(kind, store, salt=b"tenant-b")
    a(wav(12)), b(wav(12))
    assert store.stats().totals.misses == 2
    reloaded = (CachedAudioEncoder(WhisperModel.from_pretrained(whisper_dir), WhisperFeatureExtractor.from_pretrained(
        whisper_dir), store) if kind == "audio" else CachedSpeakerEncoder(SpeakerEncoder.from_pretrained(speaker_dir),
                                                                           store))
    assert reloaded.fingerprint == a.fingerprint  # same weights loaded again: same entries
    reloaded(wav(12))
    assert store.stats().totals.hits == 1
    with torch.no_grad():
        next(reloaded.module.parameters()).view(-1)[0] += 1
    assert module_fingerprint(reloaded.module) != a.fingerprint


# -- refusals: nothing stored, nothing disturbed ----------------------------------------------------------------------

def truncated(data: bytes) -> bytes:
    return data[:len(data) - 1001]


def seven_bits(data: bytes) -> bytes:
    """The header says 7 bits per sample with block_align 2: read as 8-bit, twice the frames of noise."""
    return data[:34] + (7).to_bytes(2, "little") + data[36:]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [truncated(wav(13)), b"RIFF\x00\x00\x00\x00WAVEjunk", b"", b"not a wav at all",
                                 "/nonexistent/ref.wav", (torch.zeros(0), 16000), (torch.zeros(2, 2, 100), 16000),
                                 (np.zeros(1600, np.int16), 16000), seven_bits(wav(13))],
                         ids=["truncated", "bad header", "empty", "garbage", "missing path", "empty waveform",
                              "3-d waveform", "int waveform", "7-bit header"])
def test_bad_input_raises_invalid_media_and_stores_nothing(make, kind, bad):
    enc = make(kind, new_store())
    good = enc(wav(14))
    before = stored_state(enc.store)
    with pytest.raises(InvalidMedia):
        enc(bad)
    assert stored_state(enc.store) == before
    assert torch.equal(enc(wav(14)), good)


def test_speaker_reference_shorter_than_receptive_field_is_invalid(make, speaker_model):
    enc = make("speaker", new_store())
    with pytest.raises(InvalidMedia, match="shorter"):
        enc(wav(15, seconds=0.1))
    assert len(enc.store) == 0
    enc(wav(15, seconds=(400 + (speaker_model.min_frames - 1) * 160) / 16000))  # the shortest accepted


def cut_output(kind):
    """A forward hook that drops the last element of the encoder's output: a mis-shaped encoder."""
    if kind == "audio":
        return lambda mod, args, out: BaseModelOutput(last_hidden_state=out.last_hidden_state[:, :-1])
    return lambda mod, args, out: out[:, :-1]


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_shaped_output_is_refused_and_nothing_stored_is_disturbed(make, kind):
    enc = make(kind, new_store())
    kept = enc(wav(16))
    before = stored_state(enc.store)
    handle = enc.module.register_forward_hook(cut_output(kind))
    try:
        with pytest.raises(EncoderOutputError):
            enc(wav(17))
        assert torch.equal(enc(wav(16)), kept)  # a hit does not run the encoder: still served
    finally:
        handle.remove()
    assert stored_state(enc.store) == before
    assert torch.equal(enc(wav(17)), make(kind, None)(wav(17)))  # the fixed encoder computes and stores


@pytest.mark.parametrize("kind", KINDS)
def test_store_expect_refuses_other_dtypes(make, kind):
    store = EncoderStore(1 << 20, 4096, expect=(lambda key: (None,) * (3 if key.modality == "audio" else 1),
                                                torch.float16))
    enc = make(kind, store)
    with pytest.raises(EncoderOutputError):
        enc(wav(18))
    assert stored_state(store) == (0, 0, store.pool.num_pages, 0)


def test_feature_extractor_settings_enter_the_key(whisper):
    model, fe = whisper
    store = new_store()
    padded = WhisperFeatureExtractor.from_dict({**fe.to_dict(), "padding_value": 0.5})
    a, b = CachedAudioEncoder(model, fe, store), CachedAudioEncoder(model, padded, store)
    assert a.fingerprint == b.fingerprint and a.key(wav(20)) != b.key(wav(20))
    assert not torch.equal(a(wav(20)), b(wav(20)))
    assert store.stats().totals.misses == 2
    assert torch.equal(b(wav(20)), CachedAudioEncoder(model, padded, None)(wav(20)))


def test_mismatched_feature_extractor_is_refused(whisper):
    with pytest.raises(ValueError, match="mel bins"):
        CachedAudioEncoder(whisper[0], WhisperFeatureExtractor(chunk_length=30), None)


# -- the speaker model's folder ----------------------------------------------------------------------------------------

def test_speaker_folder_round_trip_and_strict_layout(speaker_dir, speaker_model, tmp_path):
    fresh = SpeakerEncoder(speaker_model.config)
    assert speaker_model.config == fresh.config and speaker_model.config.channels == (48, 48, 48, 48, 96)
    for k, v in fresh.state_dict().items():
        assert v.shape == speaker_model.state_dict()[k].shape
    speaker_model.save_pretrained(tmp_path)
    again = SpeakerEncoder.from_pretrained(tmp_path)
    data = wav(19)
    assert torch.equal(CachedSpeakerEncoder(again, None)(data), CachedSpeakerEncoder(speaker_model, None)(data))
    from safetensors.torch import load_file, save_file
    weights = load_file(tmp_path / "model.safetensors")
    weights["segment.kernel"] = weights.pop("segment.weight")
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(RuntimeError, match="segment"):
        SpeakerEncoder.from_pretrained(tmp_path)
