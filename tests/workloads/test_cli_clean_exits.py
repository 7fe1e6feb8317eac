"""Every command ends cleanly: Ctrl-C at any stage keeps what finished and writes it; inputs that would hang, blow
up memory or raise deep inside are refused in one line, before anything runs; a run where every request failed is
not a success; ``mmcache data fetch`` works in a fresh clone (a per-user data folder) and says when it fetched
nothing; output files get the user's umask."""

import json
import os
import signal
import stat
import threading
from pathlib import Path

import pytest

import tiny_workload
from workloads import registry
from workloads.cli import main
from workloads.harness import report
from workloads.sizing import memory, plot, replicas, sweep

INTERRUPTED = 130


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mmcache")]


# -- Ctrl-C at every stage ---------------------------------------------------------------------------------------
def test_ctrl_c_after_the_ceiling_before_any_pool_size_keeps_the_ceiling(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    real = sweep.replay_trace

    def interrupt_bounded(*a, **k):
        if k["pool_tokens"] is not None:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep, "replay_trace", interrupt_bounded)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["replay", "--limit", "60", "--pool-tokens", "64k,1M", "--json", str(out), "--plot", str(png),
                 "--no-progress"]) == INTERRUPTED
    captured = capsys.readouterr()
    assert "partial: interrupted (Ctrl-C) after 0 of 2 pool sizes" in captured.out and "Traceback" not in captured.err
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and doc["runs"] == [] and doc["ceiling_hit_tokens"] > 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_ctrl_c_in_a_later_eviction_policy_keeps_the_sweeps_before_it(tmp_path, monkeypatch, capsys):
    real, ceilings = sweep.replay_trace, []

    def interrupt_the_second_ceiling(*a, **k):  # the second policy's unbounded pass: nothing of it measured yet
        ceilings.append(k["pool_tokens"] is None)
        if sum(ceilings) == 2 and ceilings[-1]:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep, "replay_trace", interrupt_the_second_ceiling)
    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "60", "--pool-tokens", "1M", "--eviction", "lru,lfu", "--json", str(out),
                 "--no-progress"]) == INTERRUPTED
    assert "partial: interrupted (Ctrl-C) after 1 of 2 eviction policies" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and [s["eviction"] for s in doc["sweeps"]] == ["lru"]


def test_ctrl_c_between_replica_runs_keeps_the_runs_done(tmp_path, monkeypatch, capsys):
    real, calls = replicas.replay_replicas, []

    def interrupt_the_third(*a, **k):
        calls.append(k["replicas"])
        if len(calls) == 3:  # the R = 1 reference, one run, then Ctrl-C
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(replicas, "replay_replicas", interrupt_the_third)
    out = tmp_path / "r.json"
    assert main(["replay", "--limit", "60", "--replicas", "2", "--router", "random,round-robin", "--json", str(out),
                 "--no-progress"]) == INTERRUPTED
    assert "partial: interrupted (Ctrl-C) after 1 of 2 replica runs" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["interrupted"] and len(doc["runs"]) == 1 and doc["one_pool"]["requests"] == 60


@pytest.fixture(autouse=True)
def terminal_sigint():
    """Python's own SIGINT handler, as at a terminal: a run under ``nohup`` (or a CI runner that starts the suite in
    the background) ignores SIGINT, and the commands leave an ignored Ctrl-C ignored."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _send_ctrl_c_then(real):
    """``real`` after a real SIGINT to this process, as a Ctrl-C at the terminal would send it."""
    def wrapped(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)
    return wrapped


def test_ctrl_c_while_a_model_replay_writes_its_files_writes_them_whole(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    tiny_workload.use(monkeypatch)
    monkeypatch.setattr(report, "report_html", _send_ctrl_c_then(report.report_html))
    html = tmp_path / "r.html"
    assert main(["replay", "image-gen", "--html", str(html), "--no-progress"]) == INTERRUPTED
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    errors = _errors(capsys.readouterr().err)
    assert errors == ["mmcache: interrupted (Ctrl-C) while the results were written; they were written in full "
                      "first"]
    assert html.read_text().rstrip().endswith("</html>")
    assert json.loads(html.with_suffix(".json").read_text())["summary"]["on"]["completed"] == 4


def test_ctrl_c_while_a_sweep_draws_its_plot_writes_it_whole(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(plot, "plot_sweeps", _send_ctrl_c_then(plot.plot_sweeps))
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(["replay", "--limit", "40", "--pool-tokens", "1M,inf", "--json", str(out), "--plot", str(png),
                 "--no-progress"]) == INTERRUPTED
    assert _errors(capsys.readouterr().err) == [
        "mmcache: interrupted (Ctrl-C) while the results were written; they were written in full first"]
    assert len(json.loads(out.read_text())["runs"]) == 2 and png.read_bytes().startswith(b"\x89PNG")


def test_ctrl_c_in_the_cache_off_run_keeps_its_requests_in_the_json(tmp_path, monkeypatch, capsys):
    tiny_workload.use(monkeypatch, interrupt_off=3)
    out = tmp_path / "r.json"
    assert main(["replay", "image-gen", "--json", str(out), "--no-progress"]) == INTERRUPTED
    assert "interrupted (Ctrl-C) in the cache-off run after 2 of 4 requests" in capsys.readouterr().err
    summary = json.loads(out.read_text())["summary"]
    assert summary["off"]["completed"] == 2 and summary["on"]["requests"] == 0


def test_ctrl_c_while_fetching_says_what_stays(tmp_path, monkeypatch, capsys):
    from workloads import datasets

    monkeypatch.setattr(datasets, "fetch", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["data", "fetch", "mooncake", "--data", str(tmp_path)]) == INTERRUPTED
    assert _errors(capsys.readouterr().err) == [
        "mmcache: interrupted (Ctrl-C) while fetching: the files fetched stay; run the command again to resume the "
        "one in progress"]


# -- inputs refused before they are read or built ------------------------------------------------------------------
def _main_within(argv, seconds=60):
    """``main(argv)`` on a thread; its status, or a failure when it has not returned in ``seconds`` (a hang)."""
    result = []
    t = threading.Thread(target=lambda: result.append(main(argv)), daemon=True)
    t.start()
    t.join(seconds)
    assert result, f"mmcache {' '.join(argv)} did not return in {seconds} s"
    return result[0]


def test_a_named_pipe_is_refused_unread(tmp_path, capsys):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes here")
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    for fmt in ("auto", "mooncake", "openai"):
        assert _main_within(["replay", str(fifo), "--format", fmt, "--no-progress"]) == 2
        assert _errors(capsys.readouterr().err) == [f"mmcache: error: {fifo}: not a file but a named pipe"]


def test_a_device_is_refused_unread(capsys):
    if not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero here")
    assert _main_within(["replay", "/dev/zero", "--no-progress"]) == 2
    assert _errors(capsys.readouterr().err) == ["mmcache: error: /dev/zero: not a file but a character device"]


def test_a_lone_surrogate_in_chat_text_names_its_line(tmp_path, capsys):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    log = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    log.write_text(good + "\n" + '{"messages": [{"role": "user", "content": "bad \\ud800 text"}]}\n')
    assert main(["replay", str(log), "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(f"mmcache: error: {log}:2: message 0: text holds a lone "
                                                     "surrogate '\\ud800'")


@pytest.mark.parametrize("name, text, where", [
    ("deep.jsonl", '{"timestamp": ' + "[" * 200_000 + "]" * 200_000 + "}\n", ":1: JSON nested too deep"),  # Mooncake
    ("deep_chat.jsonl", '{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": ' + "[" * 200_000
     + "]" * 200_000 + "}\n", ":2: JSON nested too deep"),
    ("deep.json", "[" * 200_000 + "]" * 200_000, ": JSON nested too deep"),  # ShareGPT
], ids=["mooncake", "chat", "sharegpt"])
def test_json_nested_past_the_recursion_limit_is_a_malformed_line(tmp_path, capsys, name, text, where):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    path = tmp_path / name
    path.write_text(text)
    assert main(["replay", str(path), "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith(f"mmcache: error: {path}{where}")


@pytest.mark.parametrize("size", ["99999999999999999999999", "16G", "1e13"])
def test_a_pool_past_the_machine_memory_is_refused_with_what_it_needs(size, monkeypatch, capsys):
    monkeypatch.setattr(memory, "available_bytes", lambda: 8 << 30)
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("a pool was built"))
    assert main(["replay", "--limit", "20", "--pool-tokens", f"64k,{size}", "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith("mmcache: error: --pool-tokens ")
    assert "needs about" in errors[0] and "more than the 8.0 GiB available" in errors[0]
    need = memory.bytes_per_page(512) * int(float(size.rstrip("G")) * (1 << 30 if size.endswith("G") else 1)) // 512
    assert need > 8 << 30 and 2000 < memory.bytes_per_page(512) < 4000  # 512 int32 token ids, and the index entries


def test_a_pool_that_fits_is_not_measured(monkeypatch):
    monkeypatch.setattr(memory, "bytes_per_page", lambda *a: pytest.fail("measured"))
    assert memory.pool_memory_problem("--pool-tokens", 1 << 20, 512, available=8 << 30) is None


@pytest.mark.parametrize("argv", [["--pool-tokens", "1k"], ["--pool-tokens", "4k", "--replicas", "1,4"]])
def test_a_pool_smaller_than_every_request_is_refused(argv, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "run_sweep", lambda *a, **k: pytest.fail("replayed"))
    assert main(["replay", "--limit", "20", *argv, "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)  # the smallest of these 20 requests needs 3 pages of 512 tokens
    assert len(errors) == 1 and "is smaller than every request, so every request would fail" in errors[0]
    assert errors[0].endswith("give at least 1536" if len(argv) == 2 else "give at least 6k")


def test_model_pool_pages_past_what_a_pool_can_number_are_refused_before_loading(monkeypatch, capsys):
    monkeypatch.setattr(registry, "model_factory", lambda *a: pytest.fail("the workload was built"))
    assert main(["replay", "agent-model", "--pool-pages", "99999999999999999999", "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "--pool-pages 99,999,999,999,999,999,999: past what a pool can number" in errors[0]


def test_model_pools_past_memory_are_one_line(monkeypatch, capsys):
    def factory(name, options):
        def make():
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:124] DefaultCPUAllocator: can't allocate memory: you "
                               "tried to allocate 81919999991808 bytes.\nmore")
        return make
    monkeypatch.setattr(registry, "model_factory", factory)
    assert main(["replay", "image-gen", "--pool-pages", "999999999", "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].startswith("mmcache: error: the cache's pools do not fit in memory (")
    assert "tried to allocate 81919999991808 bytes.); give a smaller --pool-pages (now 999,999,999)" in errors[0]


def test_a_model_replay_where_every_request_failed_is_not_a_success(tmp_path, monkeypatch, capsys):
    tiny_workload.use(monkeypatch, fail_on=True)
    out = tmp_path / "r.json"
    assert main(["replay", "image-gen", "--json", str(out), "--no-progress"]) == 1
    errors = _errors(capsys.readouterr().err)
    assert errors == ["mmcache: error: every request failed with the cache on (see the failed: lines above); "
                      "nothing was served"]
    assert json.loads(out.read_text())["summary"]["on"]["failed"] == 4  # what was measured is still written


# -- mmcache data fetch in a fresh clone ---------------------------------------------------------------------------
@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """A clone with no ../shared/data beside it and no $MMCACHE_DATA: its own data/ folder."""
    monkeypatch.setattr(registry, "checkout_data", lambda: tmp_path / "no-shared" / "data")
    monkeypatch.setattr(registry, "clone_data", lambda: tmp_path / "clone" / "data")
    monkeypatch.delenv(registry.DATA_ENV, raising=False)
    return tmp_path / "clone" / "data"


def test_in_a_fresh_clone_fetch_fills_its_data_folder_and_replays_find_it(fresh_clone, capsys):
    assert registry.data_place() == (fresh_clone, "data/ in this clone")
    assert main(["data", "list"]) == 0
    assert f"data folder: {fresh_clone} (from data/ in this clone)" in capsys.readouterr().out
    trace = fresh_clone / "mooncake" / "conversation_trace.jsonl"  # as fetch leaves it
    trace.parent.mkdir(parents=True)
    trace.write_text(registry.embedded_slice().read_text().splitlines()[0] + "\n")
    assert main(["replay", "mooncake", "--pool-tokens", "inf", "--no-progress"]) == 0
    assert f"{trace}: 1 request" in capsys.readouterr().out


def test_fetch_makes_the_clones_data_folder(fresh_clone, monkeypatch, capsys):
    from workloads import datasets

    def fake_fetch(sources, root, progress):
        (root / "x").mkdir(parents=True)
        return []
    monkeypatch.setattr(datasets, "fetch", fake_fetch)
    assert main(["data", "fetch", "mooncake"]) == 0
    assert (fresh_clone / "x").is_dir()
    assert f"data folder: {fresh_clone} (from data/ in this clone); replays read it by default" in \
        capsys.readouterr().out


def test_a_package_installed_without_a_clone_uses_the_per_user_folder(fresh_clone, tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "clone_data", lambda: None)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert registry.data_place() == (tmp_path / "xdg" / "mmcache", "the per-user data folder")


@pytest.mark.parametrize("workload, source", [("agent", "mini-swe-agent"), ("mooncake", "mooncake"),
                                              ("agent-model", "mini-swe-agent")])
def test_a_replay_after_a_failed_fetch_fails_in_one_line_naming_the_fetch(fresh_clone, monkeypatch, capsys,
                                                                          workload, source):
    """This machine cannot reach the data sets' hosts: the fetch fails (1) and leaves what a failed download leaves
    (the folders made on the way); the replay that follows says to run the fetch, in one line."""
    import urllib.error
    import urllib.request

    def unreachable(request, timeout):
        raise urllib.error.URLError("[Errno -2] Name or service not known")
    monkeypatch.setattr(urllib.request, "urlopen", unreachable)
    assert main(["data", "fetch", source, "--no-progress"]) == 1
    fetch_errors = _errors(capsys.readouterr().err)
    assert len(fetch_errors) == 1 and "Name or service not known (run the command again to resume)" in fetch_errors[0]
    assert main(["replay", workload, "--data", "--no-progress"] if workload == "agent-model"
                else ["replay", workload, "--no-progress"]) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and f"Run mmcache data fetch {source} first (it fills {fresh_clone})" in errors[0]


def test_every_workload_with_data_names_a_source_of_the_manifest():
    from workloads import datasets
    sources = datasets.load_sources()
    assert {registry.data_source(w) for w in registry.WORKLOADS.values() if w.data_path} <= set(sources)


def test_user_data_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert registry.user_data() == tmp_path / "mmcache"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/ignored")  # the spec: only an absolute path counts
    assert registry.user_data() == Path.home() / ".local" / "share" / "mmcache"


def test_a_source_made_by_hand_fetches_nothing_and_says_so(tmp_path, capsys):
    assert main(["data", "fetch", "mmmu", "--data", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "not fetched (no file to download as is): write mmmu/" in captured.out
    assert _errors(captured.err) == [f"mmcache: error: nothing fetched for mmmu: made by hand, and the folder is "
                                     f"missing (see above for how to make it in {tmp_path})"]
    (tmp_path / "mmmu").mkdir()
    assert main(["data", "fetch", "mmmu", "--data", str(tmp_path)]) == 0
    assert "present mmmu/ (made by hand; not checked)" in capsys.readouterr().out


# -- output files ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_files_get_the_users_umask(tmp_path, umask):
    from workloads.output_files import save, write_atomic

    old = os.umask(umask)
    try:
        written = write_atomic(tmp_path / "new.json", "{}")
        assert stat.S_IMODE(written.stat().st_mode) == 0o666 & ~umask
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o640)
        assert stat.S_IMODE(write_atomic(kept, "new").stat().st_mode) == 0o640  # a replaced file keeps its mode
        fallback, problem = save("--json", tmp_path / "no-such-folder" / "r.json", "{}")
        assert problem and stat.S_IMODE(fallback.stat().st_mode) == 0o666 & ~umask
        fallback.unlink()
    finally:
        os.umask(old)
