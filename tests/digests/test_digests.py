"""digests: stability, separation, streaming, decoding errors and bad input."""

import enum
import hashlib
import io
import os
import wave

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import digests
from mmcache.errors import InvalidMedia, MmcacheError
from workloads.registry import data_place

DATA = data_place()[0]
SIZE = {"size": {"shortest_edge": 224}}


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def wav_bytes(samples: np.ndarray, rate: int, width: int) -> bytes:
    """samples: [frames, channels] integers already in the sample width's range (unsigned for 8-bit)."""
    if width == 3:  # no int24 dtype: the low 3 bytes of each little-endian int32
        raw = samples.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = samples.astype(np.uint8 if width == 1 else f"<i{width}").tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(samples.shape[1]), w.setsampwidth(width), w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def mmmu_pngs():
    images = DATA / "mmmu" / "images"
    if not images.is_dir():
        pytest.skip(f"shared data not found at {images} (set MMCACHE_DATA to the data folder)")
    return sorted(images.glob("*.png"))[:2]


# --- equality and stability -----------------------------------------------------------------------------------------

def test_equal_inputs_give_equal_digests():
    assert digests.image(b"abc", SIZE) == digests.image(bytearray(b"abc"), dict(SIZE))
    assert digests.image(memoryview(b"abc"), SIZE) == digests.image(b"abc", SIZE)
    assert hash(digests.image(b"abc", SIZE)) == hash(digests.image(b"abc", SIZE))


@pytest.mark.parametrize("algorithm, pinned", [
    ("xxh3_128", "c2a0930ae0a5d6822c8343f162634933"),
    ("blake2b", "1e936f82d93a39b535235190a65d17cbfe4f24d7b29858dd1369fff7e8e3f81b"),
    ("sha256", "bcb68270b758b23ccad46ec7f8eb8cadf1cb51a1b07ff01e0b75740155b75934"),
])
def test_fixed_input_has_pinned_digest(algorithm, pinned):
    d = digests.image(b"mmcache", SIZE, algorithm=algorithm)
    assert d.hex() == pinned and d.algorithm == algorithm and bytes(d) == bytes.fromhex(pinned)
    assert int(d) == int(pinned, 16) and pinned in repr(d)


def test_wire_format_is_length_prefixed_header_then_bytes():
    header = b'{"modality":"image","v":1,"params":{"size":{"shortest_edge":224}}}'
    expected = hashlib.sha256(len(header).to_bytes(8, "little") + header + b"mmcache").digest()
    assert bytes(digests.image(b"mmcache", SIZE, algorithm="sha256")) == expected


def test_path_str_and_bytes_of_one_file_agree(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"\x89PNG not really")
    assert digests.image(f, SIZE) == digests.image(str(f), SIZE) == digests.image(f.read_bytes(), SIZE)


@pytest.mark.parametrize("other", [
    {"size": {"shortest_edge": 336}},
    {**SIZE, "resample": 2},
    {**SIZE, "do_normalize": False},
    None,
])
def test_changed_param_changes_digest(other):
    assert digests.image(b"img", SIZE) != digests.image(b"img", other)


def test_modalities_are_separate():
    ds = {f(b"same", SIZE) for f in (digests.image, digests.audio, digests.video)}
    assert len(ds) == 3
    assert digests.prompt(np.frombuffer(b"samesame", "<i8")) != digests.image(b"samesame")


def test_decoded_image_differs_from_file_and_is_stable():
    img = Image.new("RGB", (4, 3), (10, 20, 30))
    assert digests.image(img) != digests.image(png_bytes(img))
    assert digests.image(img) != digests.image(img.tobytes())  # the decoded marker, not just the bytes
    assert digests.image(img) == digests.image(Image.new("RGB", (4, 3), (10, 20, 30)))
    assert digests.image(img) != digests.image(img.convert("RGBA"))
    assert digests.image(img) != digests.image(Image.new("RGB", (3, 4), (10, 20, 30)))


def test_palette_is_part_of_a_decoded_digest():
    a = Image.new("P", (2, 2), 0)
    b = a.copy()
    a.putpalette([255, 0, 0] * 256)
    b.putpalette([0, 255, 0] * 256)
    assert a.tobytes() == b.tobytes() and digests.image(a) != digests.image(b)


def test_algorithms_differ_and_unknown_is_rejected():
    ds = [digests.image(b"x", algorithm=a) for a in digests.ALGORITHMS]
    assert len({bytes(d) for d in ds}) == 3 and len(set(ds)) == 3
    assert len(bytes(ds[0])) == 16  # 128-bit default
    with pytest.raises(ValueError, match="md5"):
        digests.image(b"x", algorithm="md5")


def test_digest_is_immutable_and_compares_algorithm():
    d = digests.image(b"x")
    with pytest.raises(AttributeError):
        d.value = b"0" * 16
    assert d != digests.Digest("sha256", d.value) and d == digests.Digest("xxh3_128", d.value)
    assert not hasattr(d, "__dict__")


@settings(max_examples=200, deadline=None)
@given(st.binary(), st.binary())
def test_distinct_bytes_give_distinct_digests(a, b):
    assert (digests.image(a) == digests.image(b)) == (a == b)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=10)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(), json_values, max_size=6))
def test_param_key_order_does_not_matter(params):
    assert digests.image(b"x", params) == digests.image(b"x", dict(reversed(params.items())))


def test_canonical_params():
    class Mode(enum.IntEnum):
        BICUBIC = 3

    plain = {"size": [224, 224], "mean": [0.5], "resample": 3, "dtype": "float32"}
    fancy = {"size": (np.int64(224), 224), "mean": np.array([0.5]), "resample": Mode.BICUBIC,
             "dtype": np.dtype("float32"), "_private": object()}
    assert digests.canonical(fancy) == digests.canonical(plain) == b'{"dtype":"float32","mean":[0.5],' \
                                                                   b'"resample":3,"size":[224,224]}'
    assert digests.image(b"x", digests.canonical(plain)) == digests.image(b"x", plain)
    with pytest.raises(InvalidMedia, match="not JSON-able"):
        digests.canonical({"f": object()})


# --- real images and processors -------------------------------------------------------------------------------------

def test_real_pngs_differ(mmmu_pngs):
    a, b = mmmu_pngs
    assert digests.image(a, SIZE) != digests.image(b, SIZE)
    assert digests.image(a, SIZE) == digests.image(a.read_bytes(), SIZE)


def test_processor_object_works_as_params():
    transformers = pytest.importorskip("transformers")
    proc = transformers.CLIPImageProcessor()
    d = digests.image(b"img", proc)
    assert d == digests.image(b"img", proc.to_dict()) == digests.image(b"img", digests.canonical(proc))
    assert d != digests.image(b"img", transformers.CLIPImageProcessor(size={"shortest_edge": 336}))
    assert d != digests.image(b"img", transformers.CLIPImageProcessor(resample=Image.Resampling.BILINEAR))


# --- audio, video, prompts ------------------------------------------------------------------------------------------

def test_waveform_digest_needs_rate_and_matches_across_libraries():
    torch = pytest.importorskip("torch")
    wav = np.linspace(-1, 1, 100, dtype=np.float32)[None]
    d = digests.audio((wav, 16000))
    assert d == digests.audio((torch.from_numpy(wav), 16000)) == digests.audio((wav.astype(">f4"), 16000))
    assert d != digests.audio((wav, 24000)) and d != digests.audio((wav.astype(np.float64), 16000))
    assert d != digests.audio((wav.reshape(-1, 1), 16000))
    assert digests.audio(wav, {"sampling_rate": 16000}) == digests.audio((wav, 16000), {"sampling_rate": 16000})
    assert digests.audio((torch.zeros(1, 4, dtype=torch.bfloat16), 16000)) != digests.audio((np.zeros((1, 4)), 16000))
    with pytest.raises(InvalidMedia, match="sample rate"):
        digests.audio(wav)


def test_video_includes_frame_sampling():
    assert digests.video(b"mp4", {"num_frames": 8}) != digests.video(b"mp4", {"num_frames": 16})
    assert digests.video(np.zeros((2, 4, 4, 3), np.uint8)) != digests.video(np.zeros((2, 4, 4, 3), np.uint8).tobytes())


def test_prompt_ids_canonical_across_containers():
    torch = pytest.importorskip("torch")
    d = digests.prompt([1, 2, 3], {"max_length": 8})
    assert d.hex() == "772ece5080831f934e2686677055dbfb"
    for ids in (np.array([1, 2, 3], np.int32), np.array([1, 2, 3], ">u2"), torch.tensor([1, 2, 3]), (1, 2, 3)):
        assert digests.prompt(ids, {"max_length": 8}) == d
    assert d != digests.prompt([1, 2, 3], {"max_length": 16}) and d != digests.prompt([3, 2, 1], {"max_length": 8})
    assert digests.prompt([]) == digests.prompt(np.array([], np.int64))


def test_prompt_with_tokenizer_params():
    class Tokenizer:  # the attributes digests reads from a transformers tokenizer
        name_or_path = "mistral-7b"
        vocab_size = 32768
        init_kwargs = {"bos_token": "<s>", "vocab_file": "/home/me/cache/tok.model", "is_local": True,
                       "added": object()}

        def __len__(self):
            return 32770

    tok = Tokenizer()
    d = digests.prompt([1, 2], tok)
    assert d == digests.prompt([1, 2], tok) == digests.prompt([1, 2], digests.canonical(tok))
    other = Tokenizer()
    other.init_kwargs = {**tok.init_kwargs, "vocab_file": "/elsewhere/tok.model"}  # machine-local paths ignored
    assert digests.prompt([1, 2], other) == d
    other.init_kwargs = {**tok.init_kwargs, "bos_token": "<bos>"}
    assert digests.prompt([1, 2], other) != d and digests.prompt([1, 2]) != d
    with_len = digests.prompt([1, 2], {"tokenizer": tok, "max_length": 8})
    assert with_len != digests.prompt([1, 2], {"tokenizer": tok, "max_length": 16}) and with_len != d


# --- streaming ------------------------------------------------------------------------------------------------------

def test_50mb_file_streams_to_the_bytes_digest(tmp_path):
    blob = np.random.default_rng(0).bytes(50 * 2**20 + 123)  # not a multiple of the chunk size
    f = tmp_path / "big.mp4"
    f.write_bytes(blob)
    for algorithm in ("xxh3_128", "sha256"):
        assert digests.video(f, {"fps": 2}, algorithm=algorithm) == digests.video(blob, {"fps": 2},
                                                                                  algorithm=algorithm)


# --- decoding -------------------------------------------------------------------------------------------------------

def test_open_image_round_trip_and_truncation():
    img = Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), np.uint8))
    data = png_bytes(img)
    assert digests.open_image(data).tobytes() == img.tobytes()
    with pytest.raises(InvalidMedia, match="cannot decode image"):
        digests.open_image(data[: len(data) // 2])
    assert digests.image(data[: len(data) // 2])  # digesting never decodes: a corrupt file still has a digest
    with pytest.raises(InvalidMedia):
        digests.open_image(b"not an image")


@pytest.mark.parametrize("width, scale", [(1, 128), (2, 2**15), (3, 2**23), (4, 2**31)])
def test_wav_round_trip(width, scale):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(width)
    ints = rng.integers(-scale, scale, (50, 2))
    wave_, rate = digests.load_wav(wav_bytes(ints + 128 if width == 1 else ints, 24000, width))
    assert rate == 24000 and wave_.dtype == torch.float32 and wave_.shape == (2, 50)
    np.testing.assert_allclose(wave_.numpy(), (ints / scale).T, rtol=1e-6)


def test_real_wav_loads():
    wavs = sorted((DATA / "seedtts" / "prompt-wavs").glob("*.wav"))
    if not wavs:
        pytest.skip(f"no WAVs under {DATA / 'seedtts'}")
    wave_, rate = digests.load_wav(wavs[0])
    assert rate == 24000 and wave_.shape[0] == 1 and wave_.abs().max() <= 1


def test_bad_wavs_raise_invalid_media(tmp_path):
    good = wav_bytes(np.zeros((100, 1), int), 16000, 2)
    for bad in (b"RIFF garbage that is not a wave file", good[:-50], os.urandom(200)):
        with pytest.raises(InvalidMedia):
            digests.load_wav(bad)
    with pytest.raises(InvalidMedia, match="missing.wav"):
        digests.load_wav(tmp_path / "missing.wav")


def _fmt(data: bytes, **fields) -> bytes:
    """``data`` (a WAV as the stdlib writes it: the fmt chunk at byte 20) with fmt fields replaced."""
    layout = {"tag": (20, 2), "channels": (22, 2), "rate": (24, 4), "byte_rate": (28, 4), "block_align": (32, 2),
              "bits": (34, 2)}
    out = bytearray(data)
    for name, value in fields.items():
        at, size = layout[name]
        out[at:at + size] = value.to_bytes(size, "little")
    return bytes(out)


@pytest.mark.parametrize("fields, problem", [
    ({"bits": 7}, "7 bits per sample"),                                  # block_align 2 still: 8-bit frames of noise
    ({"bits": 12}, "12 bits per sample"),
    ({"block_align": 4}, "block_align 4 for 1 channel"),                 # 16-bit mono with 4-byte frames
    ({"byte_rate": 12345}, "byte rate 12345"),
    ({"channels": 2}, "block_align 2 for 2 channel"),
])
def test_inconsistent_wav_headers_raise_invalid_media(tmp_path, fields, problem):
    good = wav_bytes(np.zeros((100, 1), int), 16000, 2)
    assert digests.load_wav(good)[0].shape == (1, 100)
    bad = _fmt(good, **fields)
    with pytest.raises(InvalidMedia, match=f"inconsistent WAV header: .*{problem}"):
        digests.load_wav(bad)
    (tmp_path / "bad.wav").write_bytes(bad)
    with pytest.raises(InvalidMedia, match="bad.wav"):
        digests.load_wav(tmp_path / "bad.wav")


# --- bad input ------------------------------------------------------------------------------------------------------

def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope.png"
    with pytest.raises(InvalidMedia, match="nope.png") as e:
        digests.image(missing)
    assert isinstance(e.value, MmcacheError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("ids", [[1.0, 2.0], [1, 2.5], ["1"], [True, False], [[1, 2]], [None]])
def test_non_integer_token_ids_rejected(ids):
    with pytest.raises(InvalidMedia, match="token ids"):
        digests.prompt(ids)


def test_float_tensor_ids_rejected():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidMedia, match="integers"):
        digests.prompt(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("data", [3, 1.5, None, [1, 2], {"a": 1}, np.array(["a"])])
def test_unsupported_data_types_rejected(data):
    with pytest.raises(InvalidMedia):
        digests.image(data)
