"""``mmcache replay [TARGET]``: a trace replayed through a metadata-only prefix cache at several pool sizes.

TARGET is a registered text workload (``mooncake``, ``agent``; see ``workloads.registry``), a Mooncake JSONL file, an
OpenAI-style chat JSONL or ShareGPT JSON file (tokenized with ``--tokenizer``), or a folder of mini-swe-agent
trajectories; without it the embedded Mooncake slice is replayed through a metadata-only prefix cache at several pool
sizes, no model involved. ``--metrics-port`` serves the replayed caches' Prometheus series (the prefix cache's, and
the tier series with ``--host-tokens``/``--store-tokens``) while it runs. With ``--replicas`` the trace is replayed
over R replicas instead (``workloads.commands.replica_replay``).

The options of a model run (``MODEL_ONLY``) are refused here: argparse cannot tell a trace from a model workload,
which the TARGET's value decides, so ``replay`` declares every option and each kind refuses the others' options.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from workloads import registry
from workloads.commands import common
from workloads.commands.common import (
    INTERRUPTED,
    byte_rate,
    byte_size,
    fail,
    given_flags,
    metrics_problem,
    progress_bars,
    report_held_interrupt,
    save_output,
    token_size,
    with_metrics,
)
from workloads.commands.replica_replay import replica_problem, run_replica_replay
from workloads.counts import counted
from workloads.interrupts import hold_interrupts
from workloads.service import ServiceModel
from workloads.sizing.ordering import DEFAULT_SESSIONS, ORDERS, Serving
from workloads.sizing.router_names import TEXT_ROUTERS
from workloads.sizing.tiers import TierModel

DEFAULT_POOLS = "64k,256k,1M,4M,16M,inf"
TEXT_PAGE_SIZE = 128
_SHOWN_ERRORS = 5
TRACE_KINDS = {"openai-requests": "OpenAI request log (a line a request)",
               "openai-conversations": "OpenAI conversation log (a line a conversation)"}
OTHER_READING = {"openai-requests": ("openai-conversations", "a conversation log"),
                 "openai-conversations": ("openai-requests", "a request log")}
# the options of a model run (``workloads.commands.model_replay``), refused for a trace
MODEL_ONLY = ("model", "schedule", "seed", "slo_ttft", "slo_ttfa", "html", "max_new_tokens", "pool_pages",
              "encoder_bytes")


def _policies(text: str) -> list[str]:
    """``--eviction``: comma-separated policy names, each known (``mmcache.eviction.POLICIES`` or ``optimal``)."""
    from mmcache.eviction import POLICIES
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [*POLICIES, "optimal"]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown eviction policy {', '.join(bad) or repr(text)}; expected one or "
                                         f"more of {', '.join(known)}")
    return names


def add_source_options(rp) -> None:
    """How a TARGET file or folder is read: its format and the tokenizer of text traces."""
    rp.add_argument("--format", choices=registry.FORMATS, default="auto",
                    help="format of a TARGET file or folder (default auto: a folder is mini-swe-agent trajectories; "
                    "a file is told from its first line: a JSON list is ShareGPT, {\"messages\": ...} lines are "
                    "OpenAI chat, anything else Mooncake; OpenAI chat is a request log when lines re-send an earlier "
                    "line's messages, else a conversation log when lines hold earlier turns, and the header says "
                    "why: openai-requests or openai-conversations forces one reading)")
    rp.add_argument("--tokenizer", metavar="PATH",
                    help="tokenizer of agent and chat traces: a tokenizer.json, a Hugging Face tokenizer folder, or a "
                    "SentencePiece model (default: the Mistral v3 SentencePiece model shipped in mistral_common)")


def add_sweep_options(rp) -> None:
    """The pool-size sweep's eviction policies and request order."""
    rp.add_argument("--eviction", type=_policies, metavar="NAMES",
                    help="trace replays: eviction policies to sweep, comma-separated: dip (the default), dip-costs, "
                    "lru, lfu, optimal (the offline optimum of the same calls), or any registered with "
                    "mmcache.eviction.register_policy; every sweep also replays the optimum at each pool size for "
                    "its 'of optimal' column")
    rp.add_argument("--order", choices=ORDERS, default="timestamp",
                    help="how calls arrive: timestamp: the trace's own arrival times; round-robin: --sessions "
                    "sessions interleaved a call each; closed: --sessions clients, each sending its session's next "
                    "call when the previous one ends")
    rp.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS, metavar="S",
                    help="round-robin order: sessions interleaved; closed order: clients (default %(default)s)")
    rp.add_argument("--in-service", type=int, metavar="N",
                    help="trace replays: requests served at once, each holding its pages from admission to "
                    "completion only (default: 1 in round-robin order; no cap in timestamp and closed order, where "
                    "a request is served for its modelled time)")
    rp.add_argument("--pin-sessions", action="store_true",
                    help="trace replays: hold a session's last call until its next call is admitted, as a server "
                    "that pins sessions between calls (default: between calls a session is only cached)")


def add_tier_options(rp) -> None:
    """Tiers under the device pool (text replays): mmcache.tiers modeled by workloads.sizing.tiers."""
    d = TierModel()
    tg = rp.add_argument_group("tiers (text trace replay): a host-memory tier and a shared store under every pool")
    tg.add_argument("--host-tokens", type=token_size, metavar="SIZE",
                    help="host tier of evicted pages, in tokens (e.g. 8M); default none")
    tg.add_argument("--store-tokens", type=token_size, metavar="SIZE",
                    help="shared store (Mooncake Store) in tokens; pages are written through at teardown")
    tg.add_argument("--host-bw", type=byte_rate, default=d.host_bytes_per_s, metavar="B_S",
                    help="host->device bytes/s charged per host hit (default %(default)g: PCIe 5.0 x16 in practice)")
    tg.add_argument("--store-bw", type=byte_rate, default=d.store_bytes_per_s, metavar="B_S",
                    help="store->device bytes/s charged per store hit (default %(default)g: Mooncake Store over "
                    "loopback TCP, measured)")
    tg.add_argument("--kv-bytes-per-token", type=byte_size, default=d.kv_bytes_per_token, metavar="SIZE",
                    help="KV bytes of one token (default 128k: Llama-3-8B in bf16)")


def trace_replay_command(args, defaults: dict) -> int:
    """Replay a trace (TARGET not a model workload); ``defaults``: the replay options' defaults, to tell which
    options were given."""
    if misused := given_flags(args, defaults, MODEL_ONLY):
        return fail(f"{', '.join(misused)}: only for model workloads ({', '.join(registry.MODEL_WORKLOADS)})")
    if problem := metrics_problem(args):
        return fail(problem)
    if args.in_flight is not None:
        return fail("--in-flight: only for model workloads; a trace replay takes --sessions (sessions interleaved) "
                    "and --in-service (requests served at once)")
    if args.sessions < 1:
        return fail(f"--sessions must be >= 1, got {args.sessions}")
    if args.in_service is not None and args.in_service < 1:
        return fail(f"--in-service must be >= 1, got {args.in_service}")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return fail("--prefill-rate must be > 0 and --tpot >= 0")
    if args.page_size is not None and args.page_size < 1:
        return fail(f"--page-size must be >= 1, got {args.page_size}")
    try:
        fmt, path = registry.resolve(args.target, args.data, args.format)
    except registry.UnknownWorkload as e:
        return fail(str(e))
    if fmt == "mooncake" and args.page_size not in (None, 512):
        return fail(f"Mooncake traces fix the page size at 512 (one hash id per 512-token block); "
                    f"got --page-size {args.page_size}")
    if fmt == "mooncake" and args.tokenizer is not None:
        return fail("--tokenizer: Mooncake traces hold block ids, not text")
    if problem := replica_problem(args, defaults):
        return fail(problem)
    progress = progress_bars(args)
    return with_metrics(args, lambda exporter, port: _trace_replay(args, defaults, fmt, path, progress, exporter,
                                                                   port))


def _trace_replay(args, defaults: dict, fmt: str, path, progress: bool, exporter, port) -> int:
    """Load the trace, then replay it over replicas or through the pool-size sweep (sampled by ``exporter``)."""
    from mmcache.errors import MissingDependency, TraceError
    from workloads.harness.progress import progress_bar
    from workloads.sizing.sweep import replays_of, run_sweep, sweep_json, table_head, table_row
    started = time.perf_counter()
    try:
        trace = registry.load(fmt, path, limit=args.limit, tokenizer=args.tokenizer)
    except (TraceError, MissingDependency) as e:
        return fail(str(e))
    _warn_skipped(trace)
    if not trace.sessions:
        return fail(f"no usable requests in {path}")
    page_size = args.page_size or trace.page_size or TEXT_PAGE_SIZE
    loaded = time.perf_counter() - started
    serving = Serving(args.order, args.sessions, args.in_service, args.pin_sessions)
    n, sessions = trace.num_requests, len(trace.sessions)
    shape = (f"{counted(n, 'request')}, each its own session" if n == sessions
             else f"{counted(n, 'request')} in {counted(sessions, 'session')}")
    kind = TRACE_KINDS.get(trace.kind, f"{trace.kind} trace")
    print(f"{kind} {path}: {shape}, {trace.prompt_tokens:,} prompt tokens; page size {page_size}, "
          f"{serving.describe()} (loaded in {loaded:.1f} s)")
    if trace.told and trace.kind in OTHER_READING:
        flag, other = OTHER_READING[trace.kind]
        print(f"told from the content: {trace.told}; --format {flag} reads it as {other}")
    service = ServiceModel(args.prefill_rate, args.tpot)
    if args.replicas:
        return run_replica_replay(args, defaults, trace, page_size, service, started, args.router or list(TEXT_ROUTERS))
    from workloads.sizing.pool_checks import pool_problem
    if problem := pool_problem(trace, page_size, args.pool_tokens, host_tokens=args.host_tokens):
        return fail(problem)
    tiers = TierModel(args.host_tokens, args.store_tokens, args.host_bw, args.store_bw, args.kv_bytes_per_token)
    from mmcache.eviction import DEFAULT_POLICY
    policies = args.eviction or [DEFAULT_POLICY]
    replays = sum(replays_of(args.pool_tokens, p, optimal=k == 0, tiers=tiers) for k, p in enumerate(policies))
    bar = progress_bar(replays * trace.num_requests, f"{replays} replays", enabled=progress)
    sweeps, stopped = [], False

    def finished(sweep, i):  # a row as soon as its size is replayed, under one progress bar for the whole command
        if sweeps:  # the optimum of the same calls: replayed once, with the first policy
            sweep.optimal[i] = sweeps[0].optimal[i]
        head = ([f"eviction {sweep.runs[0].eviction}:"] if len(policies) > 1 else []) + [table_head(sweep)]
        bar.write("\n".join([*(head if i == 0 else []), table_row(sweep, i)]), file=sys.stdout)
    for policy in policies:
        try:
            sweep = run_sweep(trace, page_size=page_size, pool_sizes=args.pool_tokens, serving=serving,
                              service=service, tiers=tiers, observer=exporter, eviction=policy,
                              optimal=not sweeps, watch=_Ticks(bar) if progress else None, finished=finished)
        except KeyboardInterrupt:  # in a later policy's ceiling: the policies swept before it stand
            if not sweeps:
                raise
            stopped = True
            break
        sweeps.append(sweep)
        if sweep.interrupted:
            stopped = True
            break
    bar.close()
    with hold_interrupts() as held:  # what was measured is printed and written whole, Ctrl-C or not
        sweep = sweeps[-1]
        c = sweep.ceiling
        print(f"ceiling (unbounded pool): {c.hit_tokens:,} of {c.prompt_tokens:,} prompt tokens = "
              f"{100 * c.hit_rate:.2f}%; total {time.perf_counter() - started:.1f} s")
        if sweep.interrupted:
            print(f"partial: interrupted (Ctrl-C) after {len(sweep.runs)} of {len(args.pool_tokens)} pool sizes; the "
                  "rows above are complete replays")
        elif stopped:
            print(f"partial: interrupted (Ctrl-C) after {len(sweeps)} of {len(policies)} eviction policies; the "
                  "tables above are complete sweeps")
        saved = True
        if args.json:  # one policy: the sweep's document; several: one per policy under "sweeps"
            doc = (sweep_json(sweep) if len(policies) == 1
                   else {"sweeps": [sweep_json(s) for s in sweeps], "interrupted": stopped})
            saved &= save_output("--json", args.json, json.dumps(doc, indent=2) + "\n")
        if args.plot:
            from workloads.sizing.plot import plot_sweeps
            saved &= save_output("--plot", args.plot, plot_sweeps(sweeps))
    if held.received:
        report_held_interrupt()
        stopped = True
    if exporter is not None and args.metrics_linger and not stopped:
        common.linger_metrics(exporter, args.metrics_linger, port)  # by module: tests replace it there
    return INTERRUPTED if stopped else 0 if saved else 1


class _Ticks:
    """A replay watcher (``workloads.sizing.replay.ReplayObserver``) that moves the command's one progress bar a step
    per call served, whichever replay of the sweep serves it."""

    def __init__(self, bar):
        self.bar = bar

    def served(self, request, req, matched, encoder_runs) -> None:
        self.bar.update(1)


def _warn_skipped(trace) -> None:
    """Say what of the trace is not replayed: records skipped by reason, then malformed files."""
    if trace.skipped:
        print(f"note: not replayed from {trace.source}: "
              + "; ".join(counted(n, why) for why, n in trace.skipped.items()), file=sys.stderr)
    if not trace.errors:
        return
    print(f"warning: skipped {trace.malformed} malformed file(s) in {trace.source}:", file=sys.stderr)
    for e in trace.errors[:_SHOWN_ERRORS]:
        print(f"  {e}", file=sys.stderr)
    if trace.malformed > _SHOWN_ERRORS:
        print(f"  ... and {trace.malformed - _SHOWN_ERRORS} more", file=sys.stderr)

