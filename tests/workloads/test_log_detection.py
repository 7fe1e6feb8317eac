"""Request logs and conversation logs told apart by what their lines hold (``workloads.traces.chat_kind``), never
by how they end: a conversation that closes with the user's last message is still a conversation, and a request log
that records each reply on its request's line is still a request log. The header says which reading was taken, why,
and the ``--format`` that takes the other."""

import json

import pytest

from workloads.cli import main
from workloads.traces.chat import load_openai_chat
from workloads.traces.chat_kind import CONVERSATIONS, REQUESTS, tell_kind

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")

SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer in full sentences. " * 8}


def _turns(s: int, turns: int) -> list[dict]:
    """Session ``s``: system, then ``turns`` user/assistant exchanges, each long enough to fill pages."""
    msgs = [SYSTEM]
    for t in range(turns):
        msgs += [{"role": "user", "content": f"session {s} question {t}: " + "tell me more about it. " * 20},
                 {"role": "assistant", "content": f"answer {t} of session {s}: " + "here is more about it. " * 20}]
    return msgs


def _write(tmp_path, name, rows) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return str(path)


def conversations_ending_in_a_user_turn(tmp_path, n=6, turns=4):
    """A conversation log: each line a whole conversation that closes with the user's last, unanswered message."""
    return _write(tmp_path, "trajectories.jsonl",
                  [_turns(s, turns) + [{"role": "user", "content": f"one last thing, session {s}"}] for s in range(n)])


def requests_ending_in_an_assistant_turn(tmp_path, n=4, turns=3):
    """A request log that records each reply on its request's line: every line ends in the assistant's turn and
    re-sends the lines of its session before it."""
    return _write(tmp_path, "requests.jsonl", [_turns(s, t + 1) for t in range(turns) for s in range(n)])


def _replay(path, *extra, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", path, "--pool-tokens", "inf", "--json", str(out), "--no-progress", *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_a_conversation_log_ending_in_a_user_turn_is_read_as_conversations(tmp_path, capsys):
    path = conversations_ending_in_a_user_turn(tmp_path)
    trace = load_openai_chat(path)
    assert trace.kind == CONVERSATIONS and len(trace.sessions) == 6 and trace.num_requests == 6 * 4
    doc, printed = _replay(path, tmp_path=tmp_path, capsys=capsys)
    assert doc["kind"] == CONVERSATIONS
    assert ("told from the content: no line re-sends an earlier line's messages, and 6 of 6 hold earlier turns of "
            "their conversation; --format openai-requests reads it as a request log") in printed
    forced, _ = _replay(path, "--format", "openai-requests", tmp_path=tmp_path, capsys=capsys)
    assert forced["kind"] == REQUESTS and forced["requests"] == 6  # the misreading: one request a line
    assert doc["ceiling_hit_rate"] > 2 * forced["ceiling_hit_rate"]  # each call re-sends its conversation so far


def test_a_request_log_ending_in_an_assistant_turn_is_read_as_requests(tmp_path, capsys):
    path = requests_ending_in_an_assistant_turn(tmp_path)
    trace = load_openai_chat(path)
    assert trace.kind == REQUESTS and len(trace.sessions) == 4 and trace.num_requests == 12 and not trace.skipped
    for s in trace.sessions:  # each line's reply is its output, and the next request re-sends it
        assert [c.output_len > 0 for c in s.calls] == [True] * 3
        first, second = s.build(0), s.build(1)
        assert list(second.token_ids[:first.prompt_len + first.output_len]) == [*first.token_ids, *first.output_ids]
    doc, printed = _replay(path, tmp_path=tmp_path, capsys=capsys)
    assert doc["kind"] == REQUESTS and doc["requests"] == 12 and doc["sessions"] == 4
    assert ("told from the content: 8 of 12 lines re-send an earlier line's messages; --format openai-conversations "
            "reads it as a conversation log") in printed
    as_conversations, _ = _replay(path, "--format", "openai-conversations", tmp_path=tmp_path, capsys=capsys)
    assert as_conversations["kind"] == CONVERSATIONS and as_conversations["requests"] == 4 * (1 + 2 + 3)


def test_a_request_log_ending_in_a_user_turn_is_read_as_requests(tmp_path):
    rows = [_turns(s, t)[:-1] if t else [SYSTEM, {"role": "user", "content": f"hello from {s}"}]
            for t in range(3) for s in range(3)]  # history re-sent, the new question last, no reply recorded
    trace = load_openai_chat(_write(tmp_path, "r.jsonl", rows))
    assert trace.kind == REQUESTS and trace.told.startswith("3 of 9 lines re-send")


def test_single_exchanges_are_read_as_requests_and_say_so(tmp_path, capsys):
    rows = [[SYSTEM, {"role": "user", "content": f"question {k}"}] + ([{"role": "assistant", "content": "yes"}]
                                                                      if k % 2 else []) for k in range(4)]
    path = _write(tmp_path, "single.jsonl", rows)
    trace = load_openai_chat(path)
    assert trace.kind == REQUESTS and trace.num_requests == 4
    _, printed = _replay(path, tmp_path=tmp_path, capsys=capsys)
    assert "each line is one exchange, replayed as one request; --format openai-conversations" in printed


def test_a_forced_reading_says_nothing_about_the_content(tmp_path, capsys):
    path = conversations_ending_in_a_user_turn(tmp_path, n=2)
    _, printed = _replay(path, "--format", "openai-conversations", tmp_path=tmp_path, capsys=capsys)
    assert "told from the content" not in printed


def test_tell_kind_counts_only_lines_that_extend_an_earlier_one():
    a = [("system", "s"), ("user", "q")]
    b = a + [("assistant", "r"), ("user", "q2")]
    assert tell_kind([a, b])[0] == REQUESTS
    assert tell_kind([b, a])[0] == CONVERSATIONS  # a line that an earlier one extends re-sends nothing
    assert tell_kind([b, b])[0] == CONVERSATIONS  # a repeated line says nothing either way
    assert tell_kind([a, [("system", "s"), ("user", "other")]]) == (REQUESTS, tell_kind([a])[1])


def test_a_log_of_requests_each_ending_in_a_user_turn_replays_every_request(tmp_path, capsys):
    """Issue 42's case: each line is the conversation so far, ending in the user's new turn. Told by content, it
    replays as many requests and prompt tokens as --format openai-requests does (before: 3 requests became 2)."""
    system, q = {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}
    rows = [[system, q], [system, q, {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"}],
            [system, q, {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"},
             {"role": "assistant", "content": "11"}, {"role": "user", "content": "And one more?"}]]
    path = _write(tmp_path, "my_requests.jsonl", rows)
    told, printed = _replay(path, tmp_path=tmp_path, capsys=capsys)
    forced, _ = _replay(path, "--format", "openai-requests", tmp_path=tmp_path, capsys=capsys)
    assert told["kind"] == REQUESTS and told["requests"] == forced["requests"] == 3
    assert told["prompt_tokens"] == forced["prompt_tokens"]
    assert "3 requests in 1 session," in printed and "told from the content: 2 of 3 lines re-send" in printed
