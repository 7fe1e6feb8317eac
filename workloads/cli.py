"""The ``mmcache`` command line.

    mmcache replay [TARGET] [--pool-tokens 64k,128k,inf] [--order timestamp|round-robin] [--in-flight K]
                   [--page-size P] [--json OUT.json] [--plot OUT.png] [--limit N] [--data PATH]
    mmcache replay MODEL_WORKLOAD [--data [PATH]] [--model PATH] [--limit N] [--schedule trace|poisson:RATE|closed:N]
                   [--seed S] [--slo-ttft S] [--slo-ttfa S] [--html OUT.html] [--json OUT.json]
                   [--metrics-port PORT] [--page-size P] [--max-new-tokens N] [--pool-pages N] [--encoder-bytes SIZE]

Trace replay: TARGET is a registered text workload (``mooncake``, ``agent``; see ``workloads.registry``), a Mooncake
JSONL file, or a folder of mini-swe-agent trajectories; without it the embedded Mooncake slice is replayed through a
metadata-only prefix cache at several pool sizes, no model involved.

Model replay: MODEL_WORKLOAD (``vlm-chat``, ``image-gen``, ``voice-clone``, ``agent-model``, ``mooncake-model``,
``mixed``) serves its requests through real models with the cache off, then on, on the same schedule, and prints
both runs side by side (latencies, goodput at the SLO, hit rates against their ceilings, time per stage). Without
``--data`` the workload's embedded default runs; ``--data`` alone reads ``$MMCACHE_DATA`` or ../shared/data.

``main`` returns the exit status: 0 on success, 2 on a usage, workload, model or trace error (printed as
``mmcache: error: ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from mmcache.errors import MmcacheError, TraceError

from workloads import registry

from workloads.models import mixed
from workloads.harness.metrics import SLO, summary_table
from workloads.options import ModelWorkloadOptions
from workloads.sizing.ordering import ORDERS
from workloads.harness.prometheus import Exporter
from workloads.harness.report import report_json, write_report
from workloads.harness.serving import Schedule, compare
from workloads.sizes import parse_size, parse_sizes
from workloads.sizing.sweep import format_table, run_sweep, sweep_json
from workloads.sizing.replay import ServiceModel

DEFAULT_POOLS = "64k,256k,1M,4M,16M,inf"
TEXT_PAGE_SIZE = 128
_SHOWN_ERRORS = 5
TEXT_ONLY = ("pool_tokens", "order", "in_flight", "plot", "prefill_rate", "tpot")
MODEL_ONLY = ("model", "schedule", "seed", "slo_ttft", "slo_ttfa", "html", "metrics_port", "max_new_tokens",
              "pool_pages", "encoder_bytes")


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
    names = ", ".join(sorted(registry.WORKLOADS))
    models = ", ".join(registry.MODEL_WORKLOADS)
    defaults = ModelWorkloadOptions()
    epilog = "model workloads:\n" + "\n".join(f"  {w.name:15} {w.description}"
                                              for w in registry.MODEL_WORKLOADS.values())
    rp = sub.add_parser("replay", help="replay a trace through the prefix cache, or a model workload cache off vs on",
                        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter,
                        description="Replay a trace through a metadata-only prefix cache at several pool sizes "
                        "and report realized reuse\n(prompt tokens served from the cache) against the unbounded "
                        "ceiling; or serve a model workload with the cache off,\nthen on, on the same schedule and "
                        "compare what users would see.")
    rp.add_argument("target", nargs="?", metavar="TARGET",
                    help=f"text workload name ({names}), Mooncake JSONL file, or folder of mini-swe-agent "
                    f"trajectories (default: the embedded Mooncake slice); or a model workload ({models})")
    rp.add_argument("--data", metavar="PATH", nargs="?", const="",
                    help=f"shared data folder for workload names (default: ${registry.DATA_ENV}, else "
                    "../shared/data); a model workload runs its embedded default unless --data is given")
    rp.add_argument("--page-size", type=int, metavar="P",
                    help=f"tokens per page (Mooncake: 512, fixed by its block ids; text: {TEXT_PAGE_SIZE}; "
                    f"model workloads: {defaults.page_size})")
    rp.add_argument("--pool-tokens", type=_sizes, default=parse_sizes(DEFAULT_POOLS), metavar="SIZES",
                    help=f"comma-separated pool sizes in tokens: 64k, 1M (binary), plain ints, inf "
                    f"(default: {DEFAULT_POOLS})")
    rp.add_argument("--order", choices=ORDERS, default="timestamp",
                    help="timestamp: the trace's own arrival times; round-robin: K sessions interleaved")
    rp.add_argument("--in-flight", type=int, default=8, metavar="K",
                    help="live sessions/requests in round-robin order (default 8)")
    rp.add_argument("--limit", type=_count, metavar="N",
                    help="replay only the first N sessions (Mooncake: requests; agent: trajectories; model "
                    "workloads: requests, each with a default cap)")
    rp.add_argument("--prefill-rate", type=float, default=ServiceModel.prefill_tokens_per_s, metavar="TOK_S",
                    help="timestamp order: uncached prompt tokens prefilled per second (default %(default)g)")
    rp.add_argument("--tpot", type=float, default=ServiceModel.s_per_output_token, metavar="S",
                    help="timestamp order: seconds per output token (default %(default)g)")
    rp.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    rp.add_argument("--plot", type=Path, metavar="OUT.png", help="draw realized reuse vs pool size as a PNG")
    rp.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    mg = rp.add_argument_group("model workload options")
    mg.add_argument("--model", type=Path, metavar="PATH",
                    help="a local model folder (save_pretrained layout) instead of the tiny model built from config")
    mg.add_argument("--schedule", metavar="SPEC", help="arrivals: trace (default), poisson:RATE (requests/s) or "
                    "closed:N (clients)")
    mg.add_argument("--seed", type=int, metavar="S", help=f"seed of the poisson arrivals and generated data "
                    f"(default {defaults.seed})")
    mg.add_argument("--slo-ttft", type=float, metavar="S", help="goodput counts requests with TTFT <= S seconds")
    mg.add_argument("--slo-ttfa", type=float, metavar="S", help="goodput counts requests with TTFA <= S seconds")
    mg.add_argument("--html", type=Path, metavar="OUT.html",
                    help="write the HTML report (and its JSON next to it unless --json is given)")
    mg.add_argument("--metrics-port", type=int, metavar="PORT",
                    help="serve Prometheus metrics on 127.0.0.1:PORT/metrics during the replay (0: any free port)")
    mg.add_argument("--max-new-tokens", type=int, metavar="N",
                    help=f"tokens generated per request (default {defaults.max_new_tokens})")
    mg.add_argument("--pool-pages", type=int, metavar="N",
                    help=f"KV pages in the prefix cache's pool (default {defaults.pool_pages}); size it to the "
                         f"model: pages x layers x 2 x page size x kv heads x head dim x dtype bytes")
    mg.add_argument("--encoder-bytes", type=_count, metavar="SIZE",
                    help=f"bytes of each encoder store, e.g. 256M, 2G (default {defaults.encoder_bytes >> 20}M)")
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


def _given(args, defaults: dict, dests) -> list[str]:
    """The options among ``dests`` set to something other than their default, as flags."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) != defaults[d]]


def replay_command(args, defaults: dict) -> int:
    """``defaults``: the replay options' defaults, to tell which options were given."""
    if args.target in registry.MODEL_WORKLOADS:
        if misused := _given(args, defaults, TEXT_ONLY):
            return _fail(f"{', '.join(misused)}: only for trace replays, not for model workload {args.target!r}")
        return model_replay_command(args)
    if misused := _given(args, defaults, MODEL_ONLY):
        return _fail(f"{', '.join(misused)}: only for model workloads ({', '.join(registry.MODEL_WORKLOADS)})")
    if args.in_flight < 1:
        return _fail(f"--in-flight must be >= 1, got {args.in_flight}")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return _fail("--prefill-rate must be > 0 and --tpot >= 0")
    try:
        kind, path = registry.resolve(args.target, args.data)
    except registry.UnknownWorkload as e:
        return _fail(str(e))
    if kind == "mooncake" and args.page_size not in (None, 512):
        return _fail(f"Mooncake traces fix the page size at 512 (one hash id per 512-token block); "
                     f"got --page-size {args.page_size}")
    if args.page_size is not None and args.page_size < 1:
        return _fail(f"--page-size must be >= 1, got {args.page_size}")
    started = time.perf_counter()
    try:
        trace = registry.load(kind, path, limit=args.limit)
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
        from workloads.sizing.plot import plot_sweeps
        plot_sweeps([sweep], args.plot)
        print(f"wrote {args.plot}")
    return 0


def _options(args) -> ModelWorkloadOptions:
    """The workload options the command line sets; the rest keep ``ModelWorkloadOptions``' defaults."""
    given = {"data": registry.model_data(args.target, args.data), "model": args.model, "limit": args.limit,
             "seed": args.seed, "page_size": args.page_size, "max_new_tokens": args.max_new_tokens,
             "pool_pages": args.pool_pages, "encoder_bytes": args.encoder_bytes}
    return ModelWorkloadOptions(**{k: v for k, v in given.items() if v is not None})


def _model_folder_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a model folder, or None."""
    if not path.is_dir():
        return "no such folder" if not path.exists() else "not a folder"
    if not os.access(path, os.R_OK | os.X_OK):
        return "permission denied"
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no config.json (not a save_pretrained folder)"
    except (OSError, ValueError) as e:
        return f"cannot read {config}: {e}"
    return None


def model_replay_command(args) -> int:
    """Serve a model workload cache off, then on (``serving.compare``); print the table, write the reports."""
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--page-size", args.page_size),
                        ("--pool-pages", args.pool_pages), ("--encoder-bytes", args.encoder_bytes),
                        ("--slo-ttft", args.slo_ttft), ("--slo-ttfa", args.slo_ttfa)):
        if value is not None and not value > 0:
            return _fail(f"{flag} must be > 0, got {value}")
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        return _fail(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    try:
        schedule = Schedule.parse(args.schedule or "trace", seed=args.seed or 0)
    except ValueError as e:
        return _fail(str(e))
    if args.model is not None and (problem := _model_folder_problem(args.model)):
        return _fail(f"--model {args.model}: {problem}")
    slo = SLO(ttft_s=args.slo_ttft, ttfa_s=args.slo_ttfa)
    from transformers.utils import logging as transformers_logging
    transformers_logging.disable_progress_bar()  # per-shard bars on every load; our own progress line suffices
    threads = torch.get_num_threads()
    if args.model is None:  # tiny models: one intra-op thread is fastest; a spinning pool only adds contention
        torch.set_num_threads(1)
    try:
        return _serve_model_workload(args, schedule, slo)
    finally:
        torch.set_num_threads(threads)


def _serve_model_workload(args, schedule: Schedule, slo: SLO) -> int:
    name = args.target
    started = time.perf_counter()
    try:
        options = _options(args)
        if name == "mixed":
            names, missing = mixed.available()
            print(f"mixed: {', '.join(names) or 'no component'}"
                  + "".join(f"\n  skipped {n}: {why}" for n, why in missing.items()))
        make = registry.model_factory(name, options)
    except registry.UnknownWorkload as e:
        return _fail(str(e))
    except (MmcacheError, OSError, ValueError) as e:  # bad data (file:line), or a model folder transformers refuses
        where = f" with --model {args.model}" if args.model is not None else ""
        return _fail(f"cannot build workload {name!r}{where}: {str(e).strip().splitlines()[0]}")
    source = "embedded default" if options.data is None else options.data / registry.MODEL_WORKLOADS[name].data_path
    print(f"{name} ({source}): model {options.model or 'tiny, built from config'}; page size {options.page_size}, "
          f"{options.max_new_tokens} new tokens per request, schedule {schedule} (loaded in "
          f"{time.perf_counter() - started:.1f} s); cache off, then on")
    exporter = None
    if args.metrics_port is not None:
        exporter = Exporter()
        try:
            port = exporter.serve(args.metrics_port)
        except OSError as e:
            return _fail(f"--metrics-port {args.metrics_port}: {e}")
        print(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
    try:
        off, on = compare(make, schedule, observer=exporter, progress=not args.no_progress and sys.stderr.isatty())
    finally:
        if exporter is not None:
            exporter.close()
    print(summary_table(off, on, slo))
    print(f"total {time.perf_counter() - started:.1f} s")
    if args.html:
        paths = write_report(off, on, args.html, args.json or args.html.with_suffix(".json"), slo)
        print("wrote " + " and ".join(map(str, paths)))
    elif args.json:
        args.json.write_text(json.dumps(report_json(off, on, slo), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "replay":
        return replay_command(args, vars(parser.parse_args(["replay"])))
    return _fail(f"unknown command {args.command!r}")  # pragma: no cover (argparse rejects it first)


if __name__ == "__main__":
    sys.exit(main())
