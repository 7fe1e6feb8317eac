"""The long-running traffic generators of ``benchmarks/traffic.py`` make the traffic they are named for: sessions that
re-send their history and end, a burst that stops, encoder traffic that stops midway; and a short replay of the burst
holds the default to its bound against lru window by window."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.traffic import (
    GENERATORS,
    IMAGE_TOKENS,
    PAGE,
    agent_sessions,
    burst,
    encoder_stop,
    ending_chats,
    hot_prompts,
)
from workloads.sizing.ordering import Serving
from workloads.sizing.replay import replay_trace


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_call_re_sends_its_session_s_history_and_the_trace_is_its_parameters(name):
    trace, again = GENERATORS[name](400), GENERATORS[name](400)
    assert trace.num_requests >= 400
    for sess, same in zip(trace.sessions[:30], again.sessions[:30]):
        prev = None
        for i in range(len(sess.calls)):
            req = sess.build(i)
            assert np.array_equal(req.token_ids, same.build(i).token_ids)
            if prev is not None:
                assert np.array_equal(req.token_ids[:prev.prompt_len + prev.output_len],
                                      np.concatenate([prev.token_ids, prev.output_ids]))
            prev = req


def test_agent_sessions_grow_a_page_a_call_and_end_after_8_to_24_calls():
    trace = agent_sessions(2000)
    assert {8 <= len(s.calls) <= 24 for s in trace.sessions} == {True}
    calls = trace.sessions[0].calls
    assert [b.prompt_len - a.prompt_len for a, b in zip(calls, calls[1:])] == [PAGE] * (len(calls) - 1)


def test_chats_end_after_2_to_8_turns_under_four_system_prompts():
    trace = ending_chats(2000)
    assert {len(s.calls) for s in trace.sessions} <= set(range(2, 9))
    assert len({s.build(0).token_ids[:PAGE].tobytes() for s in trace.sessions}) == 4


def test_hot_prompts_are_one_call_each_under_eight_prompts_the_first_the_hottest():
    trace = hot_prompts(2000)
    firsts = [s.build(0).token_ids[:PAGE].tobytes() for s in trace.sessions]
    counts = sorted((firsts.count(f) for f in set(firsts)), reverse=True)
    assert {len(s.calls) for s in trace.sessions} == {1} and len(counts) == 8 and counts[0] > 3 * counts[-1]


def test_the_burst_sends_four_prompts_sixteen_times_once_in_the_middle():
    trace = burst(2000)
    at = [i for i, s in enumerate(trace.sessions) if s.name.startswith("burst")]
    assert len(at) == 64 and at == list(range(at[0], at[0] + 64))
    assert 0.3 < at[0] / len(trace.sessions) < 0.5
    assert len({trace.sessions[i].build(0).token_ids[:32 * PAGE].tobytes() for i in at}) == 4


def test_encoder_traffic_stops_midway():
    trace = encoder_stop(2000)
    with_images = [bool(s.build(0).encoded) for s in trace.sessions]
    half = with_images.index(False)
    assert not any(with_images[half:]) and all(with_images[:half]) and 0.3 < half / len(with_images) < 0.7
    item = trace.sessions[0].build(0).encoded[0]
    assert item.tokens == IMAGE_TOKENS and item.modality == "image"


def test_the_default_holds_to_lru_through_the_burst():
    """Every full window of 500 requests after the first: the default's prompt-token hit share at most a point below
    lru's (at the pool sizes where the chats and the burst press on the pool)."""
    trace = burst(1500)

    class Windows:
        def __init__(self):
            self.hit, self.asked = np.zeros(4), np.zeros(4)

        def served(self, request, req, matched, encoder_runs):
            self.hit[request // 500] += matched or 0
            self.asked[request // 500] += req.prompt_len

    for pool in (1024, 2048):
        shares = {}
        for policy in ("lru", "dip"):
            w = Windows()
            replay_trace(trace, page_size=PAGE, pool_tokens=pool, serving=Serving("round-robin", 16, 1),
                         eviction=policy, watch=w)
            shares[policy] = w.hit[1:3] / w.asked[1:3]
        assert (shares["dip"] >= shares["lru"] - 0.01).all(), (pool, shares)
