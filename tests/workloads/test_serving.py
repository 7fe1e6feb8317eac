"""The serving loop on a real tiny multimodal workload (``TinyChat``, from conftest's ``tiny_chat`` fixture):
schedules, cache off vs on, failures, and the metrics math."""

import numpy as np
import pytest

from workloads.harness.metrics import (
    SLO,
    RequestRecord,
    RequestResult,
    RunResult,
    percentiles,
    summarize,
    summary_table,
)
from workloads.harness.serving import Request, Schedule, compare, serve_run

SCHEDULE = Schedule("poisson", rate=40.0, seed=3)


@pytest.fixture(scope="module")
def runs(tiny_chat):
    return compare(tiny_chat.factory(), SCHEDULE)


# ------------------------------------------------------------------------------------------------- cache off vs on
def test_cache_on_hits_on_the_same_schedule(runs):
    off, on = runs
    assert [(r.rid, r.arrival_s) for r in off.records] == [(r.rid, r.arrival_s) for r in on.records]
    a, b = summarize(off), summarize(on)
    assert a["completed"] == b["completed"] == 18 and a["failed"] == b["failed"] == 0
    assert a["hit_rate"] == {"prefix": 0.0, "image": 0.0, "speaker": 0.0}
    assert b["hit_rate"]["prefix"] > 0.7 and b["hit_rate"]["image"] == pytest.approx(1 / 3)
    assert b["of_ceiling"] == pytest.approx({"prefix": 1.0, "image": 1.0, "speaker": 1.0})  # pool never evicts
    assert b["matched_page_share"] > 0.7 and b["stalls"] == 0
    assert b["hit_vs_miss"]["prefix"]["hit"]["requests"] == 17  # every request after the first shares the system
    table = summary_table(off, on)
    assert "TTFT p50 (ms)" in table and "prefix hit rate (tokens)" in table and "100% of ceiling" in table


def test_cache_on_computes_less(runs):
    """What the cache saves, counted exactly: prompt tokens not prefilled and images not encoded, on the same
    requests. How much faster that makes a run is timing, measured in benchmarks/, never asserted here."""
    off, on = runs
    prompts = [sum(r.result.prompt_tokens for r in run.completed) for run in (off, on)]
    prefilled = [run.computed_tokens for run in (off, on)]
    assert prompts[0] == prompts[1] and prefilled[0] == prompts[0]
    assert prefilled[1] < 0.3 * prefilled[0]
    assert summarize(on)["hit_rate"]["prefix"] == pytest.approx(1 - prefilled[1] / prompts[1])
    images = [[(r.result.encoder_items.get("image", 0), r.result.encoder_hits.get("image", 0)) for r in run.completed]
              for run in (off, on)]
    assert [n for n, _ in images[0]] == [n for n, _ in images[1]] and not any(h for _, h in images[0])
    encoded = [sum(n - h for n, h in run) for run in images]
    assert encoded[1] * 3 == encoded[0] * 2  # a third of the image items hit


def test_timeline_invariants(runs):
    for run in runs:
        free = 0.0
        for rec in run.records:
            assert rec.start_s == max(rec.arrival_s, free) and rec.queue_s >= 0
            assert 0 < rec.token_s[0] <= rec.service_s and len(rec.token_s) == 12
            assert rec.ttft_s <= rec.e2e_s and (rec.ttfa_s is not None) == rec.rid.endswith("t5")
            free = rec.end_s
        total = run.cache_stats["prefix"]
        assert len(run.occupancy) == len(run.records)
        assert all(live + cached + free_ == 512 and live == 0 for _, live, cached, free_ in run.occupancy)
        cached_pages = [c for _, _, c, _ in run.occupancy]
        assert cached_pages == sorted(cached_pages) and cached_pages[-1] == total["pages_cached"]
        assert (total["queries"] == 0) == (not run.cached)


# ------------------------------------------------------------------------------------------------------ schedules
def test_schedule_parse():
    assert Schedule.parse("trace") == Schedule()
    assert Schedule.parse("poisson:2.5", seed=4) == Schedule("poisson", rate=2.5, seed=4)
    assert Schedule.parse(" closed:8 ") == Schedule("closed", concurrency=8)
    for bad in ("poisson", "poisson:0", "poisson:nan", "closed:0", "closed:x", "trace:1", "burst:3"):
        with pytest.raises(ValueError):
            Schedule.parse(bad)


def test_poisson_is_seeded_and_has_the_rate():
    reqs = [Request(f"r{k}", "s", 0.0) for k in range(4000)]
    order, t = Schedule("poisson", rate=2.0, seed=7).plan(reqs)
    assert order == reqs and t == Schedule("poisson", rate=2.0, seed=7).plan(reqs)[1]
    assert t != Schedule("poisson", rate=2.0, seed=8).plan(reqs)[1]
    gaps = np.diff([0.0, *t])
    assert (gaps > 0).all() and np.mean(gaps) == pytest.approx(0.5, rel=0.05)


def test_trace_schedule_uses_the_timestamps(tiny_chat):
    run = serve_run(tiny_chat.factory(), Schedule(), cached=False)
    reqs = {r.rid: r for r in tiny_chat.cls(tiny_chat.model, tiny_chat.media).requests()}
    t0 = min(r.arrival_s for r in reqs.values())
    assert t0 == 1000.0 and all(r.arrival_s == reqs[r.rid].arrival_s - t0 for r in run.records)
    assert [r.arrival_s for r in run.records] == sorted(r.arrival_s for r in run.records)
    assert [r.rid for r in run.records[:4]] == ["s0t0", "s1t0", "s2t0", "s0t1"]  # arrival order, not listed order


@pytest.mark.parametrize("clients", [1, 3])
def test_closed_loop_keeps_the_concurrency(tiny_chat, clients):
    run = serve_run(tiny_chat.factory(), Schedule("closed", concurrency=clients), cached=True)
    arrivals, ends = [r.arrival_s for r in run.records], [r.end_s for r in run.records]
    assert arrivals[:clients] == [0.0] * clients
    assert arrivals[clients:] == ends[:-clients]  # each client sends its next request as its previous one ends
    in_system = [sum(a <= t < e for a, e in zip(arrivals, ends)) for t in arrivals]
    assert max(in_system) == clients
    if clients == 1:
        assert all(r.queue_s == 0 for r in run.records)


# ------------------------------------------------------------------------------------------------------- failures
def test_a_failed_request_is_counted_and_the_replay_goes_on(tiny_chat):
    off, on = compare(tiny_chat.factory(missing=frozenset({"s1t0"})), Schedule())
    for run in (off, on):
        s = summarize(run)
        assert s["failed"] == 1 and s["completed"] == 17
        assert "'s1t0'" in s["errors"][0] and "missing.png" in s["errors"][0]
        assert run.records[-1].ok and run.records[1].rid == "s1t0" and not run.records[1].ok
    assert on.cache_stats["prefix"]["requests_live"] == 0  # the failure left nothing admitted
    assert summarize(on)["of_ceiling"] == pytest.approx({"prefix": 1.0, "image": 1.0, "speaker": 1.0})


def test_errors_that_are_not_mmcache_errors_propagate(tiny_chat):
    class Broken(tiny_chat.cls):
        def serve(self, req, cached, clock):
            if req.rid == "s0t2":
                raise RuntimeError("bug")
            return super().serve(req, cached, clock)

    with pytest.raises(RuntimeError, match="bug"):
        serve_run(lambda: Broken(tiny_chat.model, tiny_chat.media), Schedule(), cached=True)


# ---------------------------------------------------------------------------------------------------- metrics math
def _record(rid, arrival, start, service, tokens=(), audio=(), error=None):
    result = None if error else RequestResult(prompt_tokens=100, hit_tokens=50, output_tokens=len(tokens))
    return RequestRecord(rid, "s", arrival, start, service, result, error, tuple(tokens), tuple(audio))


def test_percentiles_on_known_inputs():
    assert percentiles(range(1, 101)) == pytest.approx({"n": 100, "mean": 50.5, "p50": 50.5, "p90": 90.1,
                                                        "p99": 99.01})
    assert percentiles([]) is None and percentiles([2.0])["p99"] == 2.0


def test_latencies_goodput_and_throughput_on_known_inputs():
    recs = [_record("a", 0.0, 0.0, 0.5, tokens=(0.1, 0.2, 0.4)),            # TTFT 0.1
            _record("b", 1.0, 1.0, 0.5, tokens=(0.3, 0.35), audio=(0.2,)),  # TTFT 0.3, TTFA 0.2
            _record("c", 1.2, 1.5, 0.5, tokens=(0.1,), audio=(0.4,)),       # queued 0.3: TTFT 0.4, TTFA 0.7
            _record("d", 2.0, 2.0, 0.25, error="request 'd': bad image")]
    run = RunResult("known", True, "trace", {"prefix": 0.5}, recs)
    assert run.makespan_s == 2.25  # first arrival 0 to last end 2.25 (the failed request counts)
    assert run.latencies("ttft").tolist() == pytest.approx([0.1, 0.3, 0.4])
    assert run.latencies("itl").tolist() == pytest.approx([0.1, 0.2, 0.05])
    assert run.latencies("ttfa").tolist() == pytest.approx([0.2, 0.7])
    assert run.latencies("queue").tolist() == pytest.approx([0.0, 0.0, 0.3])
    assert run.latencies("e2e").tolist() == pytest.approx([0.5, 0.5, 0.8])
    s = summarize(run, SLO(ttft_s=0.35))
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == ["request 'd': bad image"]
    assert s["throughput_rps"] == pytest.approx(3 / 2.25) and s["throughput_tps"] == pytest.approx(6 / 2.25)
    assert s["goodput_rps"] == pytest.approx(2 / 2.25)                          # a and b meet TTFT <= 0.35
    assert summarize(run, SLO(ttft_s=0.35, ttfa_s=0.5))["goodput_rps"] == pytest.approx(1 / 2.25)  # only b
    assert summarize(run)["goodput_rps"] == s["throughput_rps"]                # no bound: every completed one
    assert s["hit_rate"] == {"prefix": 0.5} and s["of_ceiling"] == {"prefix": 1.0}
    assert s["latency_s"]["ttft"]["p50"] == pytest.approx(0.3)
