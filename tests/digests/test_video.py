"""Video digests and decoding: a clip's digest commits to its container bytes and its frame sampling, and every bad
clip (not a video, truncated, container and codec disagreeing, sampled beyond its end) is an ``InvalidMedia`` that
stores nothing; a cached video encoder's hit equals its miss and the uncached pipeline bit for bit."""

import numpy as np
import pytest
import torch

import digests
from digests import FrameSampling, load_video
from encoders.video import CachedVideoEncoder, tokens_per_video
from made_clips import CLIP, MKV, bad_clips
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidMedia
from workloads import fixtures
from workloads.options import ModelWorkloadOptions
from workloads.traces.clips import pan_clip, pan_frames


def test_sampling_picks_evenly_spaced_or_fixed_rate_frames():
    assert FrameSampling(4).indices([k / 8 for k in range(8)]) == [0, 2, 5, 7]
    assert FrameSampling(1).indices([0.0, 0.1]) == [0]
    assert FrameSampling(3, fps=4.0).indices([k / 8 for k in range(8)]) == [0, 2, 4]
    with pytest.raises(InvalidMedia, match="at 4.0 fps"):
        FrameSampling(5, fps=4.0).indices([k / 8 for k in range(8)])
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidMedia):
            FrameSampling(bad)


def test_load_video_decodes_the_sampled_frames():
    got = load_video(CLIP, FrameSampling(4))
    assert got.shape == (4, 32, 32, 3) and got.dtype == np.uint8
    assert np.array_equal(load_video(CLIP, FrameSampling(8))[[0, 2, 5, 7]], got)
    assert np.array_equal(load_video(MKV, FrameSampling(4)), got)  # one codec, two containers


@pytest.mark.parametrize("words", list(bad_clips()))
def test_bad_clips_are_invalid_media(words):
    sampling = FrameSampling(9 if "9 frames" in words else 2)
    with pytest.raises(InvalidMedia, match=words):
        load_video(bad_clips()[words], sampling)


def test_missing_file_is_invalid_media(tmp_path):
    with pytest.raises(InvalidMedia, match="no such video file"):
        load_video(tmp_path / "absent.mp4", FrameSampling(1))


def test_video_digest_commits_to_bytes_and_sampling(tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(CLIP)
    params = {"sampling": FrameSampling(4)}
    assert digests.video(CLIP, params) == digests.video(path, params)
    assert digests.video(CLIP, params) != digests.video(CLIP, {"sampling": FrameSampling(2)})
    assert digests.video(CLIP, params) != digests.video(CLIP, {"sampling": FrameSampling(4, fps=8.0)})
    assert digests.video(CLIP, params) != digests.video(MKV, params)  # same frames, other container bytes
    assert digests.video(CLIP, params) != digests.image(CLIP, params)


def test_pan_clip_is_stable_and_moves():
    from workloads.models.vlm_chat import generated_png

    png = generated_png(0, np.random.default_rng(0))
    assert pan_clip(png) == pan_clip(png)
    f = pan_frames(png)
    assert f.shape == (8, 64, 64, 3) and not np.array_equal(f[0], f[-1])


@pytest.fixture(scope="module")
def llava_video(tmp_path_factory):
    model, processor, _ = fixtures.load_llava_next_video(ModelWorkloadOptions(
        model_dir=tmp_path_factory.mktemp("models")))
    return model, processor


def test_cached_video_encoder_hit_equals_miss_and_the_uncached_pipeline(llava_video):
    model, processor = llava_video
    sampling = FrameSampling(4)
    store = EncoderStore(8 << 20, 1 << 14)
    cached = CachedVideoEncoder(model, processor, store, sampling)
    miss, hit = cached.lookup(CLIP), cached.lookup(CLIP)
    assert (miss.hit, hit.hit) == (False, True) and torch.equal(miss.value, hit.value)
    assert miss.value.shape == (tokens_per_video(model.config, sampling), model.config.text_config.hidden_size)
    pixels = processor(videos=[load_video(CLIP, sampling)], do_sample_frames=False,
                       return_tensors="pt")["pixel_values_videos"]
    with torch.inference_mode():
        by_hand = model.get_video_features(pixel_values_videos=pixels, vision_feature_layer=-2,
                                           vision_feature_select_strategy="default").pooler_output[0]
    assert torch.equal(by_hand, miss.value)
    other = CachedVideoEncoder(model, processor, store, FrameSampling(2), fingerprint=cached.fingerprint)
    assert not other.lookup(CLIP).hit  # another sampling of the same file never shares an entry


def test_bad_clips_store_nothing(llava_video):
    store = EncoderStore(8 << 20, 1 << 14)
    cached = CachedVideoEncoder(*llava_video, store, FrameSampling(9))
    for clip in bad_clips().values():
        with pytest.raises(InvalidMedia):
            cached.lookup(clip)
    assert store.stats().entries == 0
