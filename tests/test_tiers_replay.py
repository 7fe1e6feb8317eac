"""Sizing replays with tiers under the pool: reuse per tier adds up, tiers only add reuse, transfers are charged in
the TTFT model, and the command line takes the tier options for trace replays only."""

import pytest

from workloads.cli import main
from workloads.registry import embedded_slice
from workloads.sizing.replay import replay_trace
from workloads.sizing.tiers import TierModel
from workloads.traces.mooncake import load_mooncake

P = 512


@pytest.fixture(scope="module")
def trace():
    return load_mooncake(embedded_slice(), limit=600)


def test_tiers_add_reuse_and_their_transfers_are_charged(trace):
    plain = replay_trace(trace, page_size=P, pool_tokens=64 << 10)
    host = replay_trace(trace, page_size=P, pool_tokens=64 << 10, tiers=TierModel(host_tokens=1 << 20))
    both = replay_trace(trace, page_size=P, pool_tokens=64 << 10,
                        tiers=TierModel(host_tokens=1 << 20, store_tokens=8 << 20))
    ceiling = replay_trace(trace, page_size=P, pool_tokens=None, tiers=TierModel(host_tokens=1 << 20))
    assert plain.hit_tokens < host.hit_tokens <= both.hit_tokens <= ceiling.hit_tokens
    assert ceiling.host_hit_tokens == ceiling.store_hit_tokens == 0  # the unbounded pool gets no tiers
    assert host.host_hit_tokens > 0 and host.store_hit_tokens == 0 and both.store_hit_tokens > 0
    for run in (host, both):
        assert run.device_hit_tokens + run.host_hit_tokens + run.store_hit_tokens == run.hit_tokens
    free = replay_trace(trace, page_size=P, pool_tokens=64 << 10,
                        tiers=TierModel(host_tokens=1 << 20, host_bytes_per_s=1e30))
    assert free.hit_tokens == host.hit_tokens and free.mean_ttft_s < host.mean_ttft_s


def test_the_cli_reports_reuse_per_tier(capsys):
    assert main(["replay", "--limit", "300", "--pool-tokens", "64k", "--host-tokens", "1M", "--store-tokens", "4M",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "host %" in out and "store %" in out and "mean TTFT s" in out
    assert main(["replay", "vlm-chat", "--host-tokens", "1M"]) == 2
    assert "only for trace replays" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["replay", "--host-tokens", "inf"])
