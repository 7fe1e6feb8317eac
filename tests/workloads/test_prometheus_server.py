"""A real Prometheus server scrapes a real replay of the ``mixed`` workload (every modality), then every query of the
Grafana dashboard is evaluated through Prometheus's HTTP API as Grafana would draw it: each returns data. (The queries
of the host tier and the store read series only a cache with tiers has: test_prometheus_tiers.py evaluates them.)

The server is Debian's ``prometheus`` binary, started here on 127.0.0.1 with a generated config (``promserver``);
the replay is ``python -m workloads replay mixed`` in a child process, its endpoint kept up (``--metrics-linger``)
until the final state has been scraped. Skips only where no ``prometheus`` binary is installed.
"""

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workloads.harness.prometheus import dashboard_queries
from workloads.harness.promserver import PrometheusServer, duration, free_port, grafana_rate_interval
from workloads.harness.tier_series import reads_lower_tiers

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="no prometheus binary: apt-get install prometheus (.ci/run does)")
ROOT = Path(__file__).resolve().parents[2]
SCRAPE_S, STEP_S, LINGER_S = 0.25, 1.0, 2.0
TTFA_SLO_S = 0.1


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """(server, report JSON, start, end): the replay served and scraped to its final state; the server still up."""
    out = tmp_path_factory.mktemp("replay") / "mixed.json"
    port = free_port()
    with PrometheusServer([f"127.0.0.1:{port}"], SCRAPE_S) as prom:
        deadline = time.monotonic() + 30  # the scrape manager picks a new config's targets up within ~5 s
        while not prom.targets_up() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prom.targets_up(), "prometheus never listed the replay's target"
        start = time.time()
        done = subprocess.run([sys.executable, "-m", "workloads", "replay", "mixed", "--limit", "2",
                               "--metrics-port", str(port), "--metrics-linger", str(LINGER_S),
                               "--slo-ttfa", str(TTFA_SLO_S), "--json", str(out), "--no-progress"],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        yield prom, json.loads(out.read_text()), start, time.time()


def _finite_points(series: list[dict]) -> int:
    return sum(math.isfinite(float(v)) for s in series for _, v in s["values"])


@pytest.mark.slow
def test_prometheus_scraped_the_final_state(scraped):
    prom, report, start, end = scraped
    final = lambda selector: prom.query(f"last_over_time({selector}[{math.ceil(end - start)}s])")  # noqa: E731
    runs = report["summary"]
    ok = sum(runs[k]["completed"] for k in ("off", "on"))
    assert ok == 24 and {"audio", "image", "text", "video"} <= set(runs["on"]["hit_rate"])  # every modality ran
    [sample] = final('mmcache_requests_total{outcome="ok"}')  # the target is down (stale) now
    assert float(sample["value"][1]) == ok
    [ttfa] = final('mmcache_time_to_first_audio_seconds_count{cached="on", cache_outcome="hit"}')
    hits = [r for r in report["requests"]["on"] if r["ttfa_s"] is not None and any(r["hits"].values())]
    assert float(ttfa["value"][1]) == len(hits) > 0
    for cached in ("off", "on"):
        [met] = final(f'mmcache_requests_slo_met_total{{cached="{cached}"}}')
        assert float(met["value"][1]) == round(runs[cached]["goodput_rps"] * runs[cached]["makespan_s"])


@pytest.mark.parametrize("title, ref, expr", [q for q in dashboard_queries() if not reads_lower_tiers(q[2])],
                         ids=lambda x: re.sub(r"\W+", "-", str(x))[:48])
def test_every_dashboard_query_returns_data(scraped, title, ref, expr):
    prom, _, start, end = scraped
    window = duration(grafana_rate_interval(SCRAPE_S, STEP_S))
    series = prom.query_range(expr.replace("$__rate_interval", window), start, end, STEP_S)
    assert _finite_points(series) > 0, f"panel {title!r} query {ref} returns no data: {expr}"


@pytest.mark.parametrize("split, values", [("cached", {"on", "off"}), ("cache_outcome", {"hit", "miss"})])
def test_first_audio_panels_show_both_sides(scraped, split, values):
    prom, _, start, end = scraped
    [(title, _, expr)] = [q for q in dashboard_queries() if "first audio" in q[0] and f"le, {split})" in q[2]
                          and q[2].startswith("histogram_quantile(0.5")]
    window = duration(grafana_rate_interval(SCRAPE_S, STEP_S))
    series = prom.query_range(expr.replace("$__rate_interval", window), start, end, STEP_S)
    assert {s["metric"][split] for s in series if _finite_points([s])} == values, title
