"""``mmcache`` tried as a new user would: a fast --help, outputs checked first, clear messages for bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workloads import registry
from workloads.cli import main
from workloads.commands import common
from workloads.harness.metrics import RequestRecord, RunResult, failure_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def models_in_tmp(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("MMCACHE_MODEL_DIR", str(tmp_path_factory.getbasetemp() / "models"))


@pytest.mark.parametrize("argv", [["--help"], ["replay", "--help"]])
def test_help_imports_no_torch(argv):
    code = ("import sys\nfrom workloads.cli import main\ntry:\n    main(%r)\nexcept SystemExit as e:\n"
            "    assert e.code == 0\nheavy = [m for m in ('torch', 'transformers', 'diffusers', 'mmcache',"
            " 'matplotlib') if m in sys.modules]\nassert not heavy, heavy\n" % argv)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "usage: mmcache" in proc.stdout


BAD_FLAGS = [  # (argv, the one line it fails with): every flag is checked before torch and the cache are imported
    (["replay", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["replay", "--sessions", "0"], "--sessions must be >= 1, got 0"),
    (["replay", "--in-service", "0"], "--in-service must be >= 1, got 0"),
    (["replay", "--in-flight", "0"], "--in-flight: only for model workloads"),
    (["replay", "--prefill-rate", "0"], "--prefill-rate must be > 0"),
    (["replay", "--metrics-port", "70000"], "--metrics-port must be in [0, 65535], got 70000"),
    (["replay", "--metrics-linger", "5"], "--metrics-linger: needs --metrics-port"),
    (["replay", "--encoder-s", "1"], "--encoder-s: only with --replicas on a model workload"),
    (["replay", "--schedule", "closed:1"], "--schedule: only for model workloads"),
    (["replay", "--eviction", "bogus"], "unknown eviction policy bogus"),
    (["replay", "no-such-trace.jsonl"], "no-such-trace.jsonl: no such file or folder"),
    (["replay", "agent", "--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["replay", "vlm-chat", "--page-size", "0"], "--page-size must be > 0, got 0"),
    (["replay", "vlm-chat", "--in-flight", "0"], "--in-flight must be >= 1, got 0"),
    (["replay", "vlm-chat", "--pool-pages", "0"], "--pool-pages must be > 0, got 0"),
    (["replay", "vlm-chat", "--max-new-tokens", "0"], "--max-new-tokens must be > 0, got 0"),
    (["replay", "vlm-chat", "--schedule", "poisson:0"], "poisson takes a rate in requests/s > 0"),
    (["replay", "vlm-chat", "--order", "round-robin"], "--order: only for trace replays"),
    (["replay", "vlm-chat", "--model", "/no/such/model"], "--model /no/such/model: no such folder"),
]


def test_every_bad_flag_fails_in_one_line_before_torch_is_imported(tmp_path):
    """In one fresh interpreter, each bad flag in turn: status 2, one line on stderr, and no torch imported by any
    of them (a bad flag fails in a fraction of a second, not after seconds of imports)."""
    code = """
import contextlib, io, json, sys
from workloads.cli import main
out = []
for argv, _ in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out.append([rc, err.getvalue()])
print(json.dumps({"runs": out, "torch": "torch" in sys.modules}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(BAD_FLAGS)], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for (argv, message), (rc, err) in zip(BAD_FLAGS, result["runs"]):
        assert rc == 2 and len(err.splitlines()) == 1 and message in err, (argv, rc, err)
    assert not result["torch"]


def test_a_json_document_given_as_json_lines_is_named_as_such(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}],
                                indent=1))
    assert main(["replay", str(trace), "--format", "mooncake", "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"mmcache: error: {trace}: one JSON document (a list over several lines), not "
                                       "JSON Lines: this format reads one JSON record per line\n")


def test_an_output_this_user_may_not_write_says_so(tmp_path, capsys, monkeypatch):
    """Run as root the folder's mode bits do not bind, so the check's answer is what is stood in for."""
    monkeypatch.setattr(common.os, "access", lambda path, mode: False)
    assert main(["replay", "--json", str(tmp_path / "out.json"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"mmcache: error: --json {tmp_path / 'out.json'}: this user may not create "
                                       f"files in folder {tmp_path}\n")
    (tmp_path / "out.json").write_text("{}")
    assert main(["replay", "--json", str(tmp_path / "out.json"), "--no-progress"]) == 2
    assert "the file exists and this user may not write it" in capsys.readouterr().err


def test_one_request_and_one_session_are_singular(tmp_path, capsys):
    log = tmp_path / "one.jsonl"
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "Name a prime."}]}) + "\n"
                   + json.dumps({"messages": []}) + "\n")
    assert main(["replay", str(log), "--pool-tokens", "inf", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert ": 1 request, each its own session," in captured.out
    assert captured.err.endswith(": 1 line without messages\n")


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_unwritable_output_fails_before_the_run(tmp_path, flag, capsys, monkeypatch):
    monkeypatch.setattr("workloads.registry.load", lambda *a, **k: pytest.fail("the replay ran"))
    assert main(["replay", flag, str(tmp_path / "missing" / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    missing = tmp_path / "missing"
    assert err == f"mmcache: error: {flag} {missing / 'out'}: folder {missing} does not exist\n"
    assert main(["replay", flag, str(tmp_path), "--no-progress"]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_unwritable_html_fails_before_building_the_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("workloads.registry.model_factory", lambda *a: pytest.fail("the model was built"))
    assert main(["replay", "vlm-chat", "--html", str(tmp_path / "no" / "r.html"), "--no-progress"]) == 2
    assert "--html" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["replay", "--limit", "0"], "--limit: must be a positive number of requests/sessions, got 0"),
    (["replay", "--limit", "1k"], "--limit: must be a positive whole number of requests/sessions"),
    (["replay", "vlm-chat", "--encoder-bytes", "12QB"], "it must be finite and positive, with units k, M, G"),
    (["replay", "vlm-chat", "--encoder-bytes", "inf"], "it must be finite"),
    (["replay", "vlm-chat", "--metrics-linger", "-1"], "--metrics-linger: must be a finite number of seconds"),
])
def test_usage_errors_say_what_is_valid(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_encoder_bytes_units():
    assert common.byte_size("256M") == common.byte_size("256MB") == 256 << 20 and common.byte_size("2gb") == 2 << 30
    assert common.byte_size("4096") == 4096


def test_linger_needs_a_metrics_port(capsys):
    assert main(["replay", "vlm-chat", "--metrics-linger", "5", "--no-progress"]) == 2
    assert "--metrics-linger: needs --metrics-port" in capsys.readouterr().err


def test_same_data_message_for_trace_and_model_workloads(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MMCACHE_DATA", raising=False)
    messages = []
    for name in ("mooncake", "mooncake-model"):
        assert main(["replay", name, "--data", str(tmp_path), "--no-progress"]) == 2
        messages.append(capsys.readouterr().err)
    path = tmp_path / "mooncake" / "conversation_trace.jsonl"
    for err, name in zip(messages, ("mooncake", "mooncake-model")):
        assert f"no data for workload '{name}': looked for {path} (from --data" in err
        assert "$MMCACHE_DATA not set" in err and str(registry.default_data()) in err  # the fallback this clone has


def test_mooncake_requests_are_their_own_sessions(capsys):
    assert main(["replay", "--limit", "50", "--pool-tokens", "inf", "--no-progress"]) == 0
    assert "50 requests, each its own session" in capsys.readouterr().out


def _failed(rid, kind, message):
    return RequestRecord(rid, rid, 0.0, 0.0, 0.1, None, f"request {rid!r}: {message}", error_type=kind)


def test_failure_lines_give_count_and_first_reason_per_class():
    on = RunResult("w", True, "trace", {}, records=[_failed("a", "OutOfPages", "pool full (2 pages)"),
                                                   _failed("b", "OutOfPages", "pool full again"),
                                                   _failed("c", "InvalidMedia", "missing.png")])
    assert failure_lines(RunResult("w", False, "trace", {}), on) == [
        "cache on: 2 failed with OutOfPages, first: request 'a': pool full (2 pages)",
        "cache on: 1 failed with InvalidMedia, first: request 'c': missing.png"]


def test_model_replay_prints_failures_service_time_and_the_pool_note(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", "vlm-chat", "--limit", "3", "--max-new-tokens", "2", "--pool-pages", "2",
                 "--json", str(out), "--no-progress"]) == 1  # every cache-on request failed: not a success
    captured = capsys.readouterr()
    printed = captured.out
    assert captured.err.splitlines()[-1].startswith("mmcache: error: every request failed with the cache on")
    assert "failed: cache on: 1 failed with OutOfPages, first: request 'i0u0t0': out of pages" in printed
    assert "failed: cache on: 2 failed with InvalidRequest, first: request 'i0u0t1'" in printed
    assert "bound the cache-on run only" in printed and "service time p50 (ms)" in printed
    assert json.loads(out.read_text())["summary"]["on"]["failures"]


def test_metrics_linger_serves_the_final_state(tmp_path, capsys, lingering_scrape):
    scraped = lingering_scrape
    assert main(["replay", "vlm-chat", "--limit", "2", "--max-new-tokens", "2", "--metrics-port", "0",
                 "--metrics-linger", "0.5", "--no-progress"]) == 0
    assert "serving the final metrics on http://127.0.0.1:" in capsys.readouterr().out
    assert 'mmcache_requests_total{outcome="ok"} 4.0' in scraped["text"]  # both runs, after the replay


def test_quiet_third_party_progress(monkeypatch):
    from transformers.utils import logging as tlog

    from workloads.harness.progress import quiet_third_party
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    tlog.enable_progress_bar()
    try:
        quiet_third_party()
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and not tlog.is_progress_bar_enabled()
    finally:
        os.environ.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        tlog.enable_progress_bar()
