"""The replica replay with media: image chats (several users per image) and voice sessions (users cloning a few
voices) over per-replica prefix caches and encoder stores, the routers compared, and the command line. The traces
are built from small generated items here; the data's own replays skip without ../shared/data."""

import json

import numpy as np
import pytest

from workloads import cli, registry
from workloads.service import ServiceModel
from workloads.sizing.replicas import ENCODER_UNIT, replay_replicas
from workloads.traces.image_chats import ImageChats, load_image_chats
from workloads.traces.mmmu import question_parts
from workloads.traces.tokenizer import load_tokenizer
from workloads.traces.voice_sessions import Voice, VoiceSessions

TOK = load_tokenizer()
ITEMS = [question_parts(f"Which part of <image 1> shows item {k}?", ["left", "right", "top"],
                        {1: f"image {k}".encode() * 40}) for k in range(24)]  # digested as sent, never decoded
CHATS = ImageChats(users_per_item=6, sessions_per_s=4.0).trace(ITEMS, TOK, "generated")
KW = dict(page_size=16, pool_tokens=1 << 20)


def test_image_chat_trace_shape():
    assert len(CHATS.sessions) == 24 * 6 and CHATS.num_requests == 3 * 24 * 6
    s = CHATS.sessions[0]
    first, last = s.build(0), s.build(2)
    assert last.token_ids[:first.prompt_len + first.output_len].tolist() == [*first.token_ids, *first.output_ids]
    (img,) = first.encoded
    assert last.encoded == (img,) and img.tokens == 576 and img.modality == "image"
    assert (first.token_ids[img.offset:img.offset + img.tokens] == 0).all()
    users = {}  # users of one item share the image, never a page past the system prompt
    for sess in CHATS.sessions:
        users.setdefault(sess.build(0).encoded[0].digest, []).append(sess.build(0).token_ids)
    assert len(users) == 24 and all(len(v) == 6 for v in users.values())


@pytest.mark.parametrize("replicas", [2, 4])
def test_media_affinity_encodes_each_image_on_fewer_replicas_than_random(replicas):
    runs = {r: replay_replicas(CHATS, replicas=replicas, router=r, **KW)
            for r in ("random", "affinity", "media-affinity", "cache-aware")}
    media, rand = runs["media-affinity"], runs["random"]
    assert media.encoder_hit_rate > rand.encoder_hit_rate and media.hit_rate > rand.hit_rate
    assert media.encoder_hit_rate > runs["cache-aware"].encoder_hit_rate  # cache-aware keeps sessions, not images
    assert media.ttft_p50_s <= rand.ttft_p50_s
    for run in runs.values():
        assert run.encoder_items == sum(len(s.build(i).encoded) for s in CHATS.sessions for i in range(3))
        assert run.encoder_in_prefix + run.encoder_store_hits <= run.encoder_items and run.ttfa_p50_s is None
    assert media.encoder_in_prefix > 0  # follow-ups find their image inside the history they re-send


def test_encoder_misses_cost_encoder_s_and_the_store_is_split_over_replicas():
    cheap, dear = (replay_replicas(CHATS, replicas=2, router="random", service=ServiceModel(encoder_s=s), **KW)
                   for s in (0.0, 1.0))
    assert dear.ttft_p99_s > cheap.ttft_p99_s + 0.9 and dear.encoder_items == cheap.encoder_items
    small = replay_replicas(CHATS, replicas=4, router="media-affinity", encoder_bytes=64 << 20, **KW)
    assert small.encoder_bytes == 64 << 20
    tiny = replay_replicas(CHATS, replicas=4, router="random", encoder_bytes=4 << 20, **KW)  # < 1 image each
    assert tiny.encoder_store_hits == 0 and tiny.encoder_hit_rate < small.encoder_hit_rate
    with pytest.raises(ValueError):
        replay_replicas(CHATS, replicas=4, router="random", encoder_bytes=ENCODER_UNIT, **KW)


def test_voice_sessions_share_the_reference_and_report_first_audio():
    from workloads.models.voice_clone import tone_wav
    from workloads.traces.voice_clone_turns import AUDIO_CHUNK_FRAMES
    voices = [Voice(tone_wav(k), f"Speaker {k} reads a short line.") for k in range(6)]
    trace = VoiceSessions(users=80).trace(voices, TOK, "generated")
    req = max(trace.sessions, key=lambda s: len(s.calls)).build(1)
    ref, generated = req.media[0], req.media[1]
    assert req.encoded == (ref,) and ref.modality == "audio" and generated.modality is None
    assert req.output_ids is None and ref.nbytes == ref.tokens * 32 * 8
    rand, media = (replay_replicas(trace, replicas=4, router=r, **KW) for r in ("random", "media-affinity"))
    assert media.encoder_hit_rate > rand.encoder_hit_rate and media.hit_rate > rand.hit_rate
    lag = (AUDIO_CHUNK_FRAMES - 1) * ServiceModel().s_per_output_token
    assert media.ttfa_p99_s == pytest.approx(media.ttft_p99_s + lag)


def _mmmu_folder(root):
    (root / "mmmu" / "images").mkdir(parents=True)
    rows = []
    for k in range(6):
        (root / "mmmu" / "images" / f"q{k}.png").write_bytes(f"png {k}".encode() * 50)
        rows.append(json.dumps({"question": f"What is shown in <image 1> ({k})?", "options": ["a", "b"],
                                "image_1": f"images/q{k}.png"}))
    (root / "mmmu" / "mmmu_pro_tool_sample_questions.jsonl").write_text("\n".join(rows) + "\n")
    return root


def test_cli_replicas_on_vlm_chat(tmp_path, capsys):
    out = tmp_path / "r.json"
    data = _mmmu_folder(tmp_path / "data")
    assert cli.main(["replay", "vlm-chat", "--replicas", "2", "--router", "random,media-affinity", "--data",
                     str(data), "--limit", "24", "--pool-tokens", "256k", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "encoder hit %" in text and "media-affinity" in text and "TTFA" not in text
    doc = json.loads(out.read_text())
    assert [r["router"] for r in doc["runs"]] == ["random", "media-affinity"] and doc["service_model"]["encoder_s"]
    assert doc["runs"][1]["encoder_hit_rate"] >= doc["runs"][0]["encoder_hit_rate"]


@pytest.mark.parametrize("argv, says", [
    (["vlm-chat", "--replicas", "2", "--data", "{empty}"], "mmmu_pro_tool_sample_questions.jsonl"),
    (["image-gen", "--replicas", "2"], "has no replica replay"),
    (["vlm-chat", "--replicas", "2", "--max-new-tokens", "4"], "--max-new-tokens: not with --replicas"),
    (["vlm-chat", "--replicas", "2", "--order", "round-robin"], "not with --replicas"),
    (["hot-prefix", "--replicas", "2", "--encoder-s", "0.1"], "--encoder-s: only with --replicas on a model"),
    (["vlm-chat", "--encoder-s", "0.1"], "--encoder-s: only with --replicas"),
])
def test_cli_media_replica_errors(argv, says, tmp_path, capsys):
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv]
    assert cli.main(["replay", *argv, "--no-progress"]) == 2
    assert says in capsys.readouterr().err


def _shared_root():
    try:
        return registry.find_data("vlm-chat")
    except registry.UnknownWorkload as e:
        pytest.skip(f"the shared data is absent: {e}")


def test_the_shared_mmmu_questions_replay_with_media_affinity_ahead_of_random():
    trace = load_image_chats(_shared_root(), limit=60)
    rand, media = (replay_replicas(trace, replicas=4, router=r, **KW) for r in ("random", "media-affinity"))
    assert media.encoder_hit_rate > rand.encoder_hit_rate and media.encoder_items == rand.encoder_items > 60


class _Internals:
    """A replica's caches read from their internals (the index's indexed names, the store's entries), asserting at
    every query that the replica's view decoded from its events answers the same."""

    def __init__(self, rep):
        self.rep = rep

    def matched_pages(self, names):
        index = self.rep.cache.index
        held = {int(n) for n in index.tier_view().name[np.flatnonzero(index.indexed)]}
        k = 0
        while k < len(names) and int(names[k]) in held:
            k += 1
        assert self.rep.view.matched_pages(names) == k and self.rep.view.gaps == 0
        return k

    def holds_media(self, digest):
        held = any(e.key.digest == bytes(digest) for e in self.rep.encoders.store._entries.values())
        assert self.rep.view.holds_media(digest) == held
        return held


def test_kv_aware_routes_the_same_from_decoded_events_as_from_the_caches_internals():
    kw = dict(replicas=4, router="kv-aware", **KW)
    from_events = replay_replicas(CHATS, **kw)
    from_internals = replay_replicas(CHATS, view_of=_Internals, **kw)
    a, b = from_events.to_dict(), from_internals.to_dict()
    a.pop("elapsed_s"), b.pop("elapsed_s")
    assert a == b and from_events.requests == CHATS.num_requests
    rand = replay_replicas(CHATS, replicas=4, router="random", **KW)
    assert from_events.hit_rate > rand.hit_rate and from_events.encoder_hit_rate > rand.encoder_hit_rate
