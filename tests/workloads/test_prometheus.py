"""Live Prometheus metrics: a real HTTP scrape of a tiny replay, parsed back; the tier series of a cache with a host
tier and a store (in-process); the Grafana dashboard's metric names. (A real Prometheus server evaluating every
dashboard query: test_prometheus_server.py, and the tier panels on a real Mooncake master: test_prometheus_tiers.py.)"""

import json
import re
import urllib.request

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mmcache.stats import COUNTERS, counter_values
from mmcache.tiers import MemoryStore
from tier_traffic import P, TieredCache, prompts, publish_as_another_instance, traffic
from workloads.harness.metrics import SLO
from workloads.harness.prometheus import DASHBOARD, Exporter, cache_outcome, dashboard_queries
from workloads.harness.serving import Schedule, compare
from workloads.harness.tier_series import STORE_COUNTERS, TIER_SERIES

SLO_ = SLO(ttft_s=0.05)

@pytest.fixture(scope="module")
def scraped(tiny_chat, tmp_path_factory):
    """Both runs of a replay observed by an exporter on a free loopback port, then one scrape over HTTP."""
    exporter = Exporter(slo=SLO_)
    port = exporter.serve(0)
    try:
        factory = tiny_chat.factory(pool_pages=40,
                               missing=frozenset({"s1t0"}))
        off, on = compare(factory, Schedule(), observer=exporter)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    return off, on, parse(text)


def parse(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels):
    return samples[name, tuple(sorted(labels.items()))]


class BreakableStore(MemoryStore):
    """An in-process store whose reads fail once ``broken`` (a dead store, as the tier sees one)."""

    broken = False

    def get_many(self, keys):
        if self.broken:
            raise ConnectionError("store unreachable")
        return super().get_many(keys)


@pytest.fixture(scope="module")
def tiered():
    """(instance, its final TierStats, samples): an exporter sampled after every request of tier traffic (every tier
    hits), one entry under another key, one of another page layout, then a failed read that marks the store down
    (``down_failures=1``, ``down_rate=0.01``: one failure in the window is enough here)."""
    exporter = Exporter()
    shared = BreakableStore(256)
    inst = TieredCache(shared, publish_async=False, deadline_s=None, down_failures=1, down_rate=0.01)
    try:
        sample = lambda: exporter.sample(inst.cache_stats())  # noqa: E731
        sample()
        traffic(inst, prompts(4), sample)
        forged, other_layout, last = prompts(3, seed=9)
        publish_as_another_instance(shared, forged, key=b"another-key-0123456789abcdef")
        publish_as_another_instance(shared, other_layout, dtype=torch.float16)
        assert inst.serve(forged) == inst.serve(other_layout) == 0
        shared.broken = True
        inst.cache.clear()
        assert inst.serve(last) == 0 and not inst.store.up
        sample()
        text = generate_latest(exporter.registry).decode()
    finally:
        inst.store.close()
    return inst, inst.stack.stats(), parse(text)


def test_tier_series_follow_the_tier_stats(tiered):
    inst, stats, samples = tiered
    for tier, tokens in inst.hits.items():  # what the admissions got, tier by tier
        assert value(samples, "mmcache_tier_hit_tokens_total", tier=tier, kind="kv") == tokens > 0
    assert sum(inst.hits.values()) == value(samples, "mmcache_prefix_cache_hit_tokens_total")
    assert stats.store_mac_failures == stats.store_rejected == stats.store_read_errors == 1
    assert stats.store_published_pages > 0 and stats.host_evicted_pages >= stats.host_freed_pages > 0
    cells = counter_values({"prefix": inst.cache.stats().to_dict(), "tiers": stats.to_dict()})
    assert {(t, k) for _, t, k in cells} == {("device", "kv"), ("host", "kv"), ("store", "kv")}
    for (name, tier, kind), count in cells.items():  # every counter of the table, under its name
        assert value(samples, f"mmcache_tier_{name}_total", tier=tier, kind=kind) == count, (name, tier)
    for field, (suffix, _) in STORE_COUNTERS.items():
        assert value(samples, f"mmcache_tier_store_{suffix}_total", kind="kv") == getattr(stats, field), field
    assert value(samples, "mmcache_tier_store_up") == 0
    assert value(samples, "mmcache_tier_host_pages", kind="kv") == stats.host_pages_held == 6
    wait = stats.store_wait
    count = value(samples, "mmcache_tier_store_wait_seconds_count", kind="kv")
    assert count == wait.count == stats.store_batches > 0  # one lookup per batch here: chains of 3 pages
    assert value(samples, "mmcache_tier_store_wait_seconds_sum", kind="kv") == pytest.approx(wait.sum)
    buckets = [value(samples, "mmcache_tier_store_wait_seconds_bucket", kind="kv", le=le)
               for le in [*(repr(b) for b in wait.bounds), "+Inf"]]
    assert buckets == sorted(buckets) and buckets[-1] == count


def test_tier_series_stay_monotonic_across_fresh_caches(tiered):
    _, stats, before = tiered
    exporter = Exporter()
    exporter.sample({"tiers": stats.to_dict()})
    exporter.new_caches()  # a fresh instance: its statistics start at 0 again, the series do not go back
    fresh = TieredCache(MemoryStore(64), publish_async=False, deadline_s=None)
    exporter.sample(fresh.cache_stats())
    after = parse(generate_latest(exporter.registry).decode())
    assert value(after, "mmcache_tier_mac_failures_total", tier="store", kind="kv") == 1
    assert value(after, "mmcache_tier_hit_tokens_total", tier="host", kind="kv") == stats.host_adopted_pages * P
    assert value(after, "mmcache_tier_store_wait_seconds_count", kind="kv") == stats.store_wait.count
    assert value(after, "mmcache_tier_store_up") == 1 and value(after, "mmcache_tier_host_pages", kind="kv") == 0


def test_scrape_matches_the_runs(scraped):
    off, on, samples = scraped
    assert value(samples, "mmcache_requests_total", outcome="ok") == len(off.completed) + len(on.completed) == 34
    assert value(samples, "mmcache_requests_total", outcome="error") == 2
    prefix = on.cache_stats["prefix"]  # the cache-off run never queries, so the counters are the cache-on run's
    for k in ("queries", "hits", "queried_tokens", "hit_tokens", "stalls"):
        assert value(samples, f"mmcache_prefix_cache_{k}_total") == prefix[k]
    for k in ("evicted_pages", "freed_pages"):  # the counters by tier and kind: the device's KV pages
        assert value(samples, f"mmcache_tier_{k}_total", tier="device", kind="kv") == prefix[k]
    assert prefix["evicted_pages"] >= prefix["freed_pages"] > 0
    assert value(samples, "mmcache_prefix_cache_hit_tokens_total") == sum(r.result.hit_tokens for r in on.completed)
    for state in ("free", "live", "cached"):
        assert value(samples, "mmcache_pool_pages", state=state) == prefix[f"pages_{state}"]
    for m, stats in on.cache_stats["encoder"]["by_modality"].items():
        assert value(samples, "mmcache_encoder_cache_queries_total", modality=m) == stats["queries"]
        assert value(samples, "mmcache_encoder_cache_hits_total", modality=m) == stats["hits"]
        assert value(samples, "mmcache_encoder_cache_bytes", modality=m) == stats["bytes_stored"] > 0
        assert value(samples, "mmcache_encoder_cache_saved_seconds_total", modality=m) == pytest.approx(
            stats["time_saved_s"])
    assert value(samples, "mmcache_encoder_cache_hits_total", modality="speaker") == 2
    assert value(samples, "mmcache_prefix_cache_prompt_pages_total") == sum(r.result.prompt_pages for r in on.completed)
    assert value(samples, "mmcache_prefix_cache_matched_pages_total") == sum(r.result.hit_pages for r in on.completed)
    for run in (off, on):
        assert value(samples, "mmcache_requests_slo_met_total", cached=run.label) == sum(map(SLO_.met, run.records))


def test_series_exist_at_zero_before_the_first_request():
    registry = Exporter().registry  # nothing observed yet: every panel's series is already there, at 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples}
    assert value(samples, "mmcache_time_to_first_audio_seconds_count", cached="on", cache_outcome="miss") == 0
    assert value(samples, "mmcache_requests_slo_met_total", cached="off") == 0
    assert value(samples, "mmcache_pool_pages", state="live") == 0
    by_tier = {k: v for k, v in samples.items() if k[0].startswith(TIER_SERIES) and k[0].endswith("_total")}
    device_kv = (("kind", "kv"), ("tier", "device"))  # no tiers sampled: only the device's KV counters, at 0
    assert by_tier == {(f"mmcache_tier_{c.name}_total", device_kv): 0 for c in COUNTERS
                       if any((cell.tier, cell.kind) == ("device", "kv") for cell in c.cells)}


@pytest.mark.parametrize("metric, latency", [("mmcache_time_to_first_token_seconds", "ttft"),
                                             ("mmcache_time_to_first_audio_seconds", "ttfa"),
                                             ("mmcache_inter_token_latency_seconds", "itl"),
                                             ("mmcache_e2e_request_latency_seconds", "e2e"),
                                             ("mmcache_request_queue_time_seconds", "queue"),
                                             ("mmcache_request_inference_time_seconds", "service")])
def test_latency_histograms_per_cache_state(scraped, metric, latency):
    off, on, samples = scraped
    for run in (off, on):
        for hit in ("hit", "miss"):
            values = [v for r in run.completed if cache_outcome(r) == hit for v in r.latency(latency)]
            labels = dict(cached=run.label, cache_outcome=hit)
            assert value(samples, f"{metric}_count", **labels) == len(values)
            assert value(samples, f"{metric}_sum", **labels) == pytest.approx(sum(values))
            assert value(samples, f"{metric}_bucket", le="+Inf", **labels) == len(values)
        assert sum(value(samples, f"{metric}_count", cached=run.label, cache_outcome=h) for h in ("hit", "miss")) \
            == run.latencies(latency).size > 0
    assert value(samples, f"{metric}_count", cached="off", cache_outcome="hit") == 0  # cache off: all misses
    assert value(samples, f"{metric}_count", cached="on", cache_outcome="hit") > 0


def test_registry_is_dedicated(scraped):
    *_, samples = scraped
    assert {name for name, _ in samples if not name.startswith("mmcache_")} == set()  # no process_/python_ metrics


def test_grafana_dashboard_queries_only_exported_metrics(scraped, tiered):
    exported = {name for samples in (scraped[-1], tiered[-1]) for name, _ in samples}
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39 and board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    [var] = board["templating"]["list"]  # provisioned without the import step, the variable picks the data source
    assert (var["name"], var["type"], var["query"]) == ("DS_PROMETHEUS", "datasource", "prometheus")
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" and
               all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]) for p in board["panels"])
    exprs = [e for *_, e in dashboard_queries()]
    queried = {m for e in exprs for m in re.findall(r"\bmmcache_\w+", e)}
    assert queried - exported == set()
    assert {"mmcache_time_to_first_token_seconds_bucket", "mmcache_time_to_first_audio_seconds_bucket",
            "mmcache_prefix_cache_hit_tokens_total", "mmcache_encoder_cache_hits_total", "mmcache_pool_pages",
            "mmcache_prefix_cache_stalls_total", "mmcache_requests_slo_met_total",
            "mmcache_encoder_cache_saved_seconds_total", "mmcache_prefix_cache_matched_pages_total",
            "mmcache_tier_hit_tokens_total", "mmcache_tier_store_up", "mmcache_tier_store_wait_seconds_bucket",
            "mmcache_tier_mac_failures_total", "mmcache_tier_rejected_total", "mmcache_tier_evicted_pages_total",
            "mmcache_tier_host_pages"} <= queried
    quantiles = [e for e in exprs if "histogram_quantile" in e]
    assert quantiles and all(re.search(r"by \(le, (cached|cache_outcome|kind)\)", e) and "_bucket" in e
                             and "[$__rate_interval]" in e for e in quantiles)
    assert all("[5m]" not in e for e in exprs)  # Grafana sizes the window to the scrape interval
    assert sum('cache_outcome' in e and 'first_audio' in e for e in quantiles) == 2  # TTFA p50/p99 hit vs miss
    ids = [p["id"] for p in board["panels"]]
    assert len(set(ids)) == len(ids)


def test_the_dashboards_doc_lists_every_counter_in_table_order():
    doc = (DASHBOARD.parents[3] / "docs" / "dashboards.md").read_text()
    table = doc.split("### Counters by tier and kind", 1)[1]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == [c.name for c in COUNTERS]
