"""Each policy's exact hit tokens on the embedded Mooncake slice (the quick start's trace, its timestamps, no cap on
requests in service) at three pool sizes, and the optimum's: a change that moves what a policy keeps fails here
instead of passing unnoticed into a documented figure. Re-pin on purpose, with the figures in docs/eviction.md."""

from __future__ import annotations

import pytest

from mmcache.eviction import POLICIES, LookupRecorder
from workloads import registry
from workloads.sizing.replay import replay_trace

SIZES = [1 << 20, 2 << 20, 4 << 20]
PINNED = {  # hit tokens at 1M, 2M, 4M of the slice's 27,441,774 prompt tokens
    "dip": [1519104, 2820096, 5272064],
    "dip-costs": [1519104, 2820096, 5272064],  # a text trace: every page saves alike, so costs move no key
    "lru": [1315328, 2674176, 5131264],
    "lfu": [1595904, 2973696, 5380096],
    "optimal": [4556800, 7469568, 8066048],
}


@pytest.fixture(scope="module")
def trace():
    return registry.load("mooncake", registry.resolve(None)[1])


@pytest.fixture(scope="module")
def lookups(trace):
    recorder = LookupRecorder()
    replay_trace(trace, page_size=512, pool_tokens=None, eviction=recorder)
    return recorder.lookups


@pytest.mark.parametrize("policy", sorted([*POLICIES, "optimal"]))
def test_each_policy_keeps_what_it_kept(trace, lookups, policy):
    hits = [replay_trace(trace, page_size=512, pool_tokens=size, eviction=policy, lookups=lookups).hit_tokens
            for size in SIZES]
    assert hits == PINNED[policy]


def test_every_registered_policy_is_pinned():
    assert set(POLICIES) <= set(PINNED)
