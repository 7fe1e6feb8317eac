"""``mmcache replay MODEL_WORKLOAD``: a model workload served through real models, cache off then on.

MODEL_WORKLOAD (``vlm-chat``, ``image-gen``, ``voice-clone``, ``voice-mstar``, ``vlm-mstar``, ``agent-model``,
``mooncake-model``, ``mixed``) serves its requests through real models with the cache off, then on, on the same
schedule, and prints both runs side by side (latencies, goodput at the SLO, hit rates against their ceilings, time per
stage). Without ``--data`` the workload's embedded default runs; ``--data`` alone reads ``$MMCACHE_DATA``, else the
data folder ``mmcache data fetch`` fills (``workloads.registry.data_place``). With ``--in-flight N`` the text
workloads (``ENGINE_WORKLOADS``) are served through transformers' continuous-batching engine with N requests in
flight, cache off (its sharing off) then on (mmcache under it), every latency measured
(``workloads.harness.engine_serving``); without it one request is served at a time and queueing is simulated. The M*
workloads (``MSTAR_WORKLOADS``: ``voice-mstar``, M*'s Orpheus; ``vlm-mstar``, vlm-chat's image questions through M*'s
Qwen3-Omni vision encoder and thinker) are always served through M*'s own ``Engine``, N in flight (default 1), M*'s KV
resource for cache off and mmcache's for cache on (``workloads.harness.mstar_serving``), and print the prompt rows each
run computed.

The options of a trace replay (``TEXT_ONLY``) are refused here; with ``--replicas`` a model workload's data is
replayed over replicas instead, no model run (``workloads.commands.replica_replay``). The cache, torch and the model
libraries are imported when the replay runs, not at import.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from workloads import registry
from workloads.commands import common
from workloads.commands.common import (
    INTERRUPTED,
    byte_size,
    fail,
    given_flags,
    metrics_problem,
    nonnegative_seconds,
    progress_bars,
    report_held_interrupt,
    save_output,
    with_metrics,
)
from workloads.interrupts import hold_interrupts
from workloads.options import ModelWorkloadOptions

MAX_PAGES = 1 << 31  # page ids are int32 in the pool and the prefix index
ENGINE_WORKLOADS = ("agent-model", "mooncake-model")  # token-id prompts: what the continuous-batching engine takes
MSTAR_WORKLOADS = ("voice-mstar", "vlm-mstar")  # served through M*'s Engine only
# the options of a trace replay (``workloads.commands.trace_replay``), refused for a model workload
TEXT_ONLY = ("pool_tokens", "order", "sessions", "in_service", "pin_sessions", "plot", "prefill_rate", "tpot", "format", "tokenizer", "replicas",
             "router", "affinity_threshold", "key_pages", "host_tokens", "store_tokens", "host_bw", "store_bw",
             "kv_bytes_per_token", "eviction")


def add_options(rp, defaults: ModelWorkloadOptions) -> None:
    """The options of a model run, in their own group."""
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
                    help="serve Prometheus metrics on 127.0.0.1:PORT/metrics during the replay (0: any free port); "
                    "also a trace replay's (its cache's prefix series, and with --host-tokens/--store-tokens the "
                    "tier series)")
    mg.add_argument("--metrics-linger", type=nonnegative_seconds, metavar="S",
                    help="with --metrics-port: keep serving the final metrics S seconds after the replay, so a "
                    "Prometheus server scrapes the end state (Ctrl-C ends it early)")
    mg.add_argument("--max-new-tokens", type=int, metavar="N",
                    help=f"tokens generated per request (default {defaults.max_new_tokens})")
    mg.add_argument("--pool-pages", type=int, metavar="N",
                    help=f"KV pages in the prefix cache's pool of the cache-on run (default {defaults.pool_pages}); "
                    f"size it to the model: pages x layers x 2 x page size x kv heads x head dim x dtype bytes")
    mg.add_argument("--encoder-bytes", type=byte_size, metavar="SIZE",
                    help=f"bytes of each encoder store of the cache-on run, e.g. 256M, 2G (default "
                    f"{defaults.encoder_bytes >> 20}M)")


def workload_options(args) -> ModelWorkloadOptions:
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
        return "this user may not read the folder"
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no config.json (not a save_pretrained folder)"
    except (OSError, ValueError) as e:
        return f"cannot read {config}: {e}"
    return None


def model_replay_command(args, defaults: dict) -> int:
    """Serve a model workload cache off, then on (``serving.compare``); print the table, write the reports.
    ``defaults``: the replay options' defaults, to tell which options were given."""
    if misused := given_flags(args, defaults, TEXT_ONLY):
        return fail(f"{', '.join(misused)}: only for trace replays, not for model workload {args.target!r}")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--page-size", args.page_size),
                        ("--pool-pages", args.pool_pages), ("--encoder-bytes", args.encoder_bytes),
                        ("--slo-ttft", args.slo_ttft), ("--slo-ttfa", args.slo_ttfa)):
        if value is not None and not value > 0:
            return fail(f"{flag} must be > 0, got {value}")
    if args.pool_pages is not None and args.pool_pages >= MAX_PAGES:
        return fail(f"--pool-pages {args.pool_pages:,}: past what a pool can number (page ids are 32-bit: at most "
                    f"{MAX_PAGES - 1:,}), and far past any machine's memory")
    if args.in_flight is not None and args.in_flight < 1:
        return fail(f"--in-flight must be >= 1, got {args.in_flight}")
    if args.in_flight is not None and args.target not in ENGINE_WORKLOADS + MSTAR_WORKLOADS:
        return fail(f"--in-flight: {args.target!r} cannot be served through transformers' continuous-batching "
                    f"engine, which takes token ids only (image features, reference audio and diffusion do not go "
                    f"through it); it serves {', '.join(ENGINE_WORKLOADS)}; M*'s Engine serves "
                    f"{', '.join(MSTAR_WORKLOADS)}")
    if args.target in MSTAR_WORKLOADS and args.in_flight is None:
        args.in_flight = 1
    if problem := metrics_problem(args):
        return fail(problem)
    from workloads.harness.metrics import SLO
    from workloads.harness.serving import Schedule
    try:
        schedule = Schedule.parse(args.schedule or "trace", seed=args.seed or 0)
    except ValueError as e:
        return fail(str(e))
    if args.model is not None and (problem := _model_folder_problem(args.model)):
        return fail(f"--model {args.model}: {problem}")
    slo = SLO(ttft_s=args.slo_ttft, ttfa_s=args.slo_ttfa)
    progress = progress_bars(args)
    import torch
    threads = torch.get_num_threads()
    if args.model is None:  # tiny models: one intra-op thread is fastest; a spinning pool only adds contention
        torch.set_num_threads(1)
    try:
        return _serve_model_workload(args, schedule, slo, progress)
    finally:
        torch.set_num_threads(threads)


def _serve_model_workload(args, schedule, slo, progress: bool) -> int:
    started = time.perf_counter()
    return with_metrics(args, lambda exporter, port: _replay_and_report(args, schedule, slo, progress, started,
                                                                        exporter, port), slo=slo)


def _replay_and_report(args, schedule, slo, progress: bool, started: float, exporter, port) -> int:
    from mmcache.errors import MmcacheError
    from workloads.harness import engine_serving, mstar_serving
    from workloads.harness.engine_serving import engine_label
    from workloads.harness.serving import compare
    name = args.target
    mstar = name in MSTAR_WORKLOADS
    try:
        compare_engine, engine = ((mstar_serving.compare_mstar, registry.import_model_module(name).ENGINE) if mstar
                                  else (engine_serving.compare_engine, engine_serving.ENGINE))
        options = workload_options(args)
        if name == "mixed":
            from workloads.models import mixed
            names, missing = mixed.available()
            print(f"mixed: {', '.join(names) or 'no component'}"
                  + "".join(f"\n  skipped {n}: {why}" for n, why in missing.items()))
        make = registry.model_factory(name, options)
    except registry.UnknownWorkload as e:
        return fail(str(e))
    except (MmcacheError, OSError, ValueError) as e:  # bad data (file:line), or a model folder transformers refuses
        where = f" with --model {args.model}" if args.model is not None else ""
        return fail(f"cannot build workload {name!r}{where}: {str(e).strip().splitlines()[0]}")
    source = "embedded default" if options.data is None else options.data / registry.MODEL_WORKLOADS[name].data_path
    served = (f"served by {engine_label(schedule, min(args.in_flight, schedule.concurrency or args.in_flight), engine)}"
              if args.in_flight
              else f"schedule {schedule}, one request at a time")
    print(f"{name} ({source}): model {options.model or 'tiny, built from config'}; page size {options.page_size}, "
          f"{options.max_new_tokens} new {registry.MODEL_WORKLOADS[name].output_unit} per request, {served} (loaded in "
          f"{time.perf_counter() - started:.1f} s); cache off, then on")
    try:
        if args.in_flight:
            off, on, equal = compare_engine(make, schedule, args.in_flight, observer=exporter, progress=progress)
        else:
            off, on = compare(make, schedule, observer=exporter, progress=progress)
    except (MemoryError, OverflowError, RuntimeError) as e:  # a pool or store past memory, refused as it is built
        if not _allocation_failure(e):
            raise
        return fail(f"the cache's pools do not fit in memory ({str(e).strip().splitlines()[0]}); give a smaller "
                    f"--pool-pages (now {options.pool_pages:,}) or --encoder-bytes (now {options.encoder_bytes:,})")
    with hold_interrupts() as held:  # what was measured is printed and written whole, Ctrl-C or not
        status = _model_report(args, name, options, off, on, slo, started, mstar, equal if args.in_flight else None)
    if held.received:
        report_held_interrupt()
        status = INTERRUPTED
    if exporter is not None and args.metrics_linger and status != INTERRUPTED:
        common.linger_metrics(exporter, args.metrics_linger, port)  # by module: tests replace it there
    return status


def _allocation_failure(e: BaseException) -> bool:
    """Whether ``e`` is memory refused to a pool or store as it is built (torch says so in a RuntimeError)."""
    return (isinstance(e, (MemoryError, OverflowError)) or type(e).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in str(e))


def _model_report(args, name: str, options, off, on, slo, started: float, mstar: bool, equal: int | None) -> int:
    """Print the table of a model replay and write its reports; the exit status: 130 when Ctrl-C stopped a run, 1
    when a write fell back or every request of a run failed, else 0."""
    from workloads.harness.metrics import failure_lines, summary_table
    from workloads.harness.report import report_html, report_json
    if getattr(off, "interrupted", False):
        print(f"interrupted (Ctrl-C) in the cache-off run after {len(off.records)} of {off.planned} requests; the "
              "cache-on run did not start, so there is nothing to compare", file=sys.stderr)
        if (args.json or args.html) and off.records:  # the cache-off requests served are kept, in the JSON
            save_output("--json", args.json or args.html.with_suffix(".json"),
                        json.dumps(report_json(off, on, slo), indent=2) + "\n")
        return INTERRUPTED
    if getattr(on, "interrupted", False):  # compare the requests both runs served: the first ones of the same order
        off = off.first(len(on.records))
        print(f"partial: interrupted (Ctrl-C) in the cache-on run; the table compares the first {len(on.records)} of "
              f"{on.planned} requests")
    print(summary_table(off, on, slo))
    if args.in_flight:
        what = {"voice-mstar": "generated code ids (greedy)", "vlm-mstar": "generated token ids (greedy)"}.get(
            name, "outputs")
        print(f"{what} equal cache off / on: {equal:,} of {len(off.records):,} requests; both runs hold "
              f"--pool-pages ({options.pool_pages:,}) KV {'pages' if mstar else 'blocks'} in the engine, cache off "
              f"keeps nothing in them")
        if mstar:
            rows = [run.computed_tokens for run in (off, on)]
            print(f"prompt rows computed cache off / on: {rows[0]:,} / {rows[1]:,} of "
                  f"{sum(r.result.prompt_tokens for r in off.completed):,}")
    else:
        print(f"cache off computes everything outside the pool: --pool-pages ({options.pool_pages:,}) and "
              f"--encoder-bytes ({options.encoder_bytes >> 20:,}M) bound the cache-on run only")
    for line in failure_lines(off, on):
        print(f"failed: {line}")
    print(f"total {time.perf_counter() - started:.1f} s")
    saved = True
    if args.html:
        saved &= save_output("--html", args.html, report_html(off, on, slo))
    if args.json or args.html:
        saved &= save_output("--json", args.json or args.html.with_suffix(".json"),
                             json.dumps(report_json(off, on, slo), indent=2) + "\n")
    if on.interrupted:
        return INTERRUPTED
    if failed := [run.label for run in (off, on) if run.records and not run.completed]:
        print(f"mmcache: error: every request failed with the cache {' and '.join(failed)} (see the failed: lines "
              "above); nothing was served", file=sys.stderr)
        return 1
    return 0 if saved else 1

