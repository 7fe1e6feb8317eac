"""``mmcache replay``: the one subcommand of every replay, and which replay its TARGET asks for.

TARGET decides the replay: a model workload (``workloads.registry.MODEL_WORKLOADS``) is served through its models
(``workloads.commands.model_replay``), or with ``--replicas`` its data is replayed over replicas
(``workloads.commands.replica_replay``); anything else is a trace (``workloads.commands.trace_replay``). Since
argparse cannot choose options by a positional's value, ``replay`` declares them all: the options every replay shares
here, each kind's own by its module (in this order, which is the order ``--help`` shows), and each kind refuses the
options of the others before anything runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from workloads import registry
from workloads.commands import model_replay, replica_replay, trace_replay
from workloads.commands.common import fail, missing_dependency, output_problem, positive_count, token_sizes
from workloads.commands.model_replay import ENGINE_WORKLOADS, MSTAR_WORKLOADS
from workloads.commands.trace_replay import DEFAULT_POOLS, TEXT_PAGE_SIZE
from workloads.options import ModelWorkloadOptions
from workloads.service import ServiceModel
from workloads.sizes import parse_sizes


def add_parser(sub) -> None:
    """``mmcache replay`` and every replay's options."""
    names = ", ".join(sorted(registry.TRACE_WORKLOADS))
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
                    help=f"text workload name ({names}), a trace file (Mooncake JSONL, OpenAI chat JSONL, ShareGPT "
                    f"JSON) or a folder of mini-swe-agent trajectories (default: the embedded Mooncake slice); or a "
                    f"model workload ({models})")
    rp.add_argument("--data", metavar="PATH", nargs="?", const="",
                    help=f"data folder for workload names (default: {registry.default_data_words()}: where "
                    "mmcache data fetch puts it); a model workload runs its embedded default unless --data is given")
    trace_replay.add_source_options(rp)
    rp.add_argument("--page-size", type=int, metavar="P",
                    help=f"tokens per page (Mooncake: 512, fixed by its block ids; text: {TEXT_PAGE_SIZE}; "
                    f"model workloads: {defaults.page_size})")
    rp.add_argument("--pool-tokens", type=token_sizes, default=parse_sizes(DEFAULT_POOLS), metavar="SIZES",
                    help=f"comma-separated pool sizes in tokens: 64k, 1M (binary), plain ints, inf "
                    f"(default: {DEFAULT_POOLS})")
    trace_replay.add_sweep_options(rp)
    rp.add_argument("--in-flight", type=int, metavar="K",
                    help=f"model workloads {' and '.join(ENGINE_WORKLOADS)}: serve through transformers' "
                    "continuous-batching engine with K requests in flight (cache on: mmcache under it); "
                    f"{', '.join(MSTAR_WORKLOADS)}: K in flight through M*'s Engine (default 1)")
    rp.add_argument("--limit", type=positive_count, metavar="N",
                    help="replay only the first N sessions (Mooncake: requests; agent: trajectories; model "
                    "workloads: requests, each with a default cap; --replicas on a model workload: sessions, in "
                    "order of arrival)")
    rp.add_argument("--prefill-rate", type=float, default=ServiceModel.prefill_tokens_per_s, metavar="TOK_S",
                    help="timestamp order: uncached prompt tokens prefilled per second (default %(default)g)")
    rp.add_argument("--tpot", type=float, default=ServiceModel.s_per_output_token, metavar="S",
                    help="timestamp order: seconds per output token (default %(default)g)")
    replica_replay.add_options(rp)
    rp.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    rp.add_argument("--plot", type=Path, metavar="OUT.png", help="draw realized reuse vs pool size as a PNG")
    rp.add_argument("--no-progress", action="store_true",
                    help="no progress bars on stderr, ours or the model libraries' (also off when stderr is not a "
                    "terminal)")
    trace_replay.add_tier_options(rp)
    model_replay.add_options(rp, defaults)


def replay_command(args, defaults: dict) -> int:
    """Run the replay TARGET asks for; ``defaults``: the replay options' defaults, to tell which options were given.
    The outputs, and the options that belong to one kind of replay only, are checked here first."""
    if problem := output_problem(args) or missing_dependency(args):
        return fail(problem)
    if args.encoder_s is not None and not (args.replicas and args.target in registry.MODEL_WORKLOADS):
        return fail(f"--encoder-s: only with --replicas on a model workload ({', '.join(registry.REPLICA_WORKLOADS)})")
    if args.eviction and args.replicas:
        return fail("--eviction: only for the pool-size sweep of a trace replay, not with --replicas")
    if args.target in registry.MODEL_WORKLOADS:
        if args.replicas:
            return replica_replay.model_replica_command(args, defaults)
        return model_replay.model_replay_command(args, defaults)
    return trace_replay.trace_replay_command(args, defaults)
