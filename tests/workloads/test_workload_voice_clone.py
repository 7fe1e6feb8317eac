"""The voice-clone workload on a tiny random-weight CSM built from config, saved and loaded back: cache on equals cache
off bit for bit (frames and every audio chunk), the codec encoder store hits from the second use of a reference, the
prefix cache matches where a reference or a session's history repeats, the frames are what CSM's own ``generate``
gives, and a bad reference fails only its request. Real Seed-TTS rows when the shared data is present."""

import dataclasses
import io
import wave
from collections import Counter

import pytest
import torch

import digests
from mmcache.errors import InvalidRequest, TraceError
from workloads.harness.metrics import summarize
from workloads.harness.serving import Clock, Schedule, compare
from workloads.models import voice_clone as vc
from workloads.options import ModelWorkloadOptions
from workloads.traces.voice_clone_turns import AUDIO_CHUNK_FRAMES

FRAMES = 8  # ModelWorkloadOptions.max_new_tokens: frames per request


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def options(tmp_path_factory):
    return ModelWorkloadOptions(model_dir=tmp_path_factory.mktemp("models"), pool_pages=512, encoder_bytes=1 << 20)


@pytest.fixture(scope="module")
def made(options):
    return vc.factory(options)


def run(made):
    """``compare`` on the trace schedule, keeping the two workloads it builds (their ``outputs``)."""
    built = []

    def build():
        built.append(made())
        return built[-1]

    off, on = compare(build, Schedule.parse("trace"))
    return off, on, *built


@pytest.fixture(scope="module")
def embedded(made):
    return run(made)


def assert_exact(a: vc.VoiceClone, b: vc.VoiceClone):
    assert a.outputs.keys() == b.outputs.keys() and a.outputs
    for rid, x in a.outputs.items():
        y = b.outputs[rid]
        assert torch.equal(x.codes, y.codes), rid
        assert len(x.audio) == len(y.audio) == FRAMES // AUDIO_CHUNK_FRAMES
        assert all(torch.equal(u, v) for u, v in zip(x.audio, y.audio)), rid


# ------------------------------------------------------------------------------------------------- embedded default
def test_embedded_requests_have_the_seedtts_structure():
    reqs = vc.embedded_requests()
    rows = [r for r in reqs if r.session != vc.SESSION]
    session = [r for r in reqs if r.session == vc.SESSION]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    assert sorted(Counter(r.payload.reference for r in rows).values()) == [2, 2, 2]  # each reference serves 2 rows
    assert len(session) == vc.SESSION_TURNS and {r.payload.reference for r in session} == {rows[0].payload.reference}
    assert [len(r.payload.history) for r in session] == list(range(vc.SESSION_TURNS))
    for ref in {r.payload.reference for r in rows}:
        with wave.open(io.BytesIO(ref)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            assert 1.0 <= w.getnframes() / 24000 <= 3.0
    assert vc.embedded_requests() == reqs and vc.embedded_requests(seed=1) != reqs


def test_first_audio_chunk_and_frames_equal_with_the_cache_on_and_off(embedded):
    off, on, a, b = embedded
    assert_exact(a, b)
    for run_ in (off, on):
        assert all(r.ok and len(r.token_s) == FRAMES and r.ttfa_s is not None for r in run_.records)
    first = a.outputs["spk0/row0"].audio[0]
    assert first.shape == (AUDIO_CHUNK_FRAMES * 1920,) and first.abs().sum() > 0  # 1920 samples per Mimi frame


def test_codec_store_hits_from_the_second_use_of_a_reference(embedded):
    off, on, _, b = embedded
    hits = {r.rid: r.result.encoder_hits["audio"] for r in on.records}
    assert {rid for rid, h in hits.items() if not h} == {"spk0/row0", "spk1/row0", "spk2/row0"}
    assert all(r.result.encoder_hits["audio"] == 0 for r in off.records)
    store = b.cache_stats()["encoder"]
    assert (store["misses"], store["hits"], store["entries"]) == (3, 7, 3)
    assert off.records and summarize(off)["cache_stats"]["encoder"]["queries"] == 0


def test_prefix_tokens_match_where_a_reference_or_a_turn_repeats(embedded):
    off, on, _, _ = embedded
    matched = {r.rid: r.result.hit_tokens for r in on.records}
    assert all(matched[f"spk{s}/row0"] == 0 for s in range(3))
    assert all(matched[f"spk{s}/row1"] > 0 for s in range(3))
    turns = [matched[f"{vc.SESSION}/t{t}"] for t in range(vc.SESSION_TURNS)]
    assert turns[0] > 0 and turns == sorted(set(turns))  # each turn matches more of its growing history
    assert all(r.result.hit_tokens == 0 for r in off.records)
    s = summarize(on)
    assert s["of_ceiling"] == pytest.approx({"prefix": 1.0, "audio": 1.0})  # the pool never evicts here
    assert s["hit_rate"]["audio"] == pytest.approx(0.7) and s["cache_stats"]["prefix"]["requests_live"] == 0
    prompt_tokens = sum(r.result.prompt_tokens for r in on.records)
    assert embedded[3].ceiling_weights() == {"prefix": prompt_tokens, "audio": len(on.records)}


def test_frames_are_csm_generate_greedy(made):
    """The workload's own loop (page-sized prefill chunks, backbone step, depth decoder steps) gives the frames that
    ``CsmForConditionalGeneration.generate`` gives from ``input_ids`` + ``input_values`` with greedy decoding."""
    wl = made()
    req = wl.requests()[0]
    turn = req.payload
    wl.serve(req, False, Clock())
    ours = wl.outputs[req.rid].codes
    ids, _ = wl.template.layout([(turn.reference_text, len(wl.codec.compute(turn.reference))), (turn.text, None)])
    mono = wl.codec.mono(*digests.load_wav(turn.reference))
    theirs = wl.model.generate(input_ids=torch.tensor([ids]), input_values=mono[None],
                               input_values_cutoffs=torch.tensor([[mono.shape[-1]]]), max_new_tokens=FRAMES,
                               do_sample=False, depth_decoder_do_sample=False)
    assert torch.equal(theirs[0], ours) and ours.shape == (FRAMES, wl.model.config.num_codebooks)


# ------------------------------------------------------------------------------------------------------- failures
def test_a_bad_reference_fails_its_request_and_the_replay_goes_on(made, tmp_path):
    reqs = list(made.requests)
    for k, r in enumerate(reqs):
        if r.rid == "spk1/row0":  # a WAV cut short: its header promises more samples than follow
            cut = dataclasses.replace(r.payload, reference=r.payload.reference[:999])
            reqs[k] = dataclasses.replace(r, payload=cut)
        if r.rid == "spk2/row1":
            reqs[k] = dataclasses.replace(r, payload=dataclasses.replace(r.payload, reference=tmp_path / "gone.wav"))
    off, on, a, b = run(dataclasses.replace(made, requests=tuple(reqs)))
    for run_ in (off, on):
        s = summarize(run_)
        assert (s["completed"], s["failed"]) == (8, 2)
        assert "'spk1/row0'" in s["errors"][0] and "truncated WAV" in s["errors"][0]
        assert "'spk2/row1'" in s["errors"][1] and "gone.wav" in s["errors"][1]
        assert run_.records[-1].ok
    assert_exact(a, b)
    assert on.cache_stats["prefix"]["requests_live"] == 0
    assert {r.rid: r.result.encoder_hits["audio"] for r in on.records if r.ok}["spk1/row1"] == 0  # first good use
    assert summarize(on)["of_ceiling"] == pytest.approx({"prefix": 1.0, "audio": 1.0})


def test_a_turn_after_a_failed_turn_fails(made):
    wl = made()
    turn = next(r for r in wl.requests() if r.rid == f"{vc.SESSION}/t1")
    with pytest.raises(InvalidRequest, match="did not complete"):
        wl.serve(turn, True, Clock())
    assert wl.cache_stats()["prefix"]["requests_live"] == 0


def test_seedtts_meta_errors_name_the_file_and_line(tmp_path):
    meta = tmp_path / "meta.lst"
    meta.write_text("a|ref text|a.wav|target\nb|only three|fields\n")
    with pytest.raises(TraceError, match=r"meta.lst:2"):
        vc.seedtts_requests(meta)
    with pytest.raises(TraceError, match="gone.lst"):
        vc.seedtts_requests(tmp_path / "gone.lst")


# ------------------------------------------------------------------------------------------------- options, reuse
def test_limit_and_the_saved_model_is_reused(made, options):
    folder = made.folder
    assert folder.parent == options.model_dir
    before = (folder / "model.safetensors").stat().st_mtime_ns
    limited = vc.factory(dataclasses.replace(options, limit=3))
    assert [r.rid for r in limited.requests] == [r.rid for r in made.requests[:3]]
    assert (folder / "model.safetensors").stat().st_mtime_ns == before and limited.fingerprint == made.fingerprint


# ------------------------------------------------------------------------------------------------ real Seed-TTS rows
def test_real_seedtts_rows(data_dir, options):
    off, on, a, b = run(vc.factory(dataclasses.replace(options, data=data_dir)))
    assert_exact(a, b)
    rows = [r for r in on.records if r.session != vc.SESSION]
    assert len(rows) == 6 and all(r.ok for r in on.records)
    assert [r.result.encoder_hits["audio"] for r in rows] == [0, 1, 0, 1, 0, 1]  # 3 misses + 3 hits
    assert all(r.result.hit_tokens > 0 for r in rows[1::2]) and all(r.result.hit_tokens == 0 for r in rows[::2])
    assert all(r.result.hit_tokens > 0 for r in on.records if r.session == vc.SESSION)
    assert summarize(on)["of_ceiling"] == pytest.approx({"prefix": 1.0, "audio": 1.0})
