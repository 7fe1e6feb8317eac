"""The ``mmcache`` command line.

    mmcache --version
    mmcache replay [TARGET] [--format auto|mooncake|swe-agent|openai[-requests|-conversations]|sharegpt]
                   [--tokenizer PATH]
                   [--pool-tokens 64k,128k,inf] [--eviction NAMES] [--order timestamp|round-robin|closed]
                   [--sessions S] [--in-service N] [--pin-sessions] [--page-size P] [--json OUT.json]
                   [--plot OUT.png] [--limit N] [--data PATH]
                   [--host-tokens SIZE] [--store-tokens SIZE] [--metrics-port PORT] [--metrics-linger S]
    mmcache replay [TARGET] --replicas R[,R...] [--router random,round-robin,affinity,media-affinity,cache-aware]
                   [--pool-tokens TOTAL] [--affinity-threshold N] [--key-pages K]
    mmcache replay vlm-chat|voice-clone --replicas R[,R...] [--router ...] [--pool-tokens TOTAL]
                   [--encoder-bytes TOTAL] [--encoder-s S] [--data PATH] [--limit N] [--seed S]
    mmcache data list|fetch [NAME ...] [--data PATH] [--manifest FILE] [--no-progress]
    mmcache replay MODEL_WORKLOAD [--data [PATH]] [--model PATH] [--limit N] [--schedule trace|poisson:RATE|closed:N]
                   [--seed S] [--slo-ttft S] [--slo-ttfa S] [--html OUT.html] [--json OUT.json]
                   [--metrics-port PORT] [--metrics-linger S] [--page-size P] [--max-new-tokens N] [--pool-pages N]
                   [--encoder-bytes SIZE] [--in-flight N]

Every flag, with what it does: docs/cli.md, "Every flag" (``tests/workloads/test_cli_docs.py`` keeps the two equal).

Each command is a module of ``workloads.commands`` on the one parser ``build_parser`` makes: ``replay``
(``workloads.commands.replay``) runs a trace replay (``trace_replay``: TARGET a text workload, a trace file or a
folder, or nothing for the embedded Mooncake slice), a replica replay (``replica_replay``: ``--replicas``, on a trace
or on the data of ``vlm-chat``/``voice-clone``, no model run) or a model replay (``model_replay``: MODEL_WORKLOAD
served through real models, cache off then on), chosen by TARGET; ``data`` (``workloads.commands.data``) lists and
fetches the public data sets the replays read. What they share (exit statuses, one-line errors, option types,
outputs, the metrics endpoint) is ``workloads.commands.common``.

``main`` returns the exit status: 0 on success; 2 on a usage, workload, model or trace error, or a pool that cannot
run (smaller than every request, or past the machine's memory), each refused before anything runs; 1 when a run ran
but did not succeed (an output written to a fallback file, every request of a run failed, a download failed, a source
made by hand missing); 130 after Ctrl-C, with what finished printed and written (``workloads.interrupts`` holds Ctrl-C
while results are written). Every error is one line, ``mmcache: error: ...``. Output paths and trace paths (a regular
file or a folder: a pipe or a device is never opened) are checked before anything runs. Only argparse, the registry
and a few torch-free modules are imported at start (the command modules included), so ``mmcache --help`` stays fast;
the cache, torch and the model libraries are imported when a replay runs.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from workloads.commands import data, replay
from workloads.commands.common import INTERRUPTED, CommandParser, fail


def installed_version() -> str:
    """mmcache's version as the installed package's metadata says (``pip install -e .`` in the clone writes it)."""
    try:
        return metadata.version("mmcache")
    except metadata.PackageNotFoundError:
        return "unknown (no package metadata: pip install -e . in the clone)"


def build_parser() -> argparse.ArgumentParser:
    """The ``mmcache`` parser: each command adds its subparser and options (``workloads.commands``)."""
    parser = CommandParser(prog="mmcache", description="Exact prefix and encoder reuse for multimodal "
                                                    "serving: measure it on real traces.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    replay.add_parser(sub)
    data.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "replay":
            return replay.replay_command(args, vars(parser.parse_args(["replay"])))
        if args.command == "data":
            return data.data_command(args)
    except KeyboardInterrupt:  # a replay that was measuring returns its partial results itself
        print("mmcache: interrupted (Ctrl-C) before anything was measured", file=sys.stderr)
        return INTERRUPTED
    return fail(f"unknown command {args.command!r}")  # pragma: no cover (argparse rejects it first)


if __name__ == "__main__":
    sys.exit(main())
