"""The ``mmcache`` command line.

    mmcache replay [TARGET] [--pool-tokens 64k,128k,inf] [--order timestamp|round-robin] [--in-flight K]
                   [--page-size P] [--json OUT.json] [--plot OUT.png] [--limit N] [--data PATH]

TARGET is a registered workload (``mooncake``, ``agent``; see ``workloads.catalog``), a Mooncake JSONL file, or a
folder of mini-swe-agent trajectories; without it the embedded Mooncake slice is replayed. ``main`` returns the
exit status: 0 on success, 2 on a usage, workload or trace error (printed as ``mmcache: error: ...``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mmcache.errors import TraceError

from . import catalog
from .ordering import ORDERS
from .sizes import format_size, parse_size, parse_sizes
from .sweep import format_table, run_sweep, sweep_json
from .text_replay import ServiceModel

DEFAULT_POOLS = "64k,256k,1M,4M,16M,inf"
TEXT_PAGE_SIZE = 128
_SHOWN_ERRORS = 5


def _sizes(text: str) -> list[int | None]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _count(text: str) -> int:
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value is None:
        raise argparse.ArgumentTypeError("must be finite")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache", description="Exact prefix and encoder reuse for multimodal "
                                     "serving: measure it on real traces.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    names = ", ".join(sorted(catalog.WORKLOADS))
    rp = sub.add_parser("replay", help="replay a trace through the prefix cache at several pool sizes",
                        description="Replay a trace through a metadata-only prefix cache at several pool sizes and "
                        "report realized reuse (prompt tokens served from the cache) against the unbounded ceiling.")
    rp.add_argument("target", nargs="?", metavar="TRACE",
                    help=f"workload name ({names}), Mooncake JSONL file, or folder of mini-swe-agent trajectories; "
                    "default: the embedded Mooncake slice")
    rp.add_argument("--data", metavar="PATH", help=f"shared data folder for workload names (default: "
                    f"${catalog.DATA_ENV}, else ../shared/data)")
    rp.add_argument("--page-size", type=int, metavar="P",
                    help=f"tokens per page (Mooncake: 512, fixed by its block ids; text: {TEXT_PAGE_SIZE})")
    rp.add_argument("--pool-tokens", type=_sizes, default=parse_sizes(DEFAULT_POOLS), metavar="SIZES",
                    help=f"comma-separated pool sizes in tokens: 64k, 1M (binary), plain ints, inf "
                    f"(default: {DEFAULT_POOLS})")
    rp.add_argument("--order", choices=ORDERS, default="timestamp",
                    help="timestamp: the trace's own arrival times; round-robin: K sessions interleaved")
    rp.add_argument("--in-flight", type=int, default=8, metavar="K",
                    help="live sessions/requests in round-robin order (default 8)")
    rp.add_argument("--limit", type=_count, metavar="N",
                    help="replay only the first N sessions (Mooncake: requests; agent: trajectories)")
    rp.add_argument("--prefill-rate", type=float, default=ServiceModel.prefill_tokens_per_s, metavar="TOK_S",
                    help="timestamp order: uncached prompt tokens prefilled per second (default %(default)g)")
    rp.add_argument("--tpot", type=float, default=ServiceModel.s_per_output_token, metavar="S",
                    help="timestamp order: seconds per output token (default %(default)g)")
    rp.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    rp.add_argument("--plot", type=Path, metavar="OUT.png", help="draw realized reuse vs pool size as a PNG")
    rp.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return parser


def _fail(message: str) -> int:
    print(f"mmcache: error: {message}", file=sys.stderr)
    return 2


def _warn_malformed(trace) -> None:
    if not trace.errors:
        return
    print(f"warning: skipped {trace.malformed} malformed line(s)/file(s) in {trace.source}:", file=sys.stderr)
    for e in trace.errors[:_SHOWN_ERRORS]:
        print(f"  {e}", file=sys.stderr)
    if trace.malformed > _SHOWN_ERRORS:
        print(f"  ... and {trace.malformed - _SHOWN_ERRORS} more", file=sys.stderr)


def replay_command(args) -> int:
    if args.in_flight < 1:
        return _fail(f"--in-flight must be >= 1, got {args.in_flight}")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return _fail("--prefill-rate must be > 0 and --tpot >= 0")
    try:
        kind, path = catalog.resolve(args.target, args.data)
    except catalog.UnknownWorkload as e:
        return _fail(str(e))
    if kind == "mooncake" and args.page_size not in (None, 512):
        return _fail(f"Mooncake traces fix the page size at 512 (one hash id per 512-token block); "
                     f"got --page-size {args.page_size}")
    if args.page_size is not None and args.page_size < 1:
        return _fail(f"--page-size must be >= 1, got {args.page_size}")
    started = time.perf_counter()
    try:
        trace = catalog.load(kind, path, limit=args.limit)
    except TraceError as e:
        return _fail(str(e))
    _warn_malformed(trace)
    if not trace.sessions:
        return _fail(f"no usable requests in {path}")
    page_size = args.page_size or trace.page_size or TEXT_PAGE_SIZE
    loaded = time.perf_counter() - started
    in_flight = f", {args.in_flight} in flight" if args.order == "round-robin" else ""
    print(f"{trace.kind} trace {path}: {trace.num_requests:,} requests in {len(trace.sessions):,} sessions, "
          f"{trace.prompt_tokens:,} prompt tokens; page size {page_size}, order {args.order}{in_flight} "
          f"(loaded in {loaded:.1f} s)")
    service = ServiceModel(args.prefill_rate, args.tpot)
    sweep = run_sweep(trace, page_size=page_size, pool_sizes=args.pool_tokens, order=args.order,
                      in_flight=args.in_flight, service=service,
                      progress=not args.no_progress and sys.stderr.isatty())
    print(format_table(sweep))
    c = sweep.ceiling
    print(f"ceiling (unbounded pool): {c.hit_tokens:,} of {c.prompt_tokens:,} prompt tokens = "
          f"{100 * c.hit_rate:.2f}%; total {time.perf_counter() - started:.1f} s")
    if args.json:
        args.json.write_text(json.dumps(sweep_json(sweep), indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        from .sweep_plot import plot_sweeps
        plot_sweeps([sweep], args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "replay":
        return replay_command(args)
    return _fail(f"unknown command {args.command!r}")  # pragma: no cover (argparse rejects it first)


if __name__ == "__main__":
    sys.exit(main())
