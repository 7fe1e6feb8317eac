"""M*'s own Qwen3-Omni audio encoder node (``AudioEncoderSubmodule`` over a tiny random tower, loaded by
``Qwen3OmniModel.get_submodule`` from a local folder) with reuse turned on by the one call (``enable_encoder_reuse``)
and served as M*'s worker serves it, over made reference-voice WAVs in Seed-TTS's format (``made_media``: 24 kHz mono
16-bit, each serving two rows), run through Qwen3-Omni's own ``process_prompt`` (its feature extractor) by M*'s data
worker with the digest hook. M*'s ``load_audio`` needs torchcodec; where it is missing, the WAV is decoded by
mmcache's reader and resampled to 16 kHz with torchaudio instead (the same features reach both models either way)."""

import importlib.util

import pytest

import made_media
from mstar_encoder_checkpoints import same_parameters
from mstar_encoder_helpers import (
    ForwardCount,
    assert_equal_outputs,
    data_worker,
    load_audio_16k,
    preprocess,
    qwen3_omni_model,
    qwen3_omni_on_cpu,
    require_mstar,
    served_node,
)

require_mstar()

from mmcache.mstar.encoder_node import CachedEncoderNode  # noqa: E402
from mmcache.mstar.media_digests import install_digests  # noqa: E402

NODE, WALK = "audio_encoder", "prefill_audio"


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    """``(make, worker, reference)``: ``make()`` a fresh M* Qwen3-Omni model over the tiny encoders' folder, the
    data worker (its own model, the digest hook installed), the audio tower the folder was written from."""
    mp = pytest.MonkeyPatch()
    weights, towers, image_processor, feature_extractor = qwen3_omni_on_cpu(mp, tmp_path_factory.mktemp("q3o"))
    model = qwen3_omni_model(image_processor, feature_extractor)
    if importlib.util.find_spec("torchcodec") is None:
        model.load_audio = load_audio_16k
    worker = data_worker(model)
    install_digests(worker, {"audio": feature_extractor})
    yield (lambda: qwen3_omni_model(image_processor, feature_extractor, weights)), worker, towers["audio_tower"]
    mp.undo()


def test_one_call_reference_wavs_hit_on_their_second_row_bit_identical(audio, tmp_path):
    """The one call wraps the audio node M*'s loader built from the folder; each voice's second row is served from
    the store (a repeat inside a batch joins the first), the outputs equal reuse off bit for bit."""
    make, worker, reference = audio
    (wrapped, cached), (plain, _) = served_node(make(), NODE), served_node(make(), NODE, reuse=False)
    assert isinstance(cached, CachedEncoderNode) and same_parameters(cached.node.audio_encoder, reference)
    count = ForwardCount(cached.node.audio_encoder)
    inputs = []
    for i, wav in enumerate(made_media.voice_rows(tmp_path)):  # 3 WAVs, 2 rows each
        t = preprocess(worker, f"row{i}", "audio", wav, text=None)
        inputs.append({name: t[name] for name in ("audio_features", "audio_seqlens", "audio_digest")})
    # rows in pairs of two batches: the first of each WAV misses, the second hits, mixed in one batch
    first = {f"r{i}": inputs[i] for i in (0, 2)}
    wrapped.run(NODE, WALK, first)
    assert count.calls == 2
    mixed = {f"r{i}": inputs[i] for i in (1, 3, 4, 5)}  # rows 1, 3 hit (WAVs of rows 0, 2); 4 misses; 5 joins 4
    got = wrapped.run(NODE, WALK, mixed)
    want = plain.run(NODE, WALK, mixed)
    assert_equal_outputs(got, want)
    assert count.calls == 3
    c = cached.counters
    assert (c.hits, c.misses, c.joins) == (2, 3, 1)
    assert cached.store.stats().by_modality["audio"].time_saved_s > 0
