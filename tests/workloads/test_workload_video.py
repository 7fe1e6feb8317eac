"""The ``video-gen`` and ``video-chat`` workloads on tiny models built from configs, saved and loaded back: cache on
and off give the same frames (float32 and bfloat16) and tokens bit for bit, prompts, conditioning images and clips
hit at their ceilings, and a bad image or clip fails its own requests while the replay goes on, storing nothing."""

import pytest
import torch

from made_clips import bad_clips, frames
from workloads.harness.metrics import summarize
from workloads.harness.serving import Request, Schedule, compare
from workloads.models import video_chat, video_gen
from workloads.models.video_gen import Clip, VideoGen
from workloads.models.vlm_chat import chats
from workloads.options import ModelWorkloadOptions
from workloads.traces.clips import encode_frames

TRACE = Schedule.parse("trace")


@pytest.fixture(scope="module")
def options(tmp_path_factory, one_thread):
    return ModelWorkloadOptions(limit=6, encoder_bytes=16 << 20, max_new_tokens=2,
                                model_dir=tmp_path_factory.mktemp("models"))


def replay(make):
    """``(off, on, workload off, workload on)`` of one cache-off-then-on replay."""
    made = []
    off, on = compare(lambda: made.append(make()) or made[-1], TRACE)
    return off, on, *made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_video_gen_is_exact_and_hits_prompts_and_images(options, dtype):
    off, on, wl_off, wl_on = replay(video_gen.factory(options, dtype))
    assert len(wl_on.outputs) == 6 and wl_off.outputs == wl_on.outputs
    assert [r.payload.image is not None for r in wl_on.requests()] == [False] * 3 + [True] * 3
    s = summarize(on)
    assert s["failed"] == 0 and s["of_ceiling"] == pytest.approx({"text": 1.0, "image": 1.0})
    assert [r.result.encoder_hits.get("image") for r in on.records[3:]] == [0, 1, 1]  # one image, three prompts
    assert all(r.result.output_tokens == video_gen.CALL["num_frames"] for r in on.records)
    assert {"text", "image", "denoise", "decode"} <= set(on.records[-1].stages)
    assert on.cache_stats["encoder"]["by_modality"]["image"]["misses"] == 1


def test_video_gen_conditioning_image_changes_the_video(options):
    wl = video_gen.factory(options)()
    a, b = (video_gen.images(options)[k] for k in (0, 1))
    frames = [wl.generate(Clip("a fox", 3, image), True, video_gen.Clock())[0] for image in (a, b, a)]
    assert not torch.equal(frames[0], frames[1]) and torch.equal(frames[0], frames[2])


def test_video_gen_bad_image_fails_alone_and_stores_nothing(options):
    wl = video_gen.factory(options)()
    reqs = [Request(f"r{k}", f"r{k}", 0.0, Clip("a fox", k, image)) for k, image in
            enumerate([None, b"not a png", video_gen.images(options)[0], None])]
    make = lambda: VideoGen(wl.pipe, wl.i2v, reqs, (wl.encoder.fingerprint, wl.latents.fingerprint),  # noqa: E731
                            wl.ceilings(), 16 << 20)
    off, on, wl_off, wl_on = replay(make)
    for run in (off, on):
        s = summarize(run)
        assert s["failed"] == 1 and s["completed"] == 3 and "cannot decode image" in s["errors"][0]
    assert wl_off.outputs == wl_on.outputs and on.cache_stats["encoder"]["by_modality"]["image"]["misses"] == 2
    assert on.cache_stats["encoder"]["entries"] == 3  # the prompt, the negative, one image: none for the bad one


def test_video_chat_is_exact_and_hits_the_prefix_and_the_clips(options):
    off, on, wl_off, wl_on = replay(video_chat.factory(options))
    assert len(wl_on.outputs) == 6 and wl_off.outputs == wl_on.outputs
    s = summarize(on)
    assert s["failed"] == 0 and s["of_ceiling"] == pytest.approx({"prefix": 1.0, "video": 1.0})
    assert s["hit_rate"]["video"] > 0.5 and s["hit_rate"]["prefix"] > 0.5
    assert on.cache_stats["encoder"]["by_modality"]["video"]["misses"] == 1  # one clip, two users, three turns


def test_video_chat_bad_clips_fail_their_sessions_and_the_replay_goes_on(options):
    from workloads import fixtures

    tok = fixtures.text_tokenizer(None)
    model, processor, _ = fixtures.load_llava_next_video(options)
    good = video_chat.clips(ModelWorkloadOptions())[0]
    short = encode_frames(frames(2))  # 2 frames, sampled at 4
    videos = [good, *(c for words, c in bad_clips().items() if "frames asked" not in words), short, good]
    items = [[[v, "\nWhat moves?"]] for v in videos]
    make = chats(model, processor, items, tok, ModelWorkloadOptions(max_new_tokens=2, model_dir=options.model_dir),
                 cls=video_chat.VideoChat, sampling=video_chat.SAMPLING,
                 system=video_chat.SYSTEM, follow_ups=video_chat.FOLLOW_UPS)
    off, on, wl_off, wl_on = replay(make)
    bad = 4 * 3  # three turns of each bad clip's session
    for run in (off, on):
        s = summarize(run)
        assert s["failed"] == bad and s["completed"] == 2 * 3 and run.records[-1].ok
    assert wl_off.outputs == wl_on.outputs
    assert on.cache_stats["encoder"]["entries"] == 1 and on.cache_stats["prefix"]["requests_live"] == 0


def test_video_chat_same_clip_behind_the_same_text_hits_a_different_clip_never(options):
    from workloads import fixtures

    tok = fixtures.text_tokenizer(None)
    model, processor, _ = fixtures.load_llava_next_video(options)
    a, b = video_chat.clips(ModelWorkloadOptions())[:2]
    hits = {}
    for second in (a, b):
        make = chats(model, processor, [[[a, "\nWhat moves?"]], [[second, "\nWhat moves?"]]], tok,
                     ModelWorkloadOptions(max_new_tokens=2, model_dir=options.model_dir), cls=video_chat.VideoChat,
                     sampling=video_chat.SAMPLING, system=video_chat.SYSTEM, follow_ups=())
        off, on, wl_off, wl_on = replay(make)
        assert wl_off.outputs == wl_on.outputs
        [first] = [r for r in on.records if r.rid == "i1u0t0"]
        hits[second is a] = first.result.hit_tokens, first.result.encoder_hits["video"]
        offset = wl_on.prompt(wl_on.requests()[1], {}).items[0][0]
    P = options.page_size
    assert hits[False][0] <= offset // P * P and hits[False][1] == 0  # the pages from the clip's on are new
    assert hits[True][0] > offset  # the same clip: its pages match too
    assert hits[True][1] == 1
