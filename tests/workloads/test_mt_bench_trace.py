"""MT-Bench as two-turn chat sessions: turn 2 re-sends turn 1 and a reply (GPT-4's reference answer when there is
one), bad lines are refused with their line number."""

import json

import numpy as np
import pytest

from mmcache.errors import TraceError
from workloads.traces.mt_bench import load_mt_bench

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")


def write(tmp_path, questions, answers=None):
    (tmp_path / "question.jsonl").write_text("\n".join(json.dumps(q) for q in questions) + "\n")
    if answers is not None:
        (tmp_path / "reference_answer_gpt-4.jsonl").write_text("\n".join(json.dumps(a) for a in answers) + "\n")
    return tmp_path


def test_turn_two_resends_turn_one_and_the_reference_answer(tmp_path):
    folder = write(tmp_path, [{"question_id": 1, "turns": ["what is 2+2?", "and 3+3?"]},
                              {"question_id": 2, "turns": ["name a colour", "another"]}],
                   [{"question_id": 1, "choices": [{"turns": ["four", "six"]}]}])
    trace = load_mt_bench(folder)
    assert [s.name for s in trace.sessions] == ["mt-bench-1", "mt-bench-2"] and trace.num_requests == 4
    for s in trace.sessions:
        first, second = s.build(0), s.build(1)
        assert np.array_equal(second.token_ids[:first.prompt_len], first.token_ids)
        assert np.array_equal(second.token_ids[first.prompt_len:first.prompt_len + first.output_len],
                              first.output_ids)
        assert [c.arrival_s for c in s.calls] == [0.0, 1.0]
    with_answer, stand_in = trace.sessions[0].build(0), trace.sessions[1].build(0)
    assert with_answer.output_len < stand_in.output_len  # "four" vs the stand-in naming the question


def test_a_bad_line_is_refused_with_its_number(tmp_path):
    folder = write(tmp_path, [{"question_id": 1, "turns": ["only one turn"]}])
    with pytest.raises(TraceError, match=r"question\.jsonl.*1"):
        load_mt_bench(folder)


def test_the_real_questions(data_dir):
    trace = load_mt_bench(data_dir / "mt-bench", limit=80)
    assert len(trace.sessions) == 80 and trace.num_requests == 160
