"""Each media file is read once in M*'s data worker: the digest and M*'s own loader see the same bytes. The wrapped
loader's output equals M*'s ``load_image`` on the same file; a file rewritten between the digest and the decode
cannot put one image's pixels under another image's digest. (M*'s ``load_audio`` needs torchcodec, which is not
installed here: the audio check runs a loader override, which gets a private snapshot of the bytes read.) The media
are made by the tests (``made_media``: PNGs, a Seed-TTS-format WAV)."""

import shutil

import pytest
import torch

import made_media
from mstar_encoder_helpers import (
    data_worker,
    install_flashinfer_standin,
    load_audio_16k,
    preprocess,
    qwen3_omni_model,
    qwen3_omni_processors,
    require_mstar,
)

require_mstar()

from mmcache.mstar import media_digests  # noqa: E402
from mmcache.mstar.media_digests import install_digests  # noqa: E402


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return made_media.images(tmp_path_factory.mktemp("images"))[:2]


@pytest.fixture
def worker(monkeypatch):
    install_flashinfer_standin(monkeypatch)
    image_processor, feature_extractor = qwen3_omni_processors()
    w = data_worker(qwen3_omni_model(image_processor, feature_extractor))
    install_digests(w, {"image": image_processor, "audio": feature_extractor})
    return w


def test_the_wrapped_image_loader_equals_mstars_own(worker, images):
    from mstar.model.base import Model
    model, calls = worker.model, []
    real = model.process_prompt
    model.process_prompt = lambda *a, tensors=None, **k: calls.append(tensors["image_inputs"][0]) or real(
        *a, tensors=tensors, **k)
    preprocess(worker, "r", "image", images[0])
    own = Model.load_image(model, str(images[0]), "cpu").data
    assert calls[0].dtype == own.dtype and torch.equal(calls[0], own)


def test_a_file_rewritten_after_its_digest_is_decoded_as_digested(worker, images, tmp_path, monkeypatch):
    path = tmp_path / "upload.png"
    shutil.copy(images[0], path)
    want = preprocess(worker, "first", "image", path)
    digest = media_digests._MEDIA["image"]

    def digest_then_rewrite(data, params):  # another writer replaces the file right after it was read
        out = digest(data, params)
        shutil.copy(images[1], path)
        return out

    shutil.copy(images[0], path)
    monkeypatch.setitem(media_digests._MEDIA, "image", digest_then_rewrite)
    got = preprocess(worker, "second", "image", path)
    assert torch.equal(got["image_digest"][0], want["image_digest"][0])
    assert torch.equal(got["pixel_values"][0], want["pixel_values"][0])
    assert torch.equal(got["image_grid_thw"][0], want["image_grid_thw"][0])


def test_a_loader_override_decodes_a_private_snapshot_of_the_bytes_read(monkeypatch, tmp_path):
    wavs = made_media.voices(tmp_path, 1)
    install_flashinfer_standin(monkeypatch)
    seen = []

    def override(filepath, device):  # what a model's own load_audio override would be
        seen.append(filepath)
        return load_audio_16k(filepath, device)

    hooked, plain = (qwen3_omni_model(*qwen3_omni_processors()) for _ in range(2))
    hooked.load_audio = plain.load_audio = override
    w = data_worker(hooked)
    install_digests(w, {"audio": hooked._processor.feature_extractor})
    got = preprocess(w, "a", "audio", wavs[0], text=None)
    assert seen == [seen[0]] and seen[0] != str(wavs[0])  # one decode, of a snapshot, not of the user's path
    want = preprocess(data_worker(plain), "a", "audio", wavs[0], text=None)
    assert torch.equal(got["audio_features"][0], want["audio_features"][0])


def test_the_carried_digests_reach_the_conductor_for_routing_by_media(worker, images):
    from mmcache.routing import AffinityRouter, media_key
    given = {"mmcache_salt": "tenant-7"}
    got = preprocess(worker, "m", "image", images[0], model_kwargs=given)
    (dest, msg), = [(d, m) for d, m in worker.communicator.sent if d == "conductor"]
    carried = bytes(got["image_digest"][0].numpy())
    assert msg.body.model_kwargs[media_digests.ROUTE_MEDIA_KWARG] == [carried]
    router = AffinityRouter(range(4), key="media")
    assert router.route_key([], msg.body.model_kwargs[media_digests.ROUTE_MEDIA_KWARG], b"tenant-7") == media_key(
        [carried], b"tenant-7")
