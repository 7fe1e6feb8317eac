"""Users' own logs: OpenAI chat JSONL and ShareGPT JSON, format detection, tokenizers, and mini-swe-agent's layout."""

import json

import numpy as np
import pytest

from mmcache.errors import TraceError
from workloads import registry
from workloads.cli import main
from workloads.traces.chat import detect_format, load_openai_chat, load_sharegpt

pytest.importorskip("sentencepiece")
pytest.importorskip("mistral_common")

CONV = [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "what is 2+2?"),
        ("assistant", "4")]


def openai_file(tmp_path, n=3):
    path = tmp_path / "chat.jsonl"
    rows = [json.dumps({"messages": [{"role": r, "content": f"{c} #{k}" if r == "user" else c} for r, c in CONV]})
            for k in range(n)]
    path.write_text("\n".join(rows[:1] + [""] + rows[1:]) + "\n")
    return path


def sharegpt_file(tmp_path):
    who = {"user": "human", "assistant": "gpt", "system": "system"}
    data = [{"conversations": [{"from": who[r], "value": c} for r, c in CONV]},
            {"conversations": [{"from": "gpt", "value": "greeting only"}]},       # nothing to replay: skipped
            {"conversations": [{"from": "human", "value": [{"type": "text", "text": "look"}, {"type": "image_url"}]},
                               {"from": "gpt", "value": "a cat"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def check_history_resent(trace):
    for sess in trace.sessions:
        prev = None
        for i, info in enumerate(sess.calls):
            req = sess.build(i)
            assert req.prompt_len == info.prompt_len and req.output_ids.size == info.output_len
            if prev is not None:
                head = np.concatenate([prev.token_ids, prev.output_ids])
                assert np.array_equal(req.token_ids[:head.size], head) and req.prompt_len > head.size
            prev = req


def test_openai_chat_sessions_resend_their_history(tmp_path):
    trace = load_openai_chat(openai_file(tmp_path), limit=2)
    assert trace.kind == "openai-conversations" and [s.name for s in trace.sessions] == ["chat-1", "chat-3"]
    assert trace.num_requests == 4 and [c.arrival_s for c in trace.sessions[0].calls] == [0.0, 1.0]
    check_history_resent(trace)


def test_openai_chat_malformed_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n" + '{"prompt": "x"}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: expected an object with a 'messages'"):
        load_openai_chat(path)


def test_sharegpt_roles_parts_and_skips(tmp_path):
    trace = load_sharegpt(sharegpt_file(tmp_path))
    assert [s.name for s in trace.sessions] == ["sharegpt-0", "sharegpt-2"] and trace.num_requests == 3
    check_history_resent(trace)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "human"}]}]))
    with pytest.raises(TraceError, match=r"entry 0: message 0 needs"):
        load_sharegpt(bad)


def test_detect_format(tmp_path):
    assert detect_format(openai_file(tmp_path)) == "openai"
    assert detect_format(sharegpt_file(tmp_path)) == "sharegpt"
    assert detect_format(tmp_path) == "swe-agent"
    (tmp_path / "m.jsonl").write_text('\n{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}\n')
    assert detect_format(tmp_path / "m.jsonl") == "mooncake"


def test_tokenizer_json_and_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<s>": 0, "[UNK]": 1, **{w: k + 2 for k, w in enumerate("hi hello what is 2+2? 4 be brief [user] "
                                                                      "[assistant] [system] #0 #1 #2".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    path = openai_file(tmp_path)
    for where in (tmp_path / "tok", tmp_path / "tok" / "tokenizer.json"):
        trace = registry.load("openai", path, tokenizer=where)
        req = trace.sessions[0].build(0)
        assert req.token_ids[0] == 0 and 1 not in req.token_ids.tolist()  # BOS, then known words only
        check_history_resent(trace)
    with pytest.raises(TraceError, match="no tokenizer.json or tokenizer.model"):
        registry.load("openai", path, tokenizer=tmp_path)


def test_cli_replays_chat_logs(tmp_path, capsys):
    for path, fmt, header in ((openai_file(tmp_path), "openai-conversations", "OpenAI conversation log"),
                              (sharegpt_file(tmp_path), "sharegpt", "sharegpt trace")):
        out = tmp_path / f"{fmt}.json"
        assert main(["replay", str(path), "--pool-tokens", "inf", "--json", str(out), "--no-progress"]) == 0
        assert header in capsys.readouterr().out
        doc = json.loads(out.read_text())
        assert doc["kind"] == fmt and doc["page_size"] == 128
    assert main(["replay", str(openai_file(tmp_path)), "--format", "sharegpt", "--no-progress"]) == 2
    assert "not a JSON file" in capsys.readouterr().err


def test_swe_agent_reads_the_mini_swe_agent_layout(tmp_path, capsys):
    good = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task"},
                         {"role": "assistant", "content": "ls"}]}
    for name in ("b", "a"):
        (tmp_path / "trajs" / name).mkdir(parents=True)
        (tmp_path / "trajs" / name / f"{name}.traj.json").write_text(json.dumps(good))
    assert [s.name for s in registry.load("swe-agent", tmp_path).sessions] == ["a", "b"]
    assert main(["replay", str(tmp_path / "trajs"), "--pool-tokens", "inf", "--no-progress"]) == 0
    assert "2 requests, each its own session" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    assert main(["replay", str(tmp_path / "empty"), "--no-progress"]) == 2
    assert "*/*.traj.json (mini-swe-agent's trajs/<id>/<id>.traj.json)" in capsys.readouterr().err


def request_log(tmp_path, sessions=((1, 8), (2, 4), (3, 2))):
    """A request log: every line one request that re-sends its history and ends in the user's turn."""
    lines, s = [], 0
    for turns, count in sessions:
        for _ in range(count):
            hist = [{"role": "system", "content": "be brief"}]
            for t in range(turns):
                hist = hist + [{"role": "user", "content": f"session {s} question {t}"}]
                lines.append(json.dumps({"model": "m", "messages": hist}))
                hist = hist + [{"role": "assistant", "content": f"answer {t} of session {s}"}]
            s += 1
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_request_log_replays_every_request_as_sent(tmp_path):
    trace = load_openai_chat(request_log(tmp_path))
    assert trace.kind == "openai-requests" and trace.num_requests == 22 and len(trace.sessions) == 14
    assert not trace.skipped
    check_history_resent(trace)
    arrivals = sorted(c.arrival_s for s in trace.sessions for c in s.calls)
    assert arrivals == [float(k) for k in range(22)]  # in file order
    three = trace.sessions[-1]
    assert [c.output_len > 0 for c in three.calls] == [True, True, False]  # the last reply is not in the log


def test_request_log_counts_what_it_skips(tmp_path, capsys):
    path = request_log(tmp_path, sessions=((1, 3),))
    with open(path, "a") as f:
        f.write(json.dumps({"messages": []}) + "\n")
        f.write(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
                + "\n")
    trace = load_openai_chat(path)  # the last line holds its reply: one request more, with its output
    assert trace.num_requests == 4 and trace.skipped == {"line without messages": 1}
    assert trace.sessions[-1].calls[0].output_len > 0
    assert main(["replay", str(path), "--pool-tokens", "inf", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "OpenAI request log (a line a request)" in captured.out
    assert "4 requests, each its own session" in captured.out
    assert "note: not replayed from" in captured.err and "1 line without messages" in captured.err


def test_format_names_the_kind_of_openai_log(tmp_path):
    path = request_log(tmp_path)
    as_conversations = registry.load("openai-conversations", path)  # each line's own request is then not replayed
    assert as_conversations.kind == "openai-conversations" and as_conversations.num_requests == 10
    assert as_conversations.skipped == {"conversation without an assistant reply after a message": 14,
                                        "final turn without a reply (not replayed)": 8}
    as_requests = registry.load("openai-requests", openai_file(tmp_path))  # each line one request, with its reply
    assert as_requests.num_requests == 3 and not as_requests.skipped
    assert all(s.calls[0].output_len > 0 for s in as_requests.sessions)


def test_conversation_log_counts_an_unanswered_final_turn(tmp_path):
    path = tmp_path / "c.jsonl"
    conv = [{"role": r, "content": c} for r, c in CONV] + [{"role": "user", "content": "and 3+3?"}]
    path.write_text(json.dumps({"messages": conv}) + "\n" + json.dumps({"messages": conv[:-1]}) + "\n")
    trace = load_openai_chat(path)
    assert trace.kind == "openai-conversations" and trace.num_requests == 4
    assert trace.skipped == {"final turn without a reply (not replayed)": 1}
