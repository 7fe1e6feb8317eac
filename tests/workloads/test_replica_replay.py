"""The multi-replica replay on small generated traces: routers, the R = 1 reference, and the command line."""

import json

import pytest

from workloads import cli
from workloads.sizing.replay import replay_trace
from workloads.sizing.replicas import replay_replicas
from workloads.sizing.routers import CacheAwareRouter
from workloads.traces.hot_prefix import HotPrefixSkew

TRACE = HotPrefixSkew(users=120, prompts=4).trace()
KW = dict(page_size=128, pool_tokens=1 << 19)


def test_one_replica_realizes_what_the_single_pool_replay_does():
    one = replay_replicas(TRACE, replicas=1, router="random", **KW)
    ref = replay_trace(TRACE, page_size=128, pool_tokens=1 << 19)
    assert (one.hit_tokens, one.prompt_tokens) == (ref.hit_tokens, ref.prompt_tokens)
    assert one.duplicated == 0 and one.spread_mean in (0.0, 1.0)


@pytest.mark.parametrize("replicas", [2, 4])
def test_affinity_keeps_hits_near_one_pool_and_stores_fewer_copies_than_random(replicas):
    one = replay_replicas(TRACE, replicas=1, router="random", **KW)
    rand = replay_replicas(TRACE, replicas=replicas, router="random", **KW)
    aff = replay_replicas(TRACE, replicas=replicas, router="affinity", **KW)
    assert aff.hit_tokens >= rand.hit_tokens and aff.hit_tokens >= 0.9 * one.hit_tokens
    assert aff.duplicated < rand.duplicated and aff.spread_mean < rand.spread_mean
    assert sum(aff.per_replica_requests) == aff.requests == TRACE.num_requests
    assert aff.ttft_p99_s >= aff.ttft_p50_s > 0


def test_round_robin_is_even_and_every_router_sees_every_request():
    for router in ("random", "round-robin", "affinity", "cache-aware", "kv-aware"):
        run = replay_replicas(TRACE, replicas=3, router=router, **KW)
        assert run.requests == TRACE.num_requests and len(run.per_replica_requests) == 3
    rr = replay_replicas(TRACE, replicas=3, router="round-robin", **KW)
    assert max(rr.per_replica_requests) - min(rr.per_replica_requests) <= 1


def test_cache_aware_follows_the_longest_match_until_loads_are_imbalanced():
    r = CacheAwareRouter(2, page_size=4)
    first = r.choose([1, 2, 3], 12, [0, 0], 0.0)
    assert r.choose([1, 2, 3, 4], 16, [5, 5], 1.0) == first              # 3 of 4 pages match: > 0.5
    assert r.choose([1, 2, 3, 4], 16, [40, 0] if first == 0 else [0, 40], 2.0) != first  # 40 > 32 and > 1.5 x 0
    assert r.choose([9], 4, [0, 0], 3.0) in (0, 1)


def test_replica_replay_refuses_a_pool_too_small_to_split():
    with pytest.raises(ValueError):
        replay_replicas(TRACE, replicas=8, router="random", page_size=128, pool_tokens=512)


def test_cli_replicas_table_and_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["replay", "hot-prefix", "--limit", "40", "--replicas", "2", "--router", "random,affinity",
                     "--pool-tokens", "256k", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "of one pool %" in text and "affinity" in text
    doc = json.loads(out.read_text())
    assert [r["router"] for r in doc["runs"]] == ["random", "affinity"] and doc["pool_tokens_total"] == 1 << 18


@pytest.mark.parametrize("argv", [["--replicas", "2", "--order", "round-robin"], ["--replicas", "0"],
                                  ["--replicas", "2", "--pool-tokens", "1M,2M"], ["--key-pages", "2"],
                                  ["--replicas", "2", "--router", "nope"], ["--replicas", "2", "--pool-tokens", "inf"]])
def test_cli_replica_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) if argv[-1] in ("0", "nope") else _nothing():
        assert cli.main(["replay", *argv]) == 2
    assert "error" in capsys.readouterr().err


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
