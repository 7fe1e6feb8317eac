"""M*'s real Qwen3-TTS Talker (``TalkerSubmodule`` over ``Qwen3TTSTalkerModel`` and its CodePredictor, a tiny
random checkpoint loaded by M*'s own config reader and loader) under M*'s real ``Engine`` on CPU, reuse on
(``enable_reuse`` with ``mmcache.mstar.qwen3_tts.qwen3_tts_reuse``: the prefill named row by row by the rows'
digests) and off, on the same schedule: a prefill then greedy decode frames (``workloads/peers/mstar_qwen3_tts.py``).
Only flashinfer's and triton's kernels are torch stand-ins.

- fp32, the Talker's group-0 logits on the prefill and every frame are transformers' ``Qwen3Model`` on the same
  weights fed the same rows (what M*'s ``prepare_inputs`` built), through the codec head;
- bf16, a second request with the same speaker and language reuses the 2 pages before its first text token (its
  prefill computes 2 of 10 rows), whatever its text; the group-0 logits and all codes of every frame are
  ``torch.equal`` to reuse off;
- another speaker shares only the page before the speaker row; on auto language (9 rows) one page is reused, as two
  rows are always left to compute;
- the decode frames are named by nothing: no page holding a frame is indexed;
- a request prefilled while another with the same speaker decodes shares its pages, and the two decode in one batch
  bit-exactly;
- in shadow mode the prefill is measured (the pages reuse on would match) and nothing changes.
"""

import pytest
import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from mmcache.mstar.qwen3_tts import prefill_rows_media, qwen3_tts_reuse  # noqa: E402
from workloads.peers.mstar_qwen3_tts import (  # noqa: E402
    DECODE,
    LABEL,
    PREFILL,
    dense_reference,
    greedy,
    install_code_predictor_kernels,
    save_checkpoint,
    talker_engine,
    walk,
)

pytestmark = pytest.mark.usefixtures("one_thread")
P = 4  # page size
VIVIAN, RYAN, ENGLISH, AUTO = 3065, 3061, 2050, -1


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("qwen3-tts"))


@pytest.fixture
def sampled(sampled, monkeypatch):
    """The shared stand-ins (``conftest.sampled``) and the Talker's own two (``install_code_predictor_kernels``: the
    RoPE and decode attention ``components/talker.py`` imports by name)."""
    install_code_predictor_kernels(monkeypatch)
    return sampled


def text(n: int, seed: int) -> list[int]:
    return torch.randint(1, 150000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(te, sampled, rid: str, words: list[int], speaker: int, language: int, frames: int):
    """One request: its prefill and ``frames`` decode frames, removed. Returns (group-0 logits of every step, codes of
    every frame, rows the prefill computed, the rows fed at every step)."""
    te.engine.add_request(rid, greedy(te.model))
    got = walk(te, PREFILL, {rid: (words, speaker, language)}, sampled)[rid]
    fed, rows = te.fed[rid], [te.rows[rid]]
    logits, codes = [got[1]], [got[0]]
    for _ in range(frames):
        got = walk(te, DECODE, {rid: got[2]}, sampled)[rid]
        logits.append(got[1])
        codes.append(got[0])
        rows.append(te.rows[rid])
    te.engine.remove_request(rid)
    return logits, codes, fed, rows



def test_the_talker_is_transformers_qwen3_over_the_rows_it_is_fed(checkpoint, sampled):
    te = talker_engine(checkpoint, dtype=torch.float32)
    logits, _, fed, rows = serve(te, sampled, "a", text(6, seed=1), VIVIAN, ENGLISH, frames=3)
    assert fed == 10  # 3 role rows, 6 codec tag rows, the first text token
    dense, head = dense_reference(checkpoint)
    with torch.no_grad():
        hidden = dense(inputs_embeds=torch.cat(rows)[None]).last_hidden_state[0]
    want = hidden @ head.t()
    for got, at in zip(logits, [9, 10, 11, 12], strict=True):  # the prefill's last row, then each frame's
        seen = torch.isfinite(got)  # M* masks the control and speaker ids before sampling
        assert seen.sum() > 1000
        torch.testing.assert_close(got[seen], want[at][seen], atol=1e-4, rtol=1e-4)


def test_the_same_speaker_reuses_the_pages_before_the_text_bit_exactly(checkpoint, sampled):
    on, off = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test")), talker_engine(checkpoint)
    for rid, words in (("a", text(7, seed=2)), ("b", text(5, seed=3))):  # other text, same speaker and language
        got, want = (serve(e, sampled, rid, words, VIVIAN, ENGLISH, frames=3) for e in (on, off))
        assert all_equal(got[0], want[0]) and all_equal(got[1], want[1]) and want[2] == 10
    assert got[2] == 10 - 2 * P  # b's prefill: rows 0-7 (role, think, think BOS, language, think EOS) were a's
    s = on.kv.stats(LABEL)
    assert s.hits == 1 and s.hit_tokens == 2 * P


def test_another_speaker_shares_only_the_pages_before_the_speaker_row(checkpoint, sampled):
    """And another language setting only those before its row: auto (nothink at row 3) shares nothing."""
    on, off = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test")), talker_engine(checkpoint)
    words = text(6, seed=4)
    serve(on, sampled, "a", words, VIVIAN, ENGLISH, frames=2)
    got, want = (serve(e, sampled, "b", words, RYAN, ENGLISH, frames=2) for e in (on, off))
    assert all_equal(got[0], want[0]) and all_equal(got[1], want[1])
    assert got[2] == 10 - P  # row 7 holds the speaker: page 1 differs, page 0 (role rows and think) is shared
    assert on.kv.stats(LABEL).hit_tokens == P
    got, want = (serve(e, sampled, "c", words, VIVIAN, AUTO, frames=2) for e in (on, off))
    assert all_equal(got[0], want[0]) and got[2] == 9  # auto language: row 3 is nothink, page 0 differs
    assert on.kv.stats(LABEL).hit_tokens == P


def test_on_auto_language_one_page_is_reused_and_no_frame_is_indexed(checkpoint, sampled):
    """Auto language: 9 rows, of which 8 come before the text, but a step keeps two rows to compute: 1 page. The
    same request again (same text too) reuses no more: the frames are named by nothing, so no page holding one is
    indexed."""
    on, off = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test")), talker_engine(checkpoint)
    words = text(6, seed=5)
    serve(on, sampled, "a", words, VIVIAN, AUTO, frames=6)
    assert on.kv.stats(LABEL).pages_cached == 2  # the prefill's two full pages; the third holds frames
    got, want = (serve(e, sampled, "b", words, VIVIAN, AUTO, frames=2) for e in (on, off))
    assert all_equal(got[0], want[0]) and all_equal(got[1], want[1])
    assert want[2] == 9 and got[2] == 9 - P


def test_the_prefill_is_named_row_by_row_and_decode_by_nothing():
    from mstar.model.submodule_base import ARNodeInputs

    from mmcache.mstar.encoder_items import rows_digest
    rows = torch.randn(9, 32, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    marks = prefill_rows_media(PREFILL, None, {}, ARNodeInputs(input_seq_len=9, input_embeds=rows))
    assert [o for o, _ in marks] == list(range(9)) and marks[4][1] == rows_digest(rows[4].clone())
    assert len({d for _, d in marks}) == 9
    assert prefill_rows_media(DECODE, None, {}, ARNodeInputs(input_seq_len=1, input_embeds=rows[:1])) is None


def test_a_request_prefilled_while_another_decodes_shares_its_pages_in_one_decode_batch(checkpoint, sampled):
    """b is prefilled while a is decoding (a's prefill pages committed), then both decode in one batch: b attends to
    a's pages, and every step's codes and logits equal reuse off."""
    on, off = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test")), talker_engine(checkpoint)
    runs = {}
    for name, te in (("on", on), ("off", off)):
        steps = []
        te.engine.add_request("a", greedy(te.model))
        steps.append(walk(te, PREFILL, {"a": (text(6, seed=7), VIVIAN, ENGLISH)}, sampled))
        steps.append(walk(te, DECODE, {"a": steps[-1]["a"][2]}, sampled))
        te.engine.add_request("b", greedy(te.model))
        steps.append(walk(te, PREFILL, {"b": (text(4, seed=8), VIVIAN, ENGLISH)}, sampled))
        fed_b = te.fed["b"]
        if name == "on":
            held_a, held_b = (te.kv._streams[r][LABEL].page_indices for r in ("a", "b"))
            assert held_b[:2] == held_a[:2] and not set(held_b[2:]) & set(held_a)
            assert (te.kv.pool.counts[held_a[:2]] >= 2).all()
        last = {"a": steps[1]["a"][2], "b": steps[2]["b"][2]}
        for _ in range(3):
            steps.append(walk(te, DECODE, last, sampled))
            last = {rid: got[2] for rid, got in steps[-1].items()}
        for rid in ("a", "b"):
            te.engine.remove_request(rid)
        runs[name] = steps, fed_b
    (got, fed_on), (want, fed_off) = runs["on"], runs["off"]
    assert fed_off == 10 and fed_on == 10 - 2 * P
    for step_on, step_off in zip(got, want, strict=True):
        assert step_on.keys() == step_off.keys()
        for rid in step_on:
            assert torch.equal(step_on[rid][0], step_off[rid][0]) and torch.equal(step_on[rid][1], step_off[rid][1])


def test_shadow_mode_measures_the_prefill_pages_and_changes_nothing(checkpoint, sampled):
    """``shadow=True``: the prefill is named by its rows' marks and looked up, nothing is cut or cached, the logits
    are reuse off's, and the shadow matches what reuse on matches on the same schedule."""
    shadow = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test", shadow=True))
    on, off = talker_engine(checkpoint, reuse=qwen3_tts_reuse("qwen3-tts-tiny@test")), talker_engine(checkpoint)
    runs = {}
    for name, te in (("shadow", shadow), ("on", on), ("off", off)):
        runs[name] = [serve(te, sampled, rid, text(5, seed=9 + i), speaker, ENGLISH, frames=2)
                      for i, (rid, speaker) in enumerate((("a", VIVIAN), ("b", VIVIAN), ("c", RYAN)))]
    for got, want in zip(runs["shadow"], runs["off"], strict=True):
        assert all_equal(got[0], want[0]) and all_equal(got[1], want[1]) and got[2] == want[2] == 10
    assert shadow.kv.stats(LABEL).hit_tokens == 0
    s = shadow.kv.shadow_stats(LABEL)
    assert s.requests == 3 and s.matched_pages * P == on.kv.stats(LABEL).hit_tokens == 2 * P + P
