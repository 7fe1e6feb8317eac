"""Draw pool-size sweeps as a PNG: realized reuse (%) against pool tokens (log2 axis), each ceiling as a line.

Uses matplotlib's Agg backend only (no display). Unbounded runs are not points: they are the ceiling line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from workloads.sizes import format_size
from workloads.sizing.sweep import Sweep


def label_of(sweep: Sweep, eviction: bool = True) -> str:
    order = sweep.serving.describe()
    policy = sweep.runs[0].eviction if sweep.runs else sweep.ceiling.eviction
    return f"{sweep.trace.kind} ({order}{f', {policy}' if eviction else ''})"


def plot_sweeps(sweeps: Sequence[Sweep], title: str | None = None) -> bytes:
    """One PNG with a line per sweep and a dashed ceiling per sweep, as bytes (``workloads.output_files`` writes
    them)."""
    import io

    import matplotlib
    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), dpi=120)
    ax = fig.add_subplot()
    ticks: set[int] = set()
    for k, sweep in enumerate(sweeps):
        color = f"C{k}"
        finite = sorted((r for r in sweep.runs if r.pool_tokens is not None), key=lambda r: r.pool_tokens)
        if finite:
            xs = [r.pool_tokens for r in finite]
            ticks.update(xs)
            ax.plot(xs, [100 * r.hit_rate for r in finite], "o-", color=color, label=f"{label_of(sweep)}: realized")
        best = sorted((o for o in sweep.optimal if o is not None and o.pool_tokens is not None),
                      key=lambda r: r.pool_tokens)
        if k == 0 or sweep.trace is not sweeps[0].trace:  # the optimum and the ceiling of the same calls: once
            if best:
                ax.plot([r.pool_tokens for r in best], [100 * r.hit_rate for r in best], "s:", color="black",
                        label=f"{label_of(sweep, False)}: offline optimum")
            ax.axhline(100 * sweep.ceiling.hit_rate, color=color, linestyle="--", linewidth=1,
                       label=f"{label_of(sweep, False)}: ceiling {100 * sweep.ceiling.hit_rate:.1f}%")
    if ticks:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(ticks), [format_size(t) for t in sorted(ticks)])
    ax.set_xlabel("pool size (tokens)")
    ax.set_ylabel("realized reuse (% of prompt tokens)")
    ax.set_ylim(0, 100)
    ax.grid(True, alpha=0.3)
    first = sweeps[0]
    source = "/".join(Path(first.trace.source).parts[-2:])
    ax.set_title(title or f"{source}: page {first.page_size}, "
                          f"{first.requests:,} requests", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
