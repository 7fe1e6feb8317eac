"""M*'s own Qwen3-Omni ``AudioEncoderSubmodule`` (a tiny random HF audio encoder, sdpa) under M*'s Engine,
wrapped in ``CachedEncoderNode``, over the Seed-TTS reference WAVs (each serves two rows of meta.lst), run through
Qwen3-Omni's own ``process_prompt`` (its feature extractor) by M*'s data worker with the digest hook. M*'s
``load_audio`` needs torchcodec; where it is missing, the WAV is decoded by mmcache's reader and resampled to 16 kHz
with torchaudio instead (the same features reach both the wrapped and the plain node either way)."""

import importlib.util

import pytest

from mstar_encoder_helpers import (ForwardCount, assert_equal_outputs, data_worker, engine,
                                   install_flashinfer_standin, load_audio_16k, preprocess, qwen3_omni_model,
                                   qwen3_omni_processors, require_mstar, tiny_qwen3_omni_encoders)

require_mstar()

from mmcache.mstar.encoder_items import items_for  # noqa: E402
from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402
from mmcache.mstar.media_digests import install_digests  # noqa: E402

WALK = "prefill_audio"


@pytest.fixture(scope="module")
def seedtts_rows():
    from conftest import shared_data
    data = shared_data()
    if data is None or not (data / "seedtts" / "meta.lst").is_file():
        pytest.skip("Seed-TTS rows not found: place ../shared/data/seedtts or set MMCACHE_DATA")
    folder = data / "seedtts"
    rows = [line.split("|") for line in (folder / "meta.lst").read_text().splitlines() if line.strip()]
    return [folder / row[2] for row in rows]  # the prompt WAV of each row, in order (3 WAVs, 2 rows each)


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    install_flashinfer_standin(mp)
    from mstar.model.qwen3_omni.submodules import AudioEncoderSubmodule
    root = tmp_path_factory.mktemp("q3o")
    nodes = [AudioEncoderSubmodule(tiny_qwen3_omni_encoders(root)[1], config=None) for _ in range(2)]
    image_processor, feature_extractor = qwen3_omni_processors()
    model = qwen3_omni_model(image_processor, feature_extractor)
    if importlib.util.find_spec("torchcodec") is None:
        model.load_audio = load_audio_16k
    worker = data_worker(model)
    install_digests(worker, {"audio": feature_extractor})
    yield nodes, worker
    mp.undo()


def test_reference_wavs_hit_on_their_second_row_bit_identical(audio, seedtts_rows):
    (plain_node, node), worker = audio
    cached = CachedEncoderNode(node, items_for(node), capacity_bytes=1 << 22, page_bytes=4096)
    plain, wrapped = engine({"audio_encoder": plain_node}), engine({"audio_encoder": cached})
    count = ForwardCount(node.audio_encoder)
    inputs = []
    for i, wav in enumerate(seedtts_rows):
        t = preprocess(worker, f"row{i}", "audio", wav, text=None)
        inputs.append({name: t[name] for name in ("audio_features", "audio_seqlens", "audio_digest")})
    # rows in pairs of two batches: the first of each WAV misses, the second hits, mixed in one batch
    first = {f"r{i}": inputs[i] for i in (0, 2)}
    wrapped.run("audio_encoder", WALK, first)
    assert count.calls == 2
    mixed = {f"r{i}": inputs[i] for i in (1, 3, 4, 5)}  # rows 1, 3 hit (WAVs of rows 0, 2); 4 misses; 5 joins 4
    got = wrapped.run("audio_encoder", WALK, mixed)
    want = plain.run("audio_encoder", WALK, mixed)
    assert_equal_outputs(got, want)
    assert count.calls == 3
    c = cached.counters
    assert (c.hits, c.misses, c.joins) == (2, 3, 1)
    assert cached.store.stats().by_modality["audio"].time_saved_s > 0
