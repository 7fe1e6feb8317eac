"""Draw pool-size sweeps as a PNG: realized reuse (%) against pool tokens (log2 axis), each ceiling as a line, the
height fitted to the curves.

Uses matplotlib's Agg backend only (no display). Unbounded runs are not points: they are the ceiling line.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from workloads.sizes import format_size
from workloads.sizing.sweep import Sweep


def label_of(sweep: Sweep, eviction: bool = True) -> str:
    order = sweep.serving.describe()
    policy = sweep.runs[0].eviction if sweep.runs else sweep.ceiling.eviction
    return f"{sweep.trace.kind} ({order}{f', {policy}' if eviction else ''})"


def top_of(values: Sequence[float]) -> float:
    """The y axis's top for ``values`` (percentages): a tenth above the highest, up to the next multiple of 5 (10
    past 50), at most 100; so the curves fill the height however small the reuse is."""
    step = 10 if max(values, default=0) > 50 else 5
    return min(100.0, step * math.ceil(max(max(values, default=0) * 1.1, step) / step))


def plot_sweeps(sweeps: Sequence[Sweep], title: str | None = None) -> bytes:
    """One PNG with a line per sweep and a dashed ceiling per sweep, as bytes (``workloads.output_files`` writes
    them). The y axis ends just above the highest point or ceiling; what the sweeps share (the trace and how it was
    served) goes in the title once, and each legend entry names what differs."""
    import io

    import matplotlib
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    shared = len({(id(s.trace), s.serving) for s in sweeps}) == 1
    label = (lambda s, eviction=True: s.runs[0].eviction if s.runs and eviction else "") if shared else label_of
    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    ticks: set[int] = set()
    heights: list[float] = []
    for k, sweep in enumerate(sweeps):
        color = f"C{k}"
        finite = sorted((r for r in sweep.runs if r.pool_tokens is not None), key=lambda r: r.pool_tokens)
        if finite:
            xs = [r.pool_tokens for r in finite]
            ticks.update(xs)
            heights += [100 * r.hit_rate for r in finite]
            ax.plot(xs, [100 * r.hit_rate for r in finite], "o-", color=color,
                    label=f"{label(sweep)}: realized".lstrip(": "))
        best = sorted((o for o in sweep.optimal if o is not None and o.pool_tokens is not None),
                      key=lambda r: r.pool_tokens)
        if k == 0 or sweep.trace is not sweeps[0].trace:  # the optimum and the ceiling of the same calls: once
            if best:
                heights += [100 * r.hit_rate for r in best]
                ax.plot([r.pool_tokens for r in best], [100 * r.hit_rate for r in best], "s:", color="black",
                        label=f"{label(sweep, False)}: offline optimum".lstrip(": "))
            heights.append(100 * sweep.ceiling.hit_rate)
            ax.axhline(100 * sweep.ceiling.hit_rate, color=color, linestyle="--", linewidth=1,
                       label=f"{label(sweep, False)}: ceiling {100 * sweep.ceiling.hit_rate:.1f}%".lstrip(": "))
    if ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [format_size(t) for t in sorted(ticks)])
    ax.set_xlabel("pool size (tokens)")
    ax.set_ylabel("realized reuse (% of prompt tokens)")
    ax.set_ylim(0, top_of(heights))
    ax.grid(True, alpha=0.3)
    first = sweeps[0]
    source = "/".join(Path(first.trace.source).parts[-2:])
    served = f"\n{first.trace.kind}, {first.serving.describe()}" if shared else ""
    ax.set_title(title or f"{source}: page {first.page_size}, {first.requests:,} requests{served}", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
