"""MT-Bench (FastChat ``llm_judge/data/mt_bench/question.jsonl``) as two-turn chat sessions that re-send their history.

Each question is one session of two calls, built like every chat log (``workloads.traces.chat``): call 0 sends BOS +
turn 1; call 1 re-sends turn 1 and a reply, then turn 2. The reply is GPT-4's reference answer from
``reference_answer_gpt-4.jsonl`` beside the questions when it has one (math, reasoning and coding questions), else a
fixed stand-in naming the question (MT-Bench records no answers of its own). Read with the shared JSONL policy.
"""

from __future__ import annotations

from pathlib import Path

from workloads.traces.chat import conversation_trace
from workloads.traces.jsonl import check_file, load_jsonl
from workloads.traces.text_trace import TextTrace

ANSWERS = "reference_answer_gpt-4.jsonl"


def _question(row, lineno) -> tuple[int, list[str]]:
    turns = row["turns"]
    if not isinstance(turns, list) or len(turns) < 2 or not all(isinstance(t, str) for t in turns):
        raise ValueError("'turns' must be a list of at least two strings")
    return int(row["question_id"]), turns


def _answers(path: Path) -> dict[int, list[str]]:
    if not path.is_file():
        return {}
    return dict(load_jsonl(path, lambda row, n: (int(row["question_id"]), list(row["choices"][0]["turns"]))))


def load_mt_bench(path: str | Path, limit: int | None = None, tokenizer=None) -> TextTrace:
    """At most ``limit`` questions of ``question.jsonl`` (or of the folder holding it) as two-call sessions."""
    path = Path(path)
    path = check_file(path / "question.jsonl" if path.is_dir() else path)
    answers = _answers(path.parent / ANSWERS)
    convs = []
    for qid, turns in load_jsonl(path, _question, limit):
        replies = answers.get(qid, [f"(answer to question {qid}, turn {k + 1})" for k in range(len(turns))])
        conv = [m for k, t in enumerate(turns) for m in (("user", t), ("assistant", replies[k]))]
        convs.append((f"mt-bench-{qid}", conv))
    return conversation_trace(path, "mt-bench", convs, tokenizer)
