"""The ``mmcache`` command line: in-process ``main([...])`` and a real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workloads import registry
from workloads.cli import main
from workloads.sizes import format_size, parse_size, parse_sizes

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TOP_KEYS = {"page_size", "requests", "prompt_tokens", "ceiling_hit_tokens", "order", "serving", "runs",
            "malformed_lines"}
RUN_KEYS = {"pool_tokens", "hit_tokens", "hit_rate", "evicted_pages", "eviction_batches", "stalls", "failed",
            "requests", "prompt_tokens", "of_ceiling"}


def mooncake_file(tmp_path, bad_lines=()):
    rows = []
    for k in range(40):  # 8 conversations of 5 turns; each turn re-sends the earlier blocks
        conv, turn = k % 8, k // 8
        ids = [0] + [1000 * conv + j for j in range(1, turn + 2)]
        rows.append(json.dumps({"timestamp": 1000 * k, "input_length": 512 * len(ids) - 100, "output_length": 50,
                                "hash_ids": ids}))
    rows[3:3] = list(bad_lines)
    path = tmp_path / "mini_trace.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def check_png(path: Path):
    assert path.stat().st_size > 0
    assert path.read_bytes()[:8] == PNG_MAGIC
    Image = pytest.importorskip("PIL.Image")
    with Image.open(path) as img:
        img.verify()
        assert img.format == "PNG" and img.size[0] > 0 and img.size[1] > 0


def test_sizes():
    assert parse_sizes("64k,1M,inf,4096") == [65536, 1 << 20, None, 4096]
    assert format_size(64 * 1024) == "64k" and format_size(None) == "inf" and format_size(1000) == "1000"
    for bad in ("", "x", "0", "-4k"):
        with pytest.raises(ValueError):
            parse_sizes(bad) if bad == "" else parse_size(bad)


def test_replay_file_in_process_writes_json_and_png(tmp_path, capsys):
    trace = mooncake_file(tmp_path)
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    rc = main(["replay", str(trace), "--pool-tokens", "2k,4k,inf", "--order", "round-robin", "--sessions", "4",
               "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "realized reuse %" in printed and "of ceiling %" in printed and "inf" in printed
    doc = json.loads(out.read_text())
    assert TOP_KEYS <= doc.keys()
    assert doc["page_size"] == 512 and doc["requests"] == 40 and doc["order"] == "round-robin"
    assert doc["serving"] == {"order": "round-robin", "sessions": 4, "in_service": 1, "pin_sessions": False}
    assert doc["malformed_lines"] == 0
    assert [r["pool_tokens"] for r in doc["runs"]] == [2048, 4096, None]
    assert all(RUN_KEYS <= r.keys() for r in doc["runs"])
    assert doc["runs"][-1]["hit_tokens"] == doc["ceiling_hit_tokens"] > 0
    assert all(r["hit_tokens"] <= doc["ceiling_hit_tokens"] for r in doc["runs"])
    check_png(png)


def test_replay_default_embedded_slice(capsys):
    assert main(["replay", "--limit", "300", "--pool-tokens", "1M,inf", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mooncake_slice.jsonl" in out and "300 requests" in out


def test_malformed_line_is_an_error_with_file_and_line(tmp_path, capsys):
    trace = mooncake_file(tmp_path, bad_lines=["{oops", '{"timestamp": 1}'])
    assert main(["replay", str(trace), "--pool-tokens", "inf", "--no-progress"]) == 2
    assert f"mmcache: error: {trace}:4: not JSON" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["replay", "no-such-workload"], "unknown workload 'no-such-workload'"),
    (["replay", "--page-size", "128"], "fix the page size at 512"),
    (["replay", "--in-service", "0"], "--in-service"),
    (["replay", "--sessions", "0"], "--sessions"),
    (["replay", "--in-flight", "2"], "only for model workloads"),
])
def test_clear_errors(argv, message, capsys):
    assert main(argv + ["--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_bad_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--pool-tokens", "64q"])
    assert exc.value.code == 2 and "not a size" in capsys.readouterr().err


def test_named_workload_resolves_through_data_env(tmp_path, monkeypatch, capsys):
    (tmp_path / "mooncake").mkdir()
    mooncake_file(tmp_path).rename(tmp_path / "mooncake" / "conversation_trace.jsonl")
    monkeypatch.setenv("MMCACHE_DATA", str(tmp_path))
    assert main(["replay", "mooncake", "--pool-tokens", "inf", "--no-progress"]) == 0
    assert "conversation_trace.jsonl: 40 requests" in capsys.readouterr().out
    monkeypatch.setenv("MMCACHE_DATA", str(tmp_path / "elsewhere"))
    assert main(["replay", "agent", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"no data for workload 'agent': looked for {tmp_path / 'elsewhere' / 'mini-swe-agent' / 'trajs'}" in err
    assert "from $MMCACHE_DATA" in err and "no --data PATH" in err and str(registry.default_data()) in err


@pytest.mark.slow
def test_subprocess_module_entry_point(tmp_path):
    trace = mooncake_file(tmp_path)
    out, png = tmp_path / "sub.json", tmp_path / "sub.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "workloads", "replay", str(trace), "--pool-tokens", "4k,inf",
                           "--json", str(out), "--plot", str(png)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "realized reuse %" in proc.stdout
    doc = json.loads(out.read_text())
    assert TOP_KEYS <= doc.keys() and len(doc["runs"]) == 2
    check_png(png)
    bad = subprocess.run([sys.executable, "-m", "workloads", "replay", "no-such-workload"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=120)
    assert bad.returncode == 2 and "unknown workload 'no-such-workload'" in bad.stderr


def test_real_agent_by_name(data_dir, tmp_path, capsys):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    out = tmp_path / "agent.json"
    assert main(["replay", "agent", "--data", str(data_dir), "--limit", "2", "--pool-tokens", "64k,inf",
                 "--order", "round-robin", "--sessions", "2", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "swe-agent" and doc["page_size"] == 128 and doc["sessions"] == 2
    assert doc["ceiling_hit_tokens"] > 0.8 * doc["prompt_tokens"]
