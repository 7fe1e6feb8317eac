"""Text trace loaders, replay order, and the replay engine (small temp traces, the embedded slice, real data)."""

import json
import math
import re

import numpy as np
import pytest

from mmcache.errors import TraceError
from workloads.registry import embedded_slice
from workloads.service import ServiceModel
from workloads.sizing.ordering import Serving, schedule
from workloads.sizing.replay import pool_pages_for, replay_trace
from workloads.traces.jsonl import load_jsonl
from workloads.traces.mooncake import BLOCK_TOKENS, load_mooncake
from workloads.traces.swe_agent import Trajectory
from workloads.traces.text_trace import CallInfo, TextTrace

P = BLOCK_TOKENS


def row(ts_ms, n_in, ids, n_out=8):
    return json.dumps({"timestamp": ts_ms, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


def write_lines(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------------------------- Mooncake loader
@pytest.mark.parametrize("bad, reason", [
    ("{not json", "not JSON"),
    (json.dumps({"timestamp": 5, "input_length": 10, "hash_ids": [1]}), "output_length"),
    (row(10, 1025, [1, 2]), "hash_ids"),                      # needs 3 ids
    (row(-1, 512, [7]), "timestamp must be a finite number >= 0"),
    (row(0, 512, [-7]), "hash_ids must be in [0, 2**63)"),
    (row(0, 512, [1 << 63]), "hash_ids must be in [0, 2**63)"),
    ("[1, 2]", "not a JSON object"),
])
def test_mooncake_malformed_line_raises_with_file_and_line(tmp_path, bad, reason):
    path = write_lines(tmp_path, [row(0, 1000, [1, 2]), "", bad, row(20, 512, [7])])  # blank lines are not errors
    with pytest.raises(TraceError, match=re.escape(reason)) as e:
        load_mooncake(path)
    assert e.value.path == str(path) and e.value.line == 3 and str(e.value).startswith(f"{path}:3: ")


def test_jsonl_reader_policy(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"a": 2}\n\xff\xfe\n')
    assert load_jsonl(path, lambda v, n: (n, v["a"]), limit=2) == [(1, 1), (4, 2)]  # the bad line is never read
    with pytest.raises(TraceError, match=r"x\.jsonl:5: not UTF-8"):
        load_jsonl(path, lambda v, n: v)
    with pytest.raises(TraceError, match=r"x\.jsonl:4: KeyError"):
        load_jsonl(path, lambda v, n: v["b"] if n == 4 else v)
    assert load_jsonl(path, lambda v, n: v, limit=0) == []
    with pytest.raises(TraceError, match="not a file"):
        load_jsonl(tmp_path, lambda v, n: v)


def test_mooncake_missing_file_raises(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        load_mooncake(tmp_path / "absent.jsonl")


def test_mooncake_tokens_and_names_follow_block_ids(tmp_path):
    path = write_lines(tmp_path, [row(0, 1500, [1, 2, 3]), row(1000, 1024, [1, 2]), row(2000, 700, [1, 9])])
    a, b, c = (s.build(0) for s in load_mooncake(path).sessions)
    assert a.token_ids.dtype == np.int32 and a.prompt_len == 1500 and a.output_ids is None
    assert len(a.names) == 1500 // P and len(b.names) == 2 and len(c.names) == 1
    assert a.names[:2] == b.names and a.names[0] == c.names[0]
    assert np.array_equal(a.token_ids[:2 * P], b.token_ids)
    assert np.array_equal(a.token_ids[:P], c.token_ids[:P])
    assert not np.array_equal(a.token_ids[P:2 * P], c.token_ids[P:2 * P])
    assert a.arrival_s == 0.0 and b.arrival_s == 1.0
    assert all(n >= 1 << 32 for n in a.names)  # mapped away from the small integer ids


def test_embedded_slice_loads():
    trace = load_mooncake(embedded_slice())
    assert trace.num_requests == 2000 and trace.malformed == 0 and trace.page_size == 512
    assert trace.prompt_tokens > 0


def test_mooncake_limit_stops_reading(tmp_path):
    path = write_lines(tmp_path, [row(0, 10, [1]), "", row(0, 10, [1]), "oops"])
    assert [s.name for s in load_mooncake(path, limit=2).sessions] == ["mc-1", "mc-3"]


# ----------------------------------------------------------------------------------------------- ordering
class _S:
    def __init__(self, name, arrivals):
        self.name, self.calls = name, [CallInfo(t, 1, 1) for t in arrivals]


def test_round_robin_interleaves_k_sessions_and_refills():
    sessions = [_S("a", [0, 0, 0]), _S("b", [0]), _S("c", [0, 0]), _S("d", [0])]
    order = [(s, i) for s, i, _ in schedule(sessions, Serving("round-robin", 2))]
    assert order == [(0, 0), (1, 0), (0, 1), (2, 0), (0, 2), (2, 1), (3, 0)]


def test_timestamp_order_is_stable_and_causal():
    sessions = [_S("a", [5, 5, 9]), _S("b", [0, 5])]
    assert [(s, i) for s, i, _ in schedule(sessions, Serving())] == [(1, 0), (0, 0), (0, 1), (1, 1), (0, 2)]


def test_closed_loop_sends_each_next_call_when_the_previous_would_end():
    # two clients; a call of 1 prompt token and 1 output token takes 1e-4 + 0.02 s unserved by any cache
    sessions = [_S("a", [0, 0]), _S("b", [0]), _S("c", [0])]
    d = ServiceModel().duration(1, 1)
    got = list(schedule(sessions, Serving("closed", 2)))
    assert [(s, i) for s, i, _ in got] == [(0, 0), (1, 0), (0, 1), (2, 0)]
    assert [t for *_, t in got] == pytest.approx([0, 0, d, d])


def test_unknown_order_rejected():
    with pytest.raises(ValueError, match="unknown order"):
        Serving("random")
    with pytest.raises(ValueError, match="in_service"):
        Serving("round-robin", in_service=0)


# ----------------------------------------------------------------------------------------------- replay engine
@pytest.mark.parametrize("order", ["timestamp", "round-robin"])
def test_replay_counts_expected_hits(tmp_path, order):
    path = write_lines(tmp_path, [
        row(0, 3 * P, [1, 2, 3]),             # cold
        row(100_000, 3 * P + 64, [1, 2, 4, 5]),  # shares blocks 1, 2
        row(200_000, 3 * P, [1, 2, 3]),       # all 3 blocks indexed, but the last token is always computed: 2 pages
    ])
    trace = load_mooncake(path)
    run = replay_trace(trace, page_size=P, pool_tokens=None, serving=Serving(order, in_service=1))
    assert (run.requests, run.prompt_tokens, run.hit_tokens) == (3, 9 * P + 64, 4 * P)
    assert run.evicted_pages == run.stalls == run.failed == 0


def _two_sessions(page: int) -> TextTrace:
    """Sessions A and B, two calls each; every call's prompt + output fills 5 pages of ``page`` tokens."""
    rng = np.random.default_rng(0)
    tokens = lambda n: rng.integers(1, 1000, size=n, dtype=np.int32)  # noqa: E731
    bos = np.zeros(1, dtype=np.int32)
    sessions = []
    for name in "AB":
        messages = [tokens(3 * page - 1), tokens(page), tokens(page), tokens(page), tokens(page)]
        calls = [CallInfo(0.0, 4 * page, page), CallInfo(0.0, 6 * page, page)]
        sessions.append(Trajectory(name, bos, messages, calls))
    return TextTrace("two sessions", "test", sessions)


class _Matched:
    def __init__(self):
        self.by_rid = {}

    def served(self, request, req, matched, encoder_runs):
        self.by_rid[req.rid] = matched


@pytest.mark.parametrize("in_service", [1, 2])
def test_between_calls_a_session_is_only_cached_and_the_other_session_evicts_it(in_service):
    # A pool of 7 pages holds one call (5 pages) and not two. Round-robin A0, B0, A1, B1. Served as an engine serves,
    # A0 completes before B0 is admitted (in_service 1) or when B0 needs room (in_service 2): B0 then takes two of A's
    # four cached pages (the deepest), and A1 finds only the other two. Pinned between calls, A0 would hold them.
    trace, P = _two_sessions(16), 16
    ceiling = _Matched()
    replay_trace(trace, page_size=P, pool_tokens=None, serving=Serving("round-robin", 2, in_service), watch=ceiling,
                 eviction="lru")
    assert ceiling.by_rid["A#1"] == 4 * P  # its whole history, unbounded (the output's last page is never written)
    small = _Matched()
    run = replay_trace(trace, page_size=P, pool_tokens=7 * P, serving=Serving("round-robin", 2, in_service),
                       watch=small, eviction="lru")
    assert small.by_rid["A#1"] == 2 * P and run.evicted_pages > 0 and run.failed == 0


def test_pinned_sessions_keep_their_history_between_calls():
    trace, P = _two_sessions(16), 16
    pinned = _Matched()
    run = replay_trace(trace, page_size=P, pool_tokens=12 * P, serving=Serving("round-robin", 2, 1, pin_sessions=True),
                       watch=pinned, eviction="lru")
    assert pinned.by_rid["A#1"] == 4 * P and run.peak_live_requests == 2


def test_in_service_caps_timestamp_order_first_come_first_served(tmp_path):
    # three requests arriving together, one in service at a time: each waits for the one before it
    path = write_lines(tmp_path, [row(0, 1000, [1, 2], n_out=10), row(0, 1000, [3, 4], n_out=10),
                                  row(0, 1000, [5, 6], n_out=10)])
    capped = replay_trace(load_mooncake(path), page_size=P, pool_tokens=None, serving=Serving(in_service=1))
    free = replay_trace(load_mooncake(path), page_size=P, pool_tokens=None, serving=Serving())
    assert (capped.peak_live_requests, free.peak_live_requests) == (1, 3)


def test_replay_rejects_other_page_size_for_mooncake(tmp_path):
    trace = load_mooncake(write_lines(tmp_path, [row(0, 10, [1])]))
    with pytest.raises(ValueError, match="512"):
        replay_trace(trace, page_size=128, pool_tokens=None)


def test_request_larger_than_pool_fails_and_others_proceed(tmp_path):
    path = write_lines(tmp_path, [row(0, 3 * P, [1, 2, 3], n_out=0), row(1, P, [1], n_out=0)])
    run = replay_trace(load_mooncake(path), page_size=P, pool_tokens=2 * P, serving=Serving("round-robin", 2, 2))
    assert run.failed == 1 and run.requests == 2 and run.prompt_tokens == 4 * P and run.hit_tokens == 0


@pytest.mark.parametrize("order", ["timestamp", "round-robin"])
def test_request_waits_for_live_ones_when_pool_is_full(tmp_path, order):
    # Two concurrent 2-page requests in a 3-page pool: the second waits for the first (one stall), then fits.
    path = write_lines(tmp_path, [row(0, 1000, [1, 2], n_out=10), row(0, 1000, [3, 4], n_out=10)])
    run = replay_trace(load_mooncake(path), page_size=P, pool_tokens=3 * P, serving=Serving(order, 2, 2))
    assert run.stalls == 1 and run.failed == 0 and run.requests == 2


def test_service_model_duration():
    assert ServiceModel(1000.0, 0.5).duration(2000, 4) == pytest.approx(4.0)


def test_unbounded_pool_fits_every_request_at_once(tmp_path):
    trace = load_mooncake(write_lines(tmp_path, [row(0, 1000, [1, 2], n_out=30), row(0, 600, [1, 2], n_out=0)]))
    assert pool_pages_for(trace, P, None) == 1 + math.ceil(1030 / P) + math.ceil(600 / P)
    assert pool_pages_for(trace, P, 1000) == 1 and pool_pages_for(trace, P, 100) == 1


# ----------------------------------------------------------------------------------------------- real data
def test_real_mooncake_ceiling_and_small_pool(data_dir):
    trace = load_mooncake(data_dir / "mooncake" / "conversation_trace.jsonl", limit=1500)
    assert trace.malformed == 0
    inf = replay_trace(trace, page_size=P, pool_tokens=None)
    again = replay_trace(trace, page_size=P, pool_tokens=None)
    assert inf.hit_tokens == again.hit_tokens > 0 and inf.evicted_pages == 0
    k = 4
    serving = Serving("round-robin", k, k)
    ceiling = replay_trace(trace, page_size=P, pool_tokens=None, serving=serving)
    biggest = max(c.prompt_len + c.output_len for s in trace.sessions for c in s.calls)
    pool = k * math.ceil(biggest / P) * P                      # holds K live contexts
    small = replay_trace(trace, page_size=P, pool_tokens=pool, serving=serving)
    assert small.stalls == 0 and small.failed == 0 and small.evicted_pages > 0
    assert 0 < small.hit_tokens <= ceiling.hit_tokens


def _swe_agent(data_dir, limit):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    from workloads.traces.swe_agent import load_swe_agent
    return load_swe_agent(data_dir / "mini-swe-agent" / "trajs", limit=limit)


def test_real_swe_agent_tokenized_once_and_consistent(data_dir):
    trace = _swe_agent(data_dir, 3)
    assert len(trace.sessions) == 3 and trace.malformed == 0 and trace.page_size is None
    for sess in trace.sessions:
        prev = None
        for i, info in enumerate(sess.calls):
            req = sess.build(i)
            assert req.prompt_len == info.prompt_len and req.output_len == info.output_len == req.output_ids.size
            assert req.token_ids.dtype == np.int32 and req.session == sess.name
            if prev is not None:
                head = np.concatenate([prev.token_ids, prev.output_ids])
                assert np.array_equal(req.token_ids[:head.size], head)
                assert req.prompt_len > head.size and req.arrival_s >= prev.arrival_s
            prev = req


def test_real_swe_agent_replay(data_dir):
    trace = _swe_agent(data_dir, 3)
    ceiling = replay_trace(trace, page_size=128, pool_tokens=None, serving=Serving("round-robin", 2))
    assert ceiling.hit_rate > 0.8  # agents re-send their whole history
    small = replay_trace(trace, page_size=128, pool_tokens=64 * 1024, serving=Serving("round-robin", 2))
    assert small.hit_tokens <= ceiling.hit_tokens
    ts = replay_trace(trace, page_size=128, pool_tokens=None)
    assert ts.hit_tokens > 0 and ts.requests == ceiling.requests


def test_swe_agent_skips_bad_files(tmp_path):
    pytest.importorskip("sentencepiece")
    pytest.importorskip("mistral_common")
    from workloads.traces.swe_agent import load_swe_agent
    good = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "task"},
                         {"role": "assistant", "content": "ls", "extra": {"response": {"created": 100}}},
                         {"role": "user", "content": "a b c"},
                         {"role": "assistant", "content": "done"}]}
    (tmp_path / "a.traj.json").write_text(json.dumps(good))
    (tmp_path / "b.traj.json").write_text("{broken")
    (tmp_path / "c.traj.json").write_text(json.dumps({"messages": [{"role": "user", "content": "x"}] * 3}))
    trace = load_swe_agent(tmp_path)
    assert [s.name for s in trace.sessions] == ["a"] and trace.malformed == 2
    assert {e.path.rsplit("/", 1)[-1] for e in trace.errors} == {"b.traj.json", "c.traj.json"}
    sess = trace.sessions[0]
    assert [c.arrival_s for c in sess.calls] == [0.0, 0.0]  # second call has no time: it keeps the previous one
    r0, r1 = sess.build(0), sess.build(1)
    assert np.array_equal(r1.token_ids[:r0.prompt_len + r0.output_len], np.concatenate([r0.token_ids, r0.output_ids]))
    with pytest.raises(TraceError, match="no such folder"):
        load_swe_agent(tmp_path / "nope")
