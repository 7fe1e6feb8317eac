"""A pool-size sweep of one text trace: one replay per size plus the unbounded ceiling, as a table and as JSON.

The ceiling is always run first (reused when ``inf`` is among the sizes), so "of ceiling" is defined for every run,
also in a sweep that Ctrl-C stopped part way. It records the chains every call looks up, so each pool size is also
replayed under the offline optimum of the same calls (``mmcache.eviction.OfflineOptimal``): "of optimal" says what a
better policy could still buy at that size, "of ceiling" what more memory would.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from mmcache.eviction import DEFAULT_POLICY, LookupRecorder
from workloads.service import ServiceModel
from workloads.sizes import format_size
from workloads.sizing.ordering import Serving
from workloads.sizing.replay import CacheObserver, ReplayObserver, ReplayRun, replay_trace
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


def replays_of(pool_sizes: Sequence[int | None], eviction: str = DEFAULT_POLICY, optimal: bool = True,
               tiers: TierModel = TierModel()) -> int:
    """How many replays ``run_sweep`` makes with these arguments (each serves every call of the trace once): the
    ceiling, one per bounded size, and the optimum at each bounded size unless ``eviction`` is it."""
    bounded = sum(size is not None for size in pool_sizes)
    return 1 + bounded + (bounded if optimal and not tiers.enabled and eviction != "optimal" else 0)


def run_sweep(trace: TextTrace, *, page_size: int, pool_sizes: Sequence[int | None], serving: Serving = Serving(),
              service: ServiceModel = ServiceModel(), tiers: TierModel = TierModel(),
              observer: CacheObserver | None = None, eviction: str = DEFAULT_POLICY, optimal: bool = True,
              watch: ReplayObserver | None = None, finished: Callable[[Sweep, int], None] | None = None) -> Sweep:
    """Replay ``trace`` as ``serving`` says unbounded (the ceiling, recording its lookups), then once per pool size (None = unbounded:
    the ceiling again) evicting by ``eviction`` (a policy's name or ``"optimal"``), and, with ``optimal``, once more
    under the offline optimum; every bounded pool gets ``tiers`` (host tier, store) under it; ``observer`` samples
    every replay's cache. Belady's rule is the optimum of one pool: with tiers under it, where a page the device
    drops may still be served from below, it is not, so a sweep with tiers replays no optimum.

    Ctrl-C (KeyboardInterrupt) after the ceiling stops the sweep with the sizes replayed so far and ``interrupted``
    set; every run in a sweep is a complete replay. During the ceiling it propagates: nothing was measured.

    ``watch`` is told of every call every replay serves (a progress bar over ``replays_of`` replays);
    ``finished(sweep, i)`` is called as soon as size ``i`` and its optimum are replayed, the sweep holding the runs so
    far (so a table can print its row then)."""
    optimal = optimal and not tiers.enabled
    recorder = LookupRecorder()

    def one(size, policy, watched=True):  # the optimum is a yardstick: no observer samples it
        return replay_trace(trace, page_size=page_size, pool_tokens=size, serving=serving, service=service,
                            tiers=tiers, observer=observer if watched else None,
                            eviction=policy, lookups=recorder.lookups, watch=watch)
    ceiling = one(None, recorder)
    ceiling.eviction = eviction
    sweep = Sweep(trace, page_size, serving, service, [], ceiling, tiers)
    runs, best = sweep.runs, sweep.optimal
    try:
        for size in pool_sizes:
            runs.append(ceiling if size is None else one(size, eviction))
            if size is None or not optimal:
                best.append(ceiling if size is None else None)
            else:
                best.append(runs[-1] if eviction == "optimal" else one(size, "optimal", watched=False))
            if finished is not None:
                finished(sweep, len(runs) - 1)
    except KeyboardInterrupt:  # a size replayed whose optimum was not keeps its row, with no "of optimal"
        sweep.interrupted = True
        best += [None] * (len(runs) - len(best))
    return sweep


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


HEAD = ("pool tokens", "hit tokens", "realized reuse %", "of optimal %", "of ceiling %", "evicted pages", "stalls",
        "failed")
TIER_HEAD = ("device %", "host %", "store %", "mean TTFT s")
MIN_WIDTH = 11  # "1,234,567,890" overflows it and shifts its row; every column is at least as wide as its header


def _line(cells: Sequence[str]) -> str:
    return " | ".join(c.rjust(max(len(h), MIN_WIDTH)) for c, h in zip(cells, HEAD + TIER_HEAD))


def table_head(sweep: Sweep) -> str:
    """The table's header and its rule: pool tokens | hit tokens | realized reuse % | of optimal % | of ceiling % |
    evicted pages | stalls | failed, and with tiers device % | host % | store % | mean TTFT s."""
    head = HEAD + (TIER_HEAD if sweep.tiers.enabled else ())
    return "\n".join([_line(head), "-+-".join("-" * max(len(h), MIN_WIDTH) for h in head)])


def table_row(sweep: Sweep, i: int) -> str:
    """Row ``i`` (``sweep.runs[i]``), in the columns of ``table_head``; "of optimal" is blank where the optimum was
    not replayed."""
    r, share = sweep.runs[i], sweep.of_optimal(i)
    row = (format_size(r.pool_tokens), f"{r.hit_tokens:,}", f"{100 * r.hit_rate:.2f}",
           "" if share is None else f"{100 * share:.1f}", f"{100 * sweep.of_ceiling(r):.1f}", f"{r.evicted_pages:,}",
           f"{r.stalls:,}", f"{r.failed:,}")
    if sweep.tiers.enabled:  # reuse per tier and the TTFT model that charges transfers
        row += tuple(f"{100 * t / r.prompt_tokens:.2f}" if r.prompt_tokens else "0.00"
                     for t in (r.device_hit_tokens, r.host_hit_tokens, r.store_hit_tokens)) + (f"{r.mean_ttft_s:.3f}",)
    return _line(row)


def format_table(sweep: Sweep) -> str:
    """The whole table: ``table_head`` and a ``table_row`` per run."""
    return "\n".join([table_head(sweep), *(table_row(sweep, i) for i in range(len(sweep.runs)))])
