"""Serving metrics: what one request saw, and what a whole replay with the cache on or off adds up to.

Timeline (seconds, simulated by ``serving``): a request arrives at ``arrival_s``, starts at ``start_s >= arrival_s``
(one request at a time, FIFO) and holds the server for ``service_s``, the measured wall-clock time of its real model
calls. Its token and audio-chunk times are offsets from its start. Hence, per request:
- queueing delay = start - arrival; service time = the measured model time; end-to-end latency (E2E) = queueing +
  service;
- time to first token (TTFT) = queueing + first token offset; time to first audio (TTFA) likewise for audio chunks;
- inter-token latencies (ITL) = gaps between its consecutive tokens (pooled over requests when aggregated).

A failed request (an ``MmcacheError`` from serve) holds the server for the time it ran and counts in ``failed`` and
the makespan; it is left out of every latency, token and hit figure.

Aggregates over a run: p50/p90/p99 by linear interpolation (numpy's default) and the mean; makespan = last end -
first arrival; throughput = completed requests (and output tokens) per second of makespan; goodput = requests that
meet the ``SLO`` per second of makespan. Hit rates: ``prefix`` = hit tokens / prompt tokens, ``matched_page_share``
= matched pages / full prompt pages, and per encoder modality = items served from the store / items, each also as a
share of the workload's ceiling (the rate an unbounded cache would realize on the same requests).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Mapping

import numpy as np

LATENCIES = {"ttft": "TTFT", "itl": "ITL", "ttfa": "TTFA", "e2e": "E2E latency", "queue": "queueing delay",
             "service": "service time"}
PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """What a workload's ``serve`` reports about one request it completed (timings go to its ``Clock``).

    ``hit_tokens`` of the ``prompt_tokens`` came from the prefix cache, ``hit_pages`` of its ``prompt_pages`` full
    pages; ``encoder_hits[m]`` of its ``encoder_items[m]`` media items of modality ``m`` came from the encoder store.
    With the cache off every hit count is 0. ``"prefix"`` is not a modality name. ``videos``: whole videos the
    request generated (its output tokens are their frames, its E2E latency the per-video latency).
    """

    prompt_tokens: int = 0
    hit_tokens: int = 0
    prompt_pages: int = 0
    hit_pages: int = 0
    output_tokens: int = 0
    encoder_items: Mapping[str, int] = dataclasses.field(default_factory=dict)
    encoder_hits: Mapping[str, int] = dataclasses.field(default_factory=dict)
    videos: int = 0

    def uses(self):
        """``(cache, hits, total)`` per cache: ``prefix`` in tokens, then each modality in items."""
        yield "prefix", self.hit_tokens, self.prompt_tokens
        for m, n in self.encoder_items.items():
            yield m, self.encoder_hits.get(m, 0), n

    def hits(self) -> dict[str, bool]:
        """Hit flag per cache the request used: ``prefix`` (any matched token) and each modality (any item hit)."""
        return {cache: h > 0 for cache, h, n in self.uses() if n}


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One served request on the simulated timeline; ``result`` is None exactly when ``error`` is set."""

    rid: str
    session: str
    arrival_s: float
    start_s: float
    service_s: float
    result: RequestResult | None = None
    error: str | None = None
    token_s: tuple[float, ...] = ()     # offsets from start of each output token
    audio_s: tuple[float, ...] = ()     # offsets from start of each audio chunk
    stages: Mapping[str, float] = dataclasses.field(default_factory=dict)  # stage name -> seconds (see Clock.stage)
    error_type: str | None = None       # the failure's class (an MmcacheError subclass name) when ``error`` is set

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def queue_s(self) -> float:
        return self.start_s - self.arrival_s

    @property
    def end_s(self) -> float:
        return self.start_s + self.service_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.arrival_s

    @property
    def ttft_s(self) -> float | None:
        return self.queue_s + self.token_s[0] if self.token_s else None

    @property
    def ttfa_s(self) -> float | None:
        return self.queue_s + self.audio_s[0] if self.audio_s else None

    def latency(self, name: str) -> list[float]:
        """This request's values of latency ``name`` (a key of ``LATENCIES``): ITL gives one per token gap."""
        if name == "itl":
            return np.diff(self.token_s).tolist()
        value = getattr(self, f"{name}_s")
        return [] if value is None else [value]

    def to_dict(self) -> dict:
        r = self.result
        return {"rid": self.rid, "session": self.session, "arrival_s": self.arrival_s, "start_s": self.start_s,
                "queue_s": self.queue_s, "service_s": self.service_s, "e2e_s": self.e2e_s, "ttft_s": self.ttft_s,
                "ttfa_s": self.ttfa_s, "tokens": len(self.token_s), "audio_chunks": len(self.audio_s),
                "stages_s": dict(self.stages), "error": self.error, "error_type": self.error_type,
                **({} if r is None else {**dataclasses.asdict(r), "hits": r.hits()})}


@dataclasses.dataclass(frozen=True)
class SLO:
    """Latency bounds for goodput; a request meets the SLO when it completed and every set bound holds for it (a
    request without the bounded event, e.g. no audio under a TTFA bound, does not). No bound: every completed one."""

    ttft_s: float | None = None
    ttfa_s: float | None = None

    def met(self, rec: RequestRecord) -> bool:
        return rec.ok and all(v is not None and v <= bound for bound, v in
                              ((self.ttft_s, rec.ttft_s), (self.ttfa_s, rec.ttfa_s)) if bound is not None)

    def __str__(self) -> str:
        bounds = [f"{n} <= {1000 * b:g} ms" for n, b in (("TTFT", self.ttft_s), ("TTFA", self.ttfa_s)) if b is not None]
        return ", ".join(bounds) or "none"


@dataclasses.dataclass
class RunResult:
    """One replay: its records in service order, pool occupancy ``(t, pages_live, pages_cached, pages_free)``
    sampled at each request's end, the workload's final ``cache_stats()`` and its ``ceilings()``."""

    workload: str
    cached: bool
    schedule: str
    ceilings: dict[str, float]
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    occupancy: list[tuple[float, int, int, int]] = dataclasses.field(default_factory=list)
    cache_stats: dict = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    planned: int = 0             # requests in the schedule; more than len(records) when Ctrl-C stopped the run

    @property
    def interrupted(self) -> bool:
        return len(self.records) < self.planned

    def first(self, n: int) -> RunResult:
        """The same run cut to its first ``n`` records (and their occupancy samples), to compare with a run that
        served only those; ``cache_stats`` stays the final one."""
        return dataclasses.replace(self, records=self.records[:n], occupancy=self.occupancy[:n], planned=n)

    @property
    def label(self) -> str:
        return "on" if self.cached else "off"

    @property
    def completed(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the completed requests computed: their prompts less what the cache gave them."""
        return sum(r.result.prompt_tokens - r.result.hit_tokens for r in self.completed)

    @property
    def makespan_s(self) -> float:
        return max(r.end_s for r in self.records) - min(r.arrival_s for r in self.records) if self.records else 0.0

    def latencies(self, name: str) -> np.ndarray:
        """Latency ``name`` over the completed requests (ITL pooled over all their token gaps)."""
        return np.array([v for r in self.completed for v in r.latency(name)], dtype=float)


def percentiles(values) -> dict | None:
    """``{n, mean, p50, p90, p99}`` of ``values`` (linear interpolation), None when empty."""
    x = np.asarray(values, dtype=float)
    if not x.size:
        return None
    return {"n": int(x.size), "mean": float(x.mean()),
            **{f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(x, PERCENTILES))}}


def _cache_order(cache: str) -> tuple:
    return cache != "prefix", cache


def hit_rates(records) -> dict[str, float]:
    """Hit rate per cache over the completed ``records``; a cache no request used has no entry."""
    hits, totals = Counter(), Counter()
    for rec in records:
        if rec.ok:
            for cache, h, n in rec.result.uses():
                hits[cache] += h
                totals[cache] += n
    return {c: hits[c] / totals[c] for c in sorted(totals, key=_cache_order) if totals[c]}


def hit_rate_series(run: RunResult) -> dict[str, list[tuple[float, float]]]:
    """Cumulative hit rate per cache after each completed request: ``{cache: [(end_s, rate), ...]}``."""
    hits, totals, series = Counter(), Counter(), {}
    for rec in run.completed:
        for cache, h, n in rec.result.uses():
            hits[cache] += h
            totals[cache] += n
        for cache in sorted(totals, key=_cache_order):
            if totals[cache]:
                series.setdefault(cache, []).append((rec.end_s, hits[cache] / totals[cache]))
    return series


def stage_seconds(run: RunResult) -> dict[str, float]:
    """Measured seconds per ``Clock.stage`` name, summed over completed requests."""
    totals: dict[str, float] = {}
    for rec in run.completed:
        for name, s in rec.stages.items():
            totals[name] = totals.get(name, 0.0) + s
    return dict(sorted(totals.items()))


def _split(records, cache: str, hit: bool) -> dict:
    """Request count and median TTFT / TTFA / E2E / service time of the completed ``records`` that did (not) hit
    ``cache``. Service time leaves queueing out: the others carry the queue the requests before built up."""
    sel = [r for r in records if r.result.hits().get(cache) is hit]
    medians = {name: [v for r in sel for v in r.latency(name)] for name in ("ttft", "ttfa", "e2e", "service")}
    return {"requests": len(sel),
            **{f"{name}_p50_s": float(np.median(v)) if v else None for name, v in medians.items()}}


def failure_classes(run: RunResult) -> dict[str, dict]:
    """``{class: {"count", "first"}}`` of the failed requests: how many failed with each error class, and the first
    message of each (failures repeat: one reason per class is what a reader needs)."""
    out: dict[str, dict] = {}
    for r in run.records:
        if not r.ok:
            c = out.setdefault(r.error_type or "error", {"count": 0, "first": r.error})
            c["count"] += 1
    return out


def failure_lines(off: RunResult, on: RunResult) -> list[str]:
    """One line per failure class per run, for under the table: ``cache on: 3 x OutOfPages, first: ...``."""
    return [f"cache {run.label}: {c['count']:,} failed with {kind}, first: {c['first']}"
            for run in (off, on) for kind, c in failure_classes(run).items()]


def summarize(run: RunResult, slo: SLO = SLO()) -> dict:
    """Every aggregate of ``run`` as plain JSON-ready values (see the module docstring for definitions)."""
    done, span = run.completed, run.makespan_s
    per_s = lambda n: n / span if span > 0 else 0.0  # noqa: E731
    results = [r.result for r in done]
    rates = hit_rates(done)
    caches = sorted({c for r in results for c in r.hits()}, key=_cache_order)
    pages = sum(x.prompt_pages for x in results)
    return {
        "workload": run.workload, "cache": run.label, "schedule": run.schedule, "slo": str(slo),
        "requests": len(run.records), "completed": len(done), "failed": len(run.records) - len(done),
        "errors": [r.error for r in run.records if not r.ok],
        "failures": failure_classes(run),
        "makespan_s": span, "wall_s": run.wall_s,
        "throughput_rps": per_s(len(done)), "throughput_tps": per_s(sum(x.output_tokens for x in results)),
        "goodput_rps": per_s(sum(map(slo.met, run.records))),
        "latency_s": {name: percentiles(run.latencies(name)) for name in LATENCIES},
        "hit_rate": rates,
        "ceiling": dict(run.ceilings),
        "of_ceiling": {k: v / run.ceilings[k] for k, v in rates.items() if run.ceilings.get(k)},
        "matched_page_share": sum(x.hit_pages for x in results) / pages if pages else None,
        "hit_vs_miss": {c: {"hit": _split(done, c, True), "miss": _split(done, c, False)} for c in caches},
        "stalls": run.cache_stats.get("prefix", {}).get("stalls", 0),
        "stages_s": stage_seconds(run),
        "video": _video(done, per_s),
        "cache_stats": run.cache_stats,
    }


def _video(done: list[RequestRecord], per_s) -> dict | None:
    """Per-video E2E latency percentiles and frames per second of makespan, over requests that generated videos."""
    made = [r for r in done if r.result.videos]
    if not made:
        return None
    return {"videos": sum(r.result.videos for r in made), "latency_s": percentiles([r.e2e_s for r in made]),
            "frames_per_s": per_s(sum(r.result.output_tokens for r in made))}


def _row(label: str, off: float | None, on: float | None, fmt) -> tuple[str, str, str, str]:
    """A numeric row: both values formatted ("-" when absent) and on/off when both are numbers and off is not 0."""
    return (label, "-" if off is None else fmt(off), "-" if on is None else fmt(on),
            f"{on / off:.2f}x" if off and on is not None else "")


def _pct(rate: float | None, ceiling: float | None = None) -> str:
    if rate is None:
        return "-"
    return f"{100 * rate:.1f}%" + (f" ({100 * rate / ceiling:.0f}% of ceiling)" if ceiling else "")


def summary_rows(off: RunResult, on: RunResult, slo: SLO = SLO()) -> list[tuple[str, str, str, str]]:
    """``(metric, cache off, cache on, on/off)`` rows; latencies in ms, the ratio only where both are numbers."""
    a, b = summarize(off, slo), summarize(on, slo)
    rows = [("requests completed / failed", f"{a['completed']:,} / {a['failed']:,}",
             f"{b['completed']:,} / {b['failed']:,}", ""),
            _row("throughput (req/s)", a["throughput_rps"], b["throughput_rps"], "{:.2f}".format),
            _row("throughput (output tok/s)", a["throughput_tps"], b["throughput_tps"], "{:,.1f}".format),
            _row(f"goodput (req/s, SLO {slo})", a["goodput_rps"], b["goodput_rps"], "{:.2f}".format)]
    for name, label in LATENCIES.items():
        x, y = a["latency_s"][name] or {}, b["latency_s"][name] or {}
        if x or y:
            rows += [_row(f"{label} {q} (ms)", x.get(q), y.get(q), lambda s: f"{1000 * s:,.1f}")
                     for q in ("p50", "p90", "p99", "mean")]
    for cache in sorted(set(a["hit_rate"]) | set(b["hit_rate"]), key=_cache_order):
        ceiling = on.ceilings.get(cache)
        rows.append((f"{cache} hit rate" + (" (tokens)" if cache == "prefix" else " (items)"),
                     _pct(a["hit_rate"].get(cache)), _pct(b["hit_rate"].get(cache), ceiling), ""))
    for cache, split in b["hit_vs_miss"].items():  # service time: without the queue the requests before built up
        hit, miss = (split[k]["service_p50_s"] for k in ("hit", "miss"))
        rows.append((f"{cache} service p50 on hit / miss (ms)", "",
                     " / ".join("-" if v is None else f"{1000 * v:,.1f}" for v in (hit, miss)), ""))
    if a["matched_page_share"] is not None or b["matched_page_share"] is not None:
        rows.append(("matched-page share", _pct(a["matched_page_share"]), _pct(b["matched_page_share"]), ""))
    rows.append(("live-request stalls", f"{a['stalls']:,}", f"{b['stalls']:,}", ""))
    if a["video"] or b["video"]:
        x, y = a["video"] or {}, b["video"] or {}
        lx, ly = x.get("latency_s") or {}, y.get("latency_s") or {}
        rows += [_row(f"per-video latency {q} (ms)", lx.get(q), ly.get(q), lambda s: f"{1000 * s:,.1f}")
                 for q in ("p50", "p99")]
        rows.append(_row("video frames/s", x.get("frames_per_s"), y.get("frames_per_s"), "{:,.1f}".format))
    for stage in sorted(set(a["stages_s"]) | set(b["stages_s"])):
        rows.append(_row(f"{stage} time (s, total)", a["stages_s"].get(stage), b["stages_s"].get(stage),
                        "{:.3f}".format))
    return rows


def summary_table(off: RunResult, on: RunResult, slo: SLO = SLO()) -> str:
    """A fixed-width table of ``summary_rows``: metric | cache off | cache on | on/off."""
    head = ("metric", "cache off", "cache on", "on/off")
    rows = summary_rows(off, on, slo)
    widths = [max(len(h), *(len(row[k]) for row in rows)) for k, h in enumerate(head)]
    line = lambda cells: " | ".join(c.ljust(w) if k == 0 else c.rjust(w)  # noqa: E731
                                    for k, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])
