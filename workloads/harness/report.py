"""A cache-on vs cache-off report: one self-contained HTML file and the same numbers as JSON.

The HTML needs nothing but itself: plots are PNGs (matplotlib's Agg backend, no display) embedded as base64
``data:`` URIs, styles are inline, there are no scripts and no external links. It holds the summary table, latency
CDFs with the cache off and on (one plot per latency that has data), the cumulative hit rate per cache against its
ceiling and the pool occupancy over time (cache-on run), the measured time per stage off vs on (the saving per
encoder modality and for prefill), and the counters per tier and kind (``mmcache.stats.COUNTERS``: the names and
meanings Prometheus exports them under) with what each counts. The JSON holds both runs' ``metrics.summarize``, the
table rows, the savings, the time series, the counter rows and every request record.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np

from mmcache.stats import COUNTERS, counter_values
from workloads.harness.metrics import LATENCIES, SLO, RunResult, hit_rate_series, stage_seconds, summarize, summary_rows

_STYLE = {False: dict(color="C3", label="cache off"), True: dict(color="C0", label="cache on")}


def savings(off: RunResult, on: RunResult) -> dict[str, float]:
    """Seconds saved per stage (off total - on total), for every stage either run timed."""
    a, b = stage_seconds(off), stage_seconds(on)
    return {k: a.get(k, 0.0) - b.get(k, 0.0) for k in sorted(set(a) | set(b))}


def counter_rows(off: RunResult, on: RunResult) -> list[dict]:
    """``{name, tier, kind, off, on}`` per counter cell of ``COUNTERS`` (in its order) that either run's final
    ``cache_stats`` holds: the value after each run (0 where a run's caches lack it)."""
    a, b = counter_values(off.cache_stats), counter_values(on.cache_stats)
    keys = [(c.name, cell.tier, cell.kind) for c in COUNTERS for cell in c.cells]
    return [{"name": n, "tier": t, "kind": k, "off": a.get((n, t, k), 0), "on": b.get((n, t, k), 0)}
            for n, t, k in keys if (n, t, k) in a or (n, t, k) in b]


def report_json(off: RunResult, on: RunResult, slo: SLO = SLO()) -> dict:
    """Everything in the report as JSON-ready values."""
    runs = {"off": off, "on": on}
    return {
        "workload": on.workload, "schedule": on.schedule, "slo": str(slo),
        "summary": {k: summarize(r, slo) for k, r in runs.items()},
        "table": [dict(zip(("metric", "off", "on", "on/off"), row)) for row in summary_rows(off, on, slo)],
        "savings_s": savings(off, on),
        "counters": counter_rows(off, on),
        "hit_rate_series": {k: hit_rate_series(r) for k, r in runs.items()},
        "occupancy": {k: [dict(zip(("t", "pages_live", "pages_cached", "pages_free"), s)) for s in r.occupancy]
                      for k, r in runs.items()},
        "requests": {k: [rec.to_dict() for rec in r.records] for k, r in runs.items()},
    }


def _figure(width: float = 6.0, height: float = 3.6):
    import matplotlib
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    return fig, fig.add_subplot()


def _png(fig) -> str:
    """The figure as a ``data:image/png;base64`` URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _cdf(off: RunResult, on: RunResult, name: str) -> str | None:
    """Empirical CDF of latency ``name`` for both runs (ms), None when neither has a value."""
    values = {run.cached: np.sort(run.latencies(name)) * 1000 for run in (off, on)}
    if not any(v.size for v in values.values()):
        return None
    fig, ax = _figure()
    for cached, v in values.items():
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", **_STYLE[cached])
    ax.set_xlabel(f"{LATENCIES[name]} (ms)")
    ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of token gaps")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{LATENCIES[name]}: CDF, cache off vs on", fontsize=10)
    return _png(fig)


def _hit_rates(on: RunResult) -> str | None:
    """Cumulative hit rate per cache over the cache-on run, each ceiling dashed."""
    series = hit_rate_series(on)
    if not series:
        return None
    fig, ax = _figure()
    for k, (cache, points) in enumerate(series.items()):
        t, rate = zip(*points)
        ax.plot(t, 100 * np.array(rate), color=f"C{k}", label=f"{cache} ({'tokens' if cache == 'prefix' else 'items'})")
        if on.ceilings.get(cache) is not None:
            ax.axhline(100 * on.ceilings[cache], color=f"C{k}", linestyle="--", linewidth=1,
                       label=f"{cache} ceiling {100 * on.ceilings[cache]:.1f}%")
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylabel("cumulative hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_title("hit rate over time, cache on", fontsize=10)
    return _png(fig)


def _occupancy(on: RunResult) -> str | None:
    """Pool pages in use, live and cached after each request of the cache-on run, on an axis scaled to the pages in
    use (a large pool mostly free would leave them an invisible strip); the pool size and peak use in the title.
    Live and cached overlap (a matched page is both), so they are lines over the pages in use, not a stack."""
    if not on.occupancy:
        return None
    t, live, cached, free = map(np.array, zip(*on.occupancy))
    pool = int((live + cached + free).min())  # exact at any sample without overlap; overlap only adds
    used = pool - free
    fig, ax = _figure()
    ax.fill_between(t, used, step="post", color="0.85", label="in use")
    ax.step(t, cached, where="post", color="C0", label="cached (indexed)")
    ax.step(t, live, where="post", color="C3", label="live (held by requests in flight)")
    ax.set_xlabel("time (s, simulated)")
    ax.set_ylabel("pages")
    ax.set_ylim(0, max(1.0, 1.15 * float(used.max())))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(f"prefix-cache pool, cache on: {pool:,} pages, at most {int(used.max()):,} in use "
                 f"({100 * used.max() / pool:.1f}%)", fontsize=10)
    return _png(fig)


def saving_label(before: float, after: float) -> str:
    """``saved X s (Y%)``, ``took X s more``, or ``no change`` when the difference is within timing noise (under
    1% of the larger time and under 5 ms)."""
    diff = before - after
    if abs(diff) < max(0.01 * max(before, after), 0.005):
        return "no change"
    return f"saved {diff:.3f} s ({100 * diff / before:.0f}%)" if diff > 0 else f"took {-diff:.3f} s more"


def _savings(off: RunResult, on: RunResult) -> str | None:
    """Measured seconds per stage with the cache off and on, each pair labeled with the saving."""
    a, b, saved = stage_seconds(off), stage_seconds(on), savings(off, on)
    if not saved:
        return None
    fig, ax = _figure(6.0, 1.2 + 0.6 * len(saved))
    y = np.arange(len(saved))
    for cached, totals, dy in ((False, a, 0.2), (True, b, -0.2)):
        ax.barh(y + dy, [totals.get(k, 0.0) for k in saved], height=0.4, **_STYLE[cached])
    for yk, k in zip(y, saved):
        ax.annotate(saving_label(a.get(k, 0.0), b.get(k, 0.0)), (max(a.get(k, 0.0), b.get(k, 0.0)), yk),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(y, list(saved))
    ax.invert_yaxis()
    ax.margins(x=0.3)
    ax.set_xlabel("measured time, all requests (s)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("time per stage (encoder modalities, prefill): saved by the cache", fontsize=10)
    return _png(fig)


def _counters_html(off: RunResult, on: RunResult) -> str:
    """The counters per tier and kind (one row per cell, both runs), then what each counter counts; empty when the
    caches have none."""
    rows = counter_rows(off, on)
    if not rows:
        return ""
    e = html.escape
    cells = "\n".join("<tr>" + "".join(f"<td>{e(str(r[k]))}</td>" for k in ("name", "tier", "kind"))
                      + "".join(f"<td>{r[k]:,}</td>" for k in ("off", "on")) + "</tr>" for r in rows)
    names = dict.fromkeys(r["name"] for r in rows)
    meanings = "".join(f"<dt>{e(c.name)}</dt><dd>{e(c.meaning)}</dd>" for c in COUNTERS if c.name in names)
    return f"""<h2>Counters by tier and kind</h2>
<p>Tiers: device pool, host tier, shared store; kinds: KV pages, encoder outputs. Prometheus exports each as
<code>mmcache_tier_&lt;counter&gt;_total{{tier, kind}}</code>.</p>
<table><tr><th>counter</th><th>tier</th><th>kind</th><th>cache off</th><th>cache on</th></tr>
{cells}
</table>
<dl>{meanings}</dl>"""


def report_html(off: RunResult, on: RunResult, slo: SLO = SLO()) -> str:
    """The self-contained HTML report (see the module docstring)."""
    e = html.escape
    plots = [("Cache behaviour", [p for p in (_hit_rates(on), _occupancy(on), _savings(off, on)) if p]),
             ("Latency CDFs", [p for p in (_cdf(off, on, name) for name in LATENCIES) if p])]
    rows = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in summary_rows(off, on, slo))
    sections = "\n".join(f"<h2>{e(title)}</h2>\n<div class=grid>" + "".join(f'<img alt="plot" src="{p}">' for p in ps)
                         + "</div>" for title, ps in plots if ps)
    errors = "".join(f"<li>cache {r.label}: {e(rec.error)}</li>" for r in (off, on) for rec in r.records if not rec.ok)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>mmcache: {e(on.workload)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 10px; border-bottom: 1px solid #ddd; }}
td:not(:first-child), th:not(:first-child) {{ text-align: right; font-variant-numeric: tabular-nums; }}
.grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }}
img {{ width: 100%; border: 1px solid #eee; }}
dt {{ font-weight: 600; }} dd {{ margin: 0 0 4px 1.5em; }}
</style></head><body>
<h1>mmcache: {e(on.workload)}, cache on vs off</h1>
<p>schedule {e(on.schedule)}; {len(on.records):,} requests; SLO {e(str(slo))}; one request at a time, FIFO,
latencies = simulated queueing + measured service time.</p>
<h2>Summary</h2>
<table><tr><th>metric</th><th>cache off</th><th>cache on</th><th>on/off</th></tr>
{rows}
</table>
{f"<h2>Failed requests</h2><ul>{errors}</ul>" if errors else ""}
{_counters_html(off, on)}
{sections}
</body></html>
"""


def write_report(off: RunResult, on: RunResult, html_path: str | Path, json_path: str | Path,
                 slo: SLO = SLO()) -> tuple[Path, Path]:
    """Write the HTML report and its JSON, each atomically (``workloads.output_files``); returns both paths."""
    from workloads.output_files import write_atomic
    return (write_atomic(html_path, report_html(off, on, slo)),
            write_atomic(json_path, json.dumps(report_json(off, on, slo), indent=2) + "\n"))
