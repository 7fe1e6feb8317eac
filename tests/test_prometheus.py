"""Live Prometheus metrics: a real HTTP scrape of a tiny replay, parsed back; the Grafana dashboard's metric names."""

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from workloads.harness.prometheus import Exporter
from workloads.harness.serving import Schedule, compare

DASHBOARD = Path(__file__).resolve().parents[1] / "workloads" / "harness" / "grafana" / "mmcache_dashboard.json"

@pytest.fixture(scope="module")
def scraped(tiny_chat, tmp_path_factory):
    """Both runs of a replay observed by an exporter on a free loopback port, then one scrape over HTTP."""
    exporter = Exporter()
    port = exporter.serve(0)
    try:
        factory = tiny_chat.factory(pool_pages=40,
                               missing=frozenset({"s1t0"}))
        off, on = compare(factory, Schedule(), observer=exporter)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        exporter.close()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[s.name, tuple(sorted(s.labels.items()))] = s.value
    return off, on, samples


def value(samples, name, **labels):
    return samples[name, tuple(sorted(labels.items()))]


def test_scrape_matches_the_runs(scraped):
    off, on, samples = scraped
    assert value(samples, "mmcache_requests_total", outcome="ok") == len(off.completed) + len(on.completed) == 34
    assert value(samples, "mmcache_requests_total", outcome="error") == 2
    prefix = on.cache_stats["prefix"]  # the cache-off run never queries, so the counters are the cache-on run's
    for k in ("queries", "hits", "queried_tokens", "hit_tokens", "evicted_pages"):
        assert value(samples, f"mmcache_prefix_cache_{k}_total") == prefix[k]
    assert prefix["evicted_pages"] > 0
    assert value(samples, "mmcache_prefix_cache_hit_tokens_total") == sum(r.result.hit_tokens for r in on.completed)
    for state in ("free", "live", "cached"):
        assert value(samples, "mmcache_pool_pages", state=state) == prefix[f"pages_{state}"]
    for m, stats in on.cache_stats["encoder"]["by_modality"].items():
        assert value(samples, "mmcache_encoder_cache_queries_total", modality=m) == stats["queries"]
        assert value(samples, "mmcache_encoder_cache_hits_total", modality=m) == stats["hits"]
        assert value(samples, "mmcache_encoder_cache_bytes", modality=m) == stats["bytes_stored"] > 0
    assert value(samples, "mmcache_encoder_cache_hits_total", modality="speaker") == 2


@pytest.mark.parametrize("metric, latency", [("mmcache_time_to_first_token_seconds", "ttft"),
                                             ("mmcache_time_to_first_audio_seconds", "ttfa"),
                                             ("mmcache_inter_token_latency_seconds", "itl"),
                                             ("mmcache_e2e_request_latency_seconds", "e2e")])
def test_latency_histograms_per_cache_state(scraped, metric, latency):
    off, on, samples = scraped
    for run in (off, on):
        values = run.latencies(latency)
        assert value(samples, f"{metric}_count", cached=run.label) == values.size > 0
        assert value(samples, f"{metric}_sum", cached=run.label) == pytest.approx(values.sum())
        assert value(samples, f"{metric}_bucket", cached=run.label, le="+Inf") == values.size


def test_registry_is_dedicated(scraped):
    *_, samples = scraped
    assert {name for name, _ in samples if not name.startswith("mmcache_")} == set()  # no process_/python_ metrics


def test_grafana_dashboard_queries_only_exported_metrics(scraped):
    *_, samples = scraped
    exported = {name for name, _ in samples}
    board = json.loads(DASHBOARD.read_text())
    assert board["schemaVersion"] >= 39 and board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    assert all(p["datasource"]["uid"] == "${DS_PROMETHEUS}" for p in board["panels"])
    queried = {m for e in exprs for m in re.findall(r"\bmmcache_\w+", e)}
    assert queried - exported == set()
    assert {"mmcache_time_to_first_token_seconds_bucket", "mmcache_time_to_first_audio_seconds_bucket",
            "mmcache_prefix_cache_hit_tokens_total", "mmcache_encoder_cache_hits_total",
            "mmcache_pool_pages"} <= queried
    quantiles = [e for e in exprs if "histogram_quantile" in e]
    assert quantiles and all("by (le, cached)" in e and "_bucket[5m]" in e for e in quantiles)
