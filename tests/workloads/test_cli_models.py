"""``mmcache replay`` with model workloads, in process: reports written, bad input refused with exit status 2."""

import json

import pytest
import torch

from workloads import registry
from workloads.cli import main


@pytest.fixture(autouse=True)
def models_in_tmp(tmp_path_factory, monkeypatch):
    """Tiny models go to a temporary folder (ModelWorkloadOptions reads $MMCACHE_MODEL_DIR), never to ~/.cache."""
    monkeypatch.setenv("MMCACHE_MODEL_DIR", str(tmp_path_factory.getbasetemp() / "models"))


def test_vlm_chat_writes_json_and_html(tmp_path, capsys):
    out, page = tmp_path / "vlm.json", tmp_path / "vlm.html"
    threads = torch.get_num_threads()
    assert main(["replay", "vlm-chat", "--limit", "4", "--json", str(out), "--html", str(page), "--slo-ttft", "5",
                 "--max-new-tokens", "3", "--metrics-port", "0", "--no-progress"]) == 0
    assert torch.get_num_threads() == threads  # restored after the run
    printed = capsys.readouterr().out
    assert "vlm-chat (embedded default)" in printed and "Prometheus metrics on http://127.0.0.1:" in printed
    assert "TTFT p99 (ms)" in printed and "image hit rate (items)" in printed and "of ceiling" in printed
    doc = json.loads(out.read_text())
    assert doc["workload"] == "vlm-chat" and doc["slo"] == "TTFT <= 5000 ms"
    for run in ("off", "on"):
        s = doc["summary"][run]
        assert s["completed"] == 4 and s["goodput_rps"] > 0
        assert 0 < s["latency_s"]["ttft"]["p50"] <= s["latency_s"]["ttft"]["p99"]
    assert doc["summary"]["on"]["hit_rate"]["prefix"] > 0 == doc["summary"]["off"]["hit_rate"]["prefix"]
    assert all(r["tokens"] == 3 for r in doc["requests"]["on"])
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and "vlm-chat" in html and "data:image/png;base64," in html


def test_agent_model_in_flight_serves_through_the_engine(tmp_path, capsys):
    """``--in-flight``: both runs through transformers' continuous batching, cache on with mmcache under it; the
    report names the engine and the requests in flight, and cache on and off generate the same tokens."""
    out = tmp_path / "agent.json"
    assert main(["replay", "agent-model", "--limit", "6", "--in-flight", "3", "--schedule", "closed:3",
                 "--max-new-tokens", "3", "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "via transformers continuous batching (ContinuousBatchingManager), 3 in flight" in printed
    assert "outputs equal cache off / on: 6 of 6 requests" in printed
    doc = json.loads(out.read_text())
    assert "3 in flight" in doc["schedule"]
    on, off = doc["summary"]["on"], doc["summary"]["off"]
    assert on["completed"] == off["completed"] == 6 and on["hit_rate"]["prefix"] > 0 == off["hit_rate"]["prefix"]
    assert all(r["tokens"] == 3 and r["ttft_s"] > 0 for r in doc["requests"]["on"])
    assert on["cache_stats"]["prefix"]["requests_live"] == 0


def test_voice_mstar_serves_through_m_star_s_engine(tmp_path, capsys):
    """``voice-mstar``: both runs through M*'s Engine (Orpheus LLM + SNAC decoder), N in flight; the report names the
    engine and N, and the generated codes are equal off and on."""
    from mmcache.mstar.requirement import why_unavailable
    if why_unavailable():
        pytest.skip(why_unavailable())
    out = tmp_path / "voice.json"
    assert main(["replay", "voice-mstar", "--limit", "3", "--in-flight", "2", "--schedule", "closed:2",
                 "--max-new-tokens", "4", "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "via M*'s Engine (mstar-ai 0.2.1: Orpheus LLM + SNAC decoder nodes), 2 in flight" in printed
    assert "generated code ids (greedy) equal cache off / on: 3 of 3 requests" in printed
    assert "TTFA p99 (ms)" in printed and "TTFT p50 (ms)" in printed
    doc = json.loads(out.read_text())
    for r in doc["requests"]["on"] + doc["requests"]["off"]:
        assert r["tokens"] == 4 * 7 and r["audio_chunks"] >= 1 and r["ttfa_s"] >= r["ttft_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["replay", "vlm-caht"], "unknown workload 'vlm-caht'"),
    (["replay", "vlm-chat", "--schedule", "burst:3"], "not a schedule: 'burst:3'"),
    (["replay", "vlm-chat", "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["replay", "vlm-chat", "--order", "round-robin"], "--order: only for trace replays"),
    (["replay", "--schedule", "closed:2"], "--schedule: only for model workloads"),
    (["replay", "vlm-chat", "--in-flight", "4"], "cannot be served through transformers' continuous-batching"),
    (["replay", "agent-model", "--in-flight", "0"], "--in-flight must be >= 1"),
])
def test_clear_errors(argv, message, capsys):
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmcache: error: ") and message in err and "Traceback" not in err


def test_unknown_workload_lists_the_model_workloads(capsys):
    assert main(["replay", "no-such-workload"]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in registry.MODEL_WORKLOADS)


def test_unreadable_model_folder(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbled").mkdir()
    (tmp_path / "garbled" / "config.json").write_text("{oops")
    (tmp_path / "wrong").mkdir()
    (tmp_path / "wrong" / "config.json").write_text("{}")
    cases = {"missing": "no such folder", "empty": "no config.json", "garbled": "cannot read",
             "wrong": "cannot build workload 'vlm-chat' with --model"}
    for folder, message in cases.items():
        assert main(["replay", "vlm-chat", "--model", str(tmp_path / folder), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_data_flag_resolves_the_shared_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MMCACHE_DATA", str(tmp_path))
    assert main(["replay", "vlm-chat", "--data", "--no-progress"]) == 2
    err = capsys.readouterr().err  # the same message as for trace workloads, naming the place looked
    assert f"no data for workload 'vlm-chat': looked for {tmp_path / 'mmmu'}" in err and "from $MMCACHE_DATA" in err
    (tmp_path / "mmmu").mkdir()
    (tmp_path / "mmmu" / "mmmu_pro_tool_sample_questions.jsonl").write_text('{"question": 1}\n')
    assert main(["replay", "vlm-chat", "--data", str(tmp_path), "--no-progress"]) == 2
    assert "mmmu_pro_tool_sample_questions.jsonl:1: " in capsys.readouterr().err  # the file and line


def test_pool_and_store_sizes_reach_the_workload_options():
    from workloads.cli import build_parser
    from workloads.commands.model_replay import workload_options

    args = build_parser().parse_args(["replay", "vlm-chat", "--pool-pages", "512", "--encoder-bytes", "64M"])
    options = workload_options(args)
    assert options.pool_pages == 512 and options.encoder_bytes == 64 << 20
