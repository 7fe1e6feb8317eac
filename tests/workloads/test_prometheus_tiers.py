"""The tier series on a real Prometheus server, from a cache with a host tier and a keyed store tier on a real Mooncake
master (both started here on 127.0.0.1): every tier hits, an entry under another key fails its MAC, one of another
page layout fails verification, then the master is killed (a late read marks the store down) and restarted (the
prober marks it up). Prometheus scraped hits by tier, store up 1 -> 0 -> 1, the admission wait and the refusals with
the values the cache counted, and every tier panel of the Grafana dashboard returns data as Grafana draws it.
Skips where the ``prometheus`` binary or Mooncake Store is missing.
"""

import math
import re
import shutil
import time

import pytest
import torch

from mmcache.stats import counter_values
from mmcache.tiers import mooncake
from mooncake_master import MooncakeMaster
from tier_traffic import TieredCache, prompts, publish_as_another_instance, traffic
from workloads.harness.prometheus import Exporter, dashboard_queries
from workloads.harness.promserver import PrometheusServer, duration, grafana_rate_interval
from workloads.harness.tier_series import STORE_COUNTERS, TIER_SERIES

WHY = mooncake.available()
pytestmark = [pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary: apt-get install "
                                 "prometheus (.ci/run does)"),
              pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}")]
SCRAPE_S, STEP_S = 0.25, 1.0
DEADLINE_S, PROBE_S = 0.1, 0.3
TIER_QUERIES = [q for q in dashboard_queries() if TIER_SERIES in q[2]]


def until(what, timeout_s: float, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what.__doc__ or what}"
        time.sleep(every_s)


def scraped_since(prom: PrometheusServer, t: float) -> bool:
    """Whether Prometheus scraped the exporter after wall time ``t``."""
    last = prom.query('timestamp(up{job="mmcache"})')
    return bool(last) and float(last[0]["value"][1]) > t


@pytest.fixture(scope="module")
def served():
    """(server, instance, final TierStats, start, end): the traffic served and sampled, its last sample scraped; the
    server and the exporter still up."""
    exporter = Exporter()
    port = exporter.serve(0)
    with PrometheusServer([f"127.0.0.1:{port}"], SCRAPE_S) as prom, MooncakeMaster() as master:
        client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
        inst = TieredCache(client, deadline_s=DEADLINE_S, probe_s=PROBE_S)
        try:
            sample = lambda: exporter.sample(inst.cache_stats())  # noqa: E731
            sample()  # every tier series at 0 before the first scrape that lists the target (~5 s after start)
            until(lambda: any(t["health"] == "up" for t in prom.targets_up()), 30, 0.1)
            start = time.time()
            traffic(inst, prompts(4), sample)
            forged, other_layout = prompts(2, seed=9)
            publish_as_another_instance(client, forged, key=b"another-key-0123456789abcdef")
            publish_as_another_instance(client, other_layout, dtype=torch.float16)
            assert inst.serve(forged) == inst.serve(other_layout) == 0
            inst.store.flush(30)
            sample()
            t = time.time()
            until(lambda: scraped_since(prom, t), 10)
            master.stop()  # Mooncake answers a few reads at once, then stalls ~4.4 s: a late read marks it down
            dead = iter(prompts(100, seed=11))

            def down():  # lookups only: no put (failing after ~4.5 s) marks the store down first
                """the store marked down"""
                inst.serve(next(dead), commit=False)
                sample()
                return not inst.store.up
            until(down, 10)
            t = time.time()
            until(lambda: scraped_since(prom, t), 10)
            master.start()
            until(lambda: inst.store.up, 15)  # the prober's, once the stalled calls let go of the client
            inst.store.flush(30)  # puts that failed while it was dead are counted
            stats = inst.stack.stats()
            exporter.sample({"prefix": inst.cache.stats().to_dict(), "tiers": stats.to_dict()})
            t = time.time()
            until(lambda: scraped_since(prom, t), 10)
            yield prom, inst, stats, start, time.time()
        finally:
            inst.store.close()
            client.close()
            exporter.close()


def now(prom, expr: str) -> float:
    [sample] = prom.query(expr)
    return float(sample["value"][1])


@pytest.mark.slow
def test_prometheus_scraped_the_tier_counts(served):
    prom, inst, stats, *_ = served
    for tier, tokens in inst.hits.items():  # what the admissions got from each tier
        assert now(prom, f'mmcache_tier_hit_tokens_total{{tier="{tier}", kind="kv"}}') == tokens > 0
    assert now(prom, "sum(mmcache_tier_hit_tokens_total)") == now(prom, "mmcache_prefix_cache_hit_tokens_total")
    assert stats.store_mac_failures == stats.store_rejected == 1 and stats.store_late >= 1
    cells = counter_values({"prefix": inst.cache.stats().to_dict(), "tiers": stats.to_dict()})
    for (name, tier, kind), count in cells.items():  # every counter of the table, under its name and labels
        assert now(prom, f'mmcache_tier_{name}_total{{tier="{tier}", kind="{kind}"}}') == count, (name, tier)
    for field, (suffix, _) in STORE_COUNTERS.items():
        assert now(prom, f'mmcache_tier_store_{suffix}_total{{kind="kv"}}') == getattr(stats, field), field
    assert now(prom, 'mmcache_tier_host_pages{kind="kv"}') == stats.host_pages_held > 0


def test_prometheus_saw_the_store_go_down_and_up(served):
    prom, *_, start, end = served
    [series] = prom.query(f"mmcache_tier_store_up[{math.ceil(end - start)}s]", at=end)  # every sample scraped
    values = [float(v) for _, v in series["values"]]
    assert [v for k, v in enumerate(values) if k == 0 or v != values[k - 1]] == [1, 0, 1]


def test_prometheus_scraped_the_store_wait(served):
    prom, inst, stats, *_ = served
    wait = stats.store_wait
    assert now(prom, 'mmcache_tier_store_wait_seconds_count{kind="kv"}') == wait.count > 0
    assert now(prom, 'mmcache_tier_store_wait_seconds_sum{kind="kv"}') == pytest.approx(wait.sum)
    over = now(prom, 'mmcache_tier_store_wait_seconds_count{kind="kv"}') - now(
        prom, f'mmcache_tier_store_wait_seconds_bucket{{kind="kv", le="{DEADLINE_S / 2:g}"}}')
    assert over >= stats.store_late  # a late lookup waited the whole deadline


@pytest.mark.parametrize("title, ref, expr", TIER_QUERIES, ids=lambda x: re.sub(r"\W+", "-", str(x))[:48])
def test_every_tier_panel_query_returns_data(served, title, ref, expr):
    prom, *_, start, end = served
    window = duration(grafana_rate_interval(SCRAPE_S, STEP_S))
    series = prom.query_range(expr.replace("$__rate_interval", window), start, end, STEP_S)
    assert sum(math.isfinite(float(v)) for s in series for _, v in s["values"]) > 0, \
        f"panel {title!r} query {ref} returns no data: {expr}"


def test_the_dashboard_has_the_tier_panels():
    titles = {title for title, *_ in TIER_QUERIES}
    assert {"Live-request stalls and evicted pages", "Prefix hits by tier: device, host, store", "Shared store up",
            "Store admission wait p50/p99", "Store refusals and faults", "Host tier pages held"} == titles
