"""``mmcache replay [TARGET] --replicas R[,R...]``: a trace, or a model workload's data, over R replicas.

A text trace (``workloads.commands.trace_replay`` loads it) or the data of a model workload with media
(``vlm-chat``, ``voice-clone``: ``workloads.registry.replica_trace`` makes it a metadata trace with media; its data
is needed, and the command fails naming where it looked) is replayed over R data-parallel replicas, each with pool/R
tokens (and an encoder store of 1/R), per router, against one pool of the same total size; no model runs, so the
options of a model run are refused (``MODEL_REPLICA_OPTIONS`` is what it reads).
"""

from __future__ import annotations

import argparse
import json
import time

from workloads import registry
from workloads.commands.common import (
    INTERRUPTED,
    fail,
    given_flags,
    nonnegative_seconds,
    report_held_interrupt,
    save_output,
)
from workloads.counts import counted
from workloads.interrupts import hold_interrupts
from workloads.options import ModelWorkloadOptions
from workloads.service import ServiceModel
from workloads.sizes import parse_sizes
from workloads.sizing.router_names import DEFAULT_REPLICA_POOL, ROUTERS

# what a replica replay of a model workload reads (it runs no model); any other option given is refused
MODEL_REPLICA_OPTIONS = ("replicas", "router", "pool_tokens", "affinity_threshold", "key_pages", "prefill_rate",
                         "tpot", "encoder_s", "encoder_bytes", "seed", "page_size", "limit", "data", "json",
                         "no_progress")


def _replica_counts(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = [0]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"must be replica counts >= 1 separated by commas, got {text!r}")
    return counts


def _routers(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",")]
    if unknown := [n for n in names if n not in ROUTERS]:
        raise argparse.ArgumentTypeError(f"unknown router {unknown[0]!r}; expected {', '.join(ROUTERS)}")
    return names


def add_options(rp) -> None:
    """``--replicas`` and what it reads: the routers, the affinity router's knobs, the encoder's time."""
    rp.add_argument("--replicas", type=_replica_counts, metavar="R[,R...]",
                    help="replay over R data-parallel replicas (e.g. 2,4,8), each with pool/R tokens: the one "
                    f"--pool-tokens size is the TOTAL (default {DEFAULT_REPLICA_POOL}); timestamp order; prints hit "
                    "rate, duplicated pages, replica spread, per-replica load and TTFT p50/p99 per router, against "
                    "one pool of the same total size")
    rp.add_argument("--router", type=_routers, metavar="POLICY[,...]",
                    help=f"with --replicas: {', '.join(ROUTERS)} (default: all; for a text trace all but "
                    "media-affinity, which keys on media and falls back to the text key without; random is M*'s "
                    "choice today)")
    rp.add_argument("--affinity-threshold", type=int, metavar="N",
                    help="affinity router: the preferred replica is taken while it has fewer than N live requests "
                    "(default 16)")
    rp.add_argument("--key-pages", type=int, metavar="K",
                    help="affinity router: the key is the name of the first K full pages (default 1)")
    rp.add_argument("--encoder-s", type=nonnegative_seconds, metavar="S",
                    help=f"--replicas on {', '.join(registry.REPLICA_WORKLOADS)}: seconds per encoder run, added "
                    f"before the request's prefill (default {ServiceModel.encoder_s:g}: image decode + preprocess "
                    "measured here)")


def _replica_pool(args, defaults: dict) -> int:
    return (args.pool_tokens if args.pool_tokens != defaults["pool_tokens"] else parse_sizes(DEFAULT_REPLICA_POOL))[0]


def replica_problem(args, defaults: dict) -> str | None:
    """Why the --replicas options cannot run, checked before the trace loads."""
    if not args.replicas:
        return next((f"--{d.replace('_', '-')}: only with --replicas" for d in ("affinity_threshold", "key_pages")
                     if getattr(args, d) is not None), None)
    sizes = args.pool_tokens if args.pool_tokens != defaults["pool_tokens"] else [_replica_pool(args, defaults)]
    if args.order != "timestamp":
        return "--replicas: replica replays run in timestamp order (the service model needs arrival times)"
    if args.in_service is not None or args.pin_sessions or args.sessions != defaults["sessions"]:
        return ("--replicas: each replica serves a request for its modelled time, with no cap; drop --sessions, "
                "--in-service and --pin-sessions")
    if args.host_tokens or args.store_tokens:
        return "--replicas: tiers under replicas are not modelled; drop --host-tokens/--store-tokens"
    if args.metrics_port is not None:
        return "--replicas: --metrics-port exports one cache's series, not R replicas'; drop it"
    if len(sizes) != 1:
        return f"--replicas: give one --pool-tokens size, the total over the replicas (got {len(sizes)})"
    if sizes[0] is None:
        return "--replicas: the total pool must be finite"
    for flag, value in (("--affinity-threshold", args.affinity_threshold), ("--key-pages", args.key_pages)):
        if value is not None and value < 1:
            return f"{flag} must be >= 1, got {value}"
    return None


def run_replica_replay(args, defaults: dict, trace, page_size: int, service: ServiceModel, started: float,
                       routers: list[str], encoder_bytes: int | None = None) -> int:
    """``--replicas``: one R = 1 reference run of the total pool (and encoder store), then every R x router."""
    from workloads.sizing.replicas import DEFAULT_ENCODER_BYTES, format_replica_table, replay_replicas
    total = _replica_pool(args, defaults)
    kw = dict(page_size=page_size, pool_tokens=total, service=service, threshold=args.affinity_threshold,
              key_pages=args.key_pages, seed=args.seed or 0, encoder_bytes=encoder_bytes or DEFAULT_ENCODER_BYTES)
    from workloads.sizing.pool_checks import pool_problem
    if problem := pool_problem(trace, page_size, [total], replicas=[1, *args.replicas], ceiling=False):
        return fail(problem)
    try:
        one = replay_replicas(trace, replicas=1, router="random", **kw)
        runs, planned = [], [(r, p) for r in args.replicas for p in routers]
        for r, p in planned:
            try:
                runs.append(replay_replicas(trace, replicas=r, router=p, **kw))
            except KeyboardInterrupt:  # after the reference run: the runs done stand
                break
    except ValueError as e:
        return fail(str(e))
    stopped = len(runs) < len(planned)
    with hold_interrupts() as held:  # what was measured is printed and written whole, Ctrl-C or not
        media = (f"; encoder store {one.encoder_bytes >> 20:,} MiB in total, split the same way, "
                 f"{service.encoder_s:g} s per encoder run" if one.encoder_items else "")
        print(f"total pool {total:,} tokens, split evenly over the replicas{media}; TTFT from the service model "
              f"({service.prefill_tokens_per_s:g} prefill tokens/s per replica, one prefill at a time)")
        print(format_replica_table(runs, one))
        print(f"total {time.perf_counter() - started:.1f} s")
        if stopped:
            print(f"partial: interrupted (Ctrl-C) after {len(runs)} of {len(planned)} replica runs; the rows above "
                  "are complete replays")
        saved = True
        if args.json:
            doc = {"trace": trace.source, "kind": trace.kind, "page_size": page_size, "pool_tokens_total": total,
                   "encoder_bytes_total": one.encoder_bytes,
                   "service_model": {"prefill_tokens_per_s": service.prefill_tokens_per_s,
                                     "s_per_output_token": service.s_per_output_token,
                                     "encoder_s": service.encoder_s},
                   "one_pool": one.to_dict(), "runs": [r.to_dict() for r in runs], "interrupted": stopped}
            saved = save_output("--json", args.json, json.dumps(doc, indent=2) + "\n")
    if held.received:
        report_held_interrupt()
        stopped = True
    return INTERRUPTED if stopped else 0 if saved else 1


def model_replica_command(args, defaults: dict) -> int:
    """``--replicas`` on a model workload: its data as a metadata trace with media, replayed over replicas; no model
    runs, so the options of a model run are refused."""
    others = [d for d in defaults if d not in MODEL_REPLICA_OPTIONS + ("command", "target")]
    if misused := given_flags(args, defaults, others):
        return fail(f"{', '.join(misused)}: not with --replicas on model workload {args.target!r} (a metadata "
                    f"replay of its data: no model runs)")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return fail("--prefill-rate must be > 0 and --tpot >= 0")
    if args.page_size is not None and args.page_size < 1:
        return fail(f"--page-size must be >= 1, got {args.page_size}")
    if problem := replica_problem(args, defaults):
        return fail(problem)
    from mmcache.errors import MissingDependency, TraceError
    started = time.perf_counter()
    try:
        trace = registry.replica_trace(args.target, args.data, limit=args.limit, seed=args.seed or 0)
    except (registry.UnknownWorkload, TraceError, MissingDependency) as e:
        return fail(str(e))
    page_size = args.page_size or ModelWorkloadOptions().page_size
    items = sum(len(s.build(i).encoded) for s in trace.sessions for i in range(len(s.calls)))
    print(f"{args.target} replica replay of {trace.source}: {counted(trace.num_requests, 'request')} in "
          f"{counted(len(trace.sessions), 'session')}, {trace.prompt_tokens:,} prompt tokens, "
          f"{items:,} encoded media items; "
          f"page size {page_size} (built in {time.perf_counter() - started:.1f} s; no model runs)")
    encoder_s = ServiceModel.encoder_s if args.encoder_s is None else args.encoder_s
    service = ServiceModel(args.prefill_rate, args.tpot, encoder_s)
    return run_replica_replay(args, defaults, trace, page_size, service, started, args.router or list(ROUTERS),
                              args.encoder_bytes)

