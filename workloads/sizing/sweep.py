"""A pool-size sweep of one text trace: one replay per size plus the unbounded ceiling, as a table and as JSON.

The ceiling is always run first (reused when ``inf`` is among the sizes), so "of ceiling" is defined for every run,
also in a sweep that Ctrl-C stopped part way. It records the chains every call looks up, so each pool size is also
replayed under the offline optimum of the same calls (``mmcache.eviction.OfflineOptimal``): "of optimal" says what a
better policy could still buy at that size, "of ceiling" what more memory would.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from mmcache.eviction import DEFAULT_POLICY, LookupRecorder
from workloads.service import ServiceModel
from workloads.sizes import format_size
from workloads.sizing.ordering import Serving
from workloads.sizing.replay import CacheObserver, ReplayRun, replay_trace
from workloads.sizing.tiers import TierModel
from workloads.traces.text_trace import TextTrace


@dataclasses.dataclass
class Sweep:
    trace: TextTrace
    page_size: int
    serving: Serving
    service: ServiceModel
    runs: list[ReplayRun]        # in the order the sizes were given
    ceiling: ReplayRun           # the unbounded run
    tiers: TierModel = TierModel()
    interrupted: bool = False    # Ctrl-C stopped it before every size was replayed
    optimal: list[ReplayRun | None] = dataclasses.field(default_factory=list)  # the offline optimum at each size

    @property
    def requests(self) -> int:
        return self.ceiling.requests

    @property
    def prompt_tokens(self) -> int:
        return self.ceiling.prompt_tokens

    def of_ceiling(self, run: ReplayRun) -> float:
        return run.hit_tokens / self.ceiling.hit_tokens if self.ceiling.hit_tokens else 0.0

    def of_optimal(self, i: int) -> float | None:
        """``runs[i]``'s hit tokens over the offline optimum's at its size (None when it was not replayed)."""
        opt = self.optimal[i] if i < len(self.optimal) else None
        if opt is None:
            return None
        return self.runs[i].hit_tokens / opt.hit_tokens if opt.hit_tokens else 1.0


def run_sweep(trace: TextTrace, *, page_size: int, pool_sizes: Sequence[int | None], serving: Serving = Serving(),
              service: ServiceModel = ServiceModel(), progress: bool = False,
              tiers: TierModel = TierModel(), observer: CacheObserver | None = None,
              eviction: str = DEFAULT_POLICY, optimal: bool = True) -> Sweep:
    """Replay ``trace`` as ``serving`` says unbounded (the ceiling, recording its lookups), then once per pool size (None = unbounded:
    the ceiling again) evicting by ``eviction`` (a policy's name or ``"optimal"``), and, with ``optimal``, once more
    under the offline optimum; every bounded pool gets ``tiers`` (host tier, store) under it; ``observer`` samples
    every replay's cache. Belady's rule is the optimum of one pool: with tiers under it, where a page the device
    drops may still be served from below, it is not, so a sweep with tiers replays no optimum.

    Ctrl-C (KeyboardInterrupt) after the ceiling stops the sweep with the sizes replayed so far and ``interrupted``
    set; every run in a sweep is a complete replay. During the ceiling it propagates: nothing was measured."""
    optimal = optimal and not tiers.enabled
    recorder = LookupRecorder()

    def one(size, policy, watched=True):  # the optimum is a yardstick: no observer samples it
        return replay_trace(trace, page_size=page_size, pool_tokens=size, serving=serving, service=service,
                            progress=progress, tiers=tiers, observer=observer if watched else None,
                            eviction=policy, lookups=recorder.lookups)
    ceiling, runs, best, interrupted = one(None, recorder), [], [], False
    ceiling.eviction = eviction
    try:
        for size in pool_sizes:
            runs.append(ceiling if size is None else one(size, eviction))
            if size is None or not optimal:
                best.append(ceiling if size is None else None)
            else:
                best.append(runs[-1] if eviction == "optimal" else one(size, "optimal", watched=False))
    except KeyboardInterrupt:  # a size replayed whose optimum was not keeps its row, with no "of optimal"
        interrupted = True
        best += [None] * (len(runs) - len(best))
    return Sweep(trace, page_size, serving, service, runs, ceiling, tiers, interrupted, optimal=best)


def sweep_json(sweep: Sweep) -> dict:
    """The JSON document ``mmcache replay --json`` writes."""
    return {
        "trace": sweep.trace.source,
        "kind": sweep.trace.kind,
        "page_size": sweep.page_size,
        "requests": sweep.requests,
        "sessions": len(sweep.trace.sessions),
        "prompt_tokens": sweep.prompt_tokens,
        "ceiling_hit_tokens": sweep.ceiling.hit_tokens,
        "ceiling_hit_rate": sweep.ceiling.hit_rate,
        "order": sweep.serving.order,
        "serving": {**dataclasses.asdict(sweep.serving), "in_service": sweep.serving.cap},
        "service_model": dataclasses.asdict(sweep.service) if sweep.serving.clocked else None,
        "tiers": dataclasses.asdict(sweep.tiers) if sweep.tiers.enabled else None,
        "eviction": sweep.runs[0].eviction if sweep.runs else sweep.ceiling.eviction,
        "runs": [{**r.to_dict(), "of_ceiling": sweep.of_ceiling(r), "of_optimal": sweep.of_optimal(i),
                  "optimal_hit_tokens": None if (o := sweep.optimal[i]) is None else o.hit_tokens}
                 for i, r in enumerate(sweep.runs)],
        "interrupted": sweep.interrupted,
        "malformed_lines": sweep.trace.malformed,
        "errors": [str(e) for e in sweep.trace.errors[:100]],
    }


def format_table(sweep: Sweep) -> str:
    """A fixed-width table: pool tokens | hit tokens | realized reuse % | of optimal % | of ceiling % | evicted
    pages | stalls | failed. "of optimal" is blank where the optimum was not replayed."""
    head = ("pool tokens", "hit tokens", "realized reuse %", "of optimal %", "of ceiling %", "evicted pages",
            "stalls", "failed")

    def of_optimal(i):
        share = sweep.of_optimal(i)
        return "" if share is None else f"{100 * share:.1f}"
    rows = [(format_size(r.pool_tokens), f"{r.hit_tokens:,}", f"{100 * r.hit_rate:.2f}", of_optimal(i),
             f"{100 * sweep.of_ceiling(r):.1f}", f"{r.evicted_pages:,}", f"{r.stalls:,}", f"{r.failed:,}")
            for i, r in enumerate(sweep.runs)]
    if sweep.tiers.enabled:  # reuse per tier and the TTFT model that charges transfers
        head += ("device %", "host %", "store %", "mean TTFT s")
        rows = [row + tuple(f"{100 * t / r.prompt_tokens:.2f}" if r.prompt_tokens else "0.00"
                            for t in (r.device_hit_tokens, r.host_hit_tokens, r.store_hit_tokens))
                + (f"{r.mean_ttft_s:.3f}",) for row, r in zip(rows, sweep.runs)]
    widths = [max([len(h), *(len(row[k]) for row in rows)]) for k, h in enumerate(head)]
    line = lambda cells: " | ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), "-+-".join("-" * w for w in widths), *map(line, rows)])
