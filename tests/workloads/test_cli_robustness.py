"""What a new user runs into: a core-only install, Ctrl-C, an output that cannot be written, one-line messages."""

import json
import sys
from pathlib import Path

import pytest

import tiny_workload
from workloads import registry
from workloads.cli import main
from workloads.output_files import write_atomic
from workloads.sizing import sweep

CHAT = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello, how can I help"}]


def test_core_only_replay_runs_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["replay", "--limit", "30", "--pool-tokens", "inf"]) == 0
    captured = capsys.readouterr()
    assert "realized reuse" in captured.out and "no progress bars (tqdm is missing" in captured.err


def test_chat_log_without_the_tokenizer_says_which_extra(tmp_path, monkeypatch, capsys):
    log = tmp_path / "chat.jsonl"
    log.write_text(json.dumps({"messages": CHAT}) + "\n")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    from workloads.traces.tokenizer import load_tokenizer
    load_tokenizer.cache_clear()
    assert main(["replay", str(log), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs sentencepiece (the 'replay' extra): pip install -e \".[replay]\"" in err


def test_plot_without_matplotlib_fails_before_the_replay(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(registry, "load", lambda *a, **k: pytest.fail("the replay ran"))
    assert main(["replay", "--plot", str(tmp_path / "p.png"), "--no-progress"]) == 2
    assert "--plot needs matplotlib (the 'replay' extra)" in capsys.readouterr().err


def test_ctrl_c_in_a_sweep_keeps_the_finished_pool_sizes(tmp_path, monkeypatch, capsys):
    real, calls = sweep.replay_trace, []

    def interrupt_at_1m(*a, **k):
        calls.append(k["pool_tokens"])
        if k["pool_tokens"] == 1 << 20:  # the ceiling, 64k and its optimum, then Ctrl-C during 1M
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep, "replay_trace", interrupt_at_1m)
    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "100", "--pool-tokens", "64k,1M,4M", "--json", str(out), "--no-progress"]) == 130
    printed = capsys.readouterr().out
    assert "partial: interrupted (Ctrl-C) after 1 of 3 pool sizes" in printed and "64k" in printed
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and [r["pool_tokens"] for r in doc["runs"]] == [65536]


def test_ctrl_c_in_a_model_replay_compares_what_both_runs_served(tmp_path, monkeypatch, capsys):
    tiny_workload.use(monkeypatch, interrupt_on=3)
    out = tmp_path / "r.json"
    assert main(["replay", "image-gen", "--json", str(out), "--no-progress"]) == 130
    printed = capsys.readouterr().out
    assert "partial: interrupted (Ctrl-C) in the cache-on run; the table compares the first 2 of 4 requests" in printed
    summary = json.loads(out.read_text())["summary"]
    assert summary["off"]["completed"] == summary["on"]["completed"] == 2


@pytest.mark.parametrize("flag, path", [("--json", "/dev/full"), ("--html", "/proc/out.html")])
def test_a_failed_write_keeps_the_results(flag, path, monkeypatch, capsys):
    if not Path(path).parent.exists() or (flag == "--json" and not Path(path).exists()):
        pytest.skip(f"{path} is not on this system")
    tiny_workload.use(monkeypatch)
    args = ["--json", "/dev/full"] if flag == "--json" else ["--html", path, "--json", "/dev/full"]
    assert main(["replay", "image-gen", *args, "--no-progress"]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mmcache: error: ")]
    assert lines and all("the results are in " in line for line in lines)
    fallback = Path(lines[-1].rsplit("the results are in ", 1)[1].split(" instead")[0])
    assert json.loads(fallback.read_text())["summary"]["on"]["completed"] == 4
    fallback.unlink()


def test_atomic_write_leaves_the_old_file_when_it_fails(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    target.write_text("old")

    monkeypatch.setattr("os.replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        write_atomic(target, b"new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_argparse_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["replay", "--order", "sideways"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("mmcache replay: error: argument --order: invalid choice: 'sideways'")


def test_bad_schedule_rate_says_what_it_takes(capsys):
    assert main(["replay", "image-gen", "--schedule", "poisson:fast", "--no-progress"]) == 2
    assert "bad schedule 'poisson:fast': poisson takes a rate in requests/s > 0" in capsys.readouterr().err


def test_truncated_jsonl_line_says_where(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                     '{"timestamp": 1, "inp\n')
    assert main(["replay", str(trace), "--format", "mooncake", "--no-progress"]) == 2
    assert f"{trace}:2: not JSON: Unterminated string starting at (column 18)" in capsys.readouterr().err
