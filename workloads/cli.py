"""The ``mmcache`` command line.

    mmcache replay [TARGET] [--format auto|mooncake|swe-agent|openai[-requests|-conversations]|sharegpt]
                   [--tokenizer PATH]
                   [--pool-tokens 64k,128k,inf] [--order timestamp|round-robin] [--in-flight K]
                   [--page-size P] [--json OUT.json] [--plot OUT.png] [--limit N] [--data PATH]
                   [--host-tokens SIZE] [--store-tokens SIZE] [--metrics-port PORT] [--metrics-linger S]
    mmcache replay [TARGET] --replicas R[,R...] [--router random,round-robin,affinity,media-affinity,cache-aware]
                   [--pool-tokens TOTAL] [--affinity-threshold N] [--key-pages K]
    mmcache replay vlm-chat|voice-clone --replicas R[,R...] [--router ...] [--pool-tokens TOTAL]
                   [--encoder-bytes TOTAL] [--encoder-s S] [--data PATH] [--limit N] [--seed S]
    mmcache replay MODEL_WORKLOAD [--data [PATH]] [--model PATH] [--limit N] [--schedule trace|poisson:RATE|closed:N]
                   [--seed S] [--slo-ttft S] [--slo-ttfa S] [--html OUT.html] [--json OUT.json]
                   [--metrics-port PORT] [--metrics-linger S] [--page-size P] [--max-new-tokens N] [--pool-pages N]
                   [--encoder-bytes SIZE] [--in-flight N]

Trace replay: TARGET is a registered text workload (``mooncake``, ``agent``; see ``workloads.registry``), a Mooncake
JSONL file, an OpenAI-style chat JSONL or ShareGPT JSON file (tokenized with ``--tokenizer``), or a folder of
mini-swe-agent trajectories; without it the embedded Mooncake slice is replayed through a metadata-only prefix cache
at several pool sizes, no model involved. ``--metrics-port`` serves the replayed caches' Prometheus series (the prefix
cache's, and the tier series with ``--host-tokens``/``--store-tokens``) while it runs.

Replica replay of a model workload (``--replicas`` on ``vlm-chat`` or ``voice-clone``): its data (needed: the
command fails naming where it looked) becomes a metadata trace with media (``workloads.registry.replica_trace``),
replayed over R replicas, each with its prefix cache and encoder store; no model runs.

Data: ``mmcache data list`` names each public data set the replays read (source, licence, present or not);
``mmcache data fetch [NAME ...]`` downloads them into the data folder (``workloads.datasets``).

Model replay: MODEL_WORKLOAD (``vlm-chat``, ``image-gen``, ``voice-clone``, ``voice-mstar``, ``vlm-mstar``,
``agent-model``, ``mooncake-model``, ``mixed``) serves its requests through real models with the cache off, then on, on
the same schedule, and prints both runs side by side (latencies, goodput at the SLO, hit rates against their ceilings,
time per stage). Without ``--data`` the workload's embedded default runs; ``--data`` alone reads ``$MMCACHE_DATA``,
else the data folder ``mmcache data fetch`` fills (``workloads.registry.data_place``). With ``--in-flight N`` the
text workloads (``ENGINE_WORKLOADS``) are served through transformers' continuous-batching engine with N requests in
flight, cache off (its sharing off) then on (mmcache under it), every latency measured
(``workloads.harness.engine_serving``); without it one request is served at a time and queueing is simulated. The M*
workloads (``MSTAR_WORKLOADS``: ``voice-mstar``, M*'s Orpheus; ``vlm-mstar``, vlm-chat's image questions through M*'s
Qwen3-Omni vision encoder and thinker) are always served through M*'s own ``Engine``, N in flight (default 1), M*'s KV
resource for cache off and mmcache's for cache on (``workloads.harness.mstar_serving``), and print the prompt rows each
run computed.

``main`` returns the exit status: 0 on success; 2 on a usage, workload, model or trace error, or a pool that cannot
run (smaller than every request, or past the machine's memory), each refused before anything runs; 1 when a run ran
but did not succeed (an output written to a fallback file, every request of a run failed, a download failed, a source
made by hand missing); 130 after Ctrl-C, with what finished printed and written (``workloads.interrupts`` holds Ctrl-C
while results are written). Every error is one line, ``mmcache: error: ...``. Output paths and trace paths (a regular
file or a folder: a pipe or a device is never opened) are checked before anything runs. Only argparse, the registry
and a few torch-free modules are imported at start, so ``mmcache --help`` stays fast; the cache, torch and the model
libraries are imported when a replay runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from workloads import registry
from workloads.interrupts import hold_interrupts
from workloads.options import ModelWorkloadOptions
from workloads.sizes import parse_size, parse_sizes
from workloads.sizing.ordering import ORDERS
from workloads.sizing.router_names import DEFAULT_REPLICA_POOL, ROUTERS, TEXT_ROUTERS
from workloads.sizing.service import ServiceModel
from workloads.sizing.tiers import TierModel

DEFAULT_POOLS = "64k,256k,1M,4M,16M,inf"
TEXT_PAGE_SIZE = 128
_SHOWN_ERRORS = 5
TRACE_KINDS = {"openai-requests": "OpenAI request log (a line a request)",
               "openai-conversations": "OpenAI conversation log (a line a conversation)"}
OTHER_READING = {"openai-requests": ("openai-conversations", "a conversation log"),
                 "openai-conversations": ("openai-requests", "a request log")}
MAX_PAGES = 1 << 31  # page ids are int32 in the pool and the prefix index
INTERRUPTED = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
TEXT_ONLY = ("pool_tokens", "order", "plot", "prefill_rate", "tpot", "format", "tokenizer", "replicas",
             "router", "affinity_threshold", "key_pages", "host_tokens", "store_tokens", "host_bw", "store_bw",
             "kv_bytes_per_token", "eviction")
MODEL_ONLY = ("model", "schedule", "seed", "slo_ttft", "slo_ttfa", "html", "max_new_tokens", "pool_pages",
              "encoder_bytes")
# what a replica replay of a model workload reads (it runs no model); any other option given is refused
MODEL_REPLICA_OPTIONS = ("replicas", "router", "pool_tokens", "affinity_threshold", "key_pages", "prefill_rate",
                         "tpot", "encoder_s", "encoder_bytes", "seed", "page_size", "limit", "data", "json",
                         "no_progress")
ENGINE_WORKLOADS = ("agent-model", "mooncake-model")  # token-id prompts: what the continuous-batching engine takes
MSTAR_WORKLOADS = ("voice-mstar", "vlm-mstar")  # served through M*'s Engine only
DEFAULT_IN_FLIGHT = 8  # trace replays, round-robin order
BYTE_UNITS = "k, M, G (binary: 1k = 1024 bytes; a trailing B is allowed, e.g. 256M, 2GB) or a plain number of bytes"


def _sizes(text: str) -> list[int | None]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def _positive(text: str) -> int:
    """A count of requests or sessions: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive whole number of requests/sessions, got {text!r}") \
            from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of requests/sessions, got {value}")
    return value


def _bytes(text: str) -> int:
    """A finite size in bytes, with binary units."""
    s = str(text).strip()
    try:
        value = parse_size(s[:-1] if s[-1:] in "bB" and s[-2:-1].isalpha() else s) if s else None
    except ValueError:
        value = -1
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}; it must be finite and positive, with "
                                         f"units {BYTE_UNITS}")
    return value


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where the usage is, not the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mmcache", description="Exact prefix and encoder reuse for multimodal "
                                     "serving: measure it on real traces.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
                    help=f"data folder for workload names (default: ${registry.DATA_ENV}, else ../shared/data beside "
                    f"this checkout when present, else the per-user data folder, {registry.user_data()}: where "
                    "mmcache data fetch puts it); a model workload runs its embedded default unless --data is given")
    rp.add_argument("--format", choices=registry.FORMATS, default="auto",
                    help="format of a TARGET file or folder (default auto: a folder is mini-swe-agent trajectories; "
                    "a file is told from its first line: a JSON list is ShareGPT, {\"messages\": ...} lines are "
                    "OpenAI chat, anything else Mooncake; OpenAI chat is a request log when lines re-send an earlier "
                    "line's messages, else a conversation log when lines hold earlier turns, and the header says "
                    "why: openai-requests or openai-conversations forces one reading)")
    rp.add_argument("--tokenizer", metavar="PATH",
                    help="tokenizer of agent and chat traces: a tokenizer.json, a Hugging Face tokenizer folder, or a "
                    "SentencePiece model (default: the Mistral v3 SentencePiece model shipped in mistral_common)")
    rp.add_argument("--page-size", type=int, metavar="P",
                    help=f"tokens per page (Mooncake: 512, fixed by its block ids; text: {TEXT_PAGE_SIZE}; "
                    f"model workloads: {defaults.page_size})")
    rp.add_argument("--pool-tokens", type=_sizes, default=parse_sizes(DEFAULT_POOLS), metavar="SIZES",
                    help=f"comma-separated pool sizes in tokens: 64k, 1M (binary), plain ints, inf "
                    f"(default: {DEFAULT_POOLS})")
    rp.add_argument("--eviction", type=_policies, metavar="NAMES",
                    help="trace replays: eviction policies to sweep, comma-separated: lru, odds (the default), lfu, "
                    "adaptive, optimal (the offline optimum of the same calls); every sweep also replays the optimum "
                    "at each pool size for its 'of optimal' column")
    rp.add_argument("--order", choices=ORDERS, default="timestamp",
                    help="timestamp: the trace's own arrival times; round-robin: K sessions interleaved")
    rp.add_argument("--in-flight", type=int, metavar="K",
                    help=f"trace replays: live sessions/requests in round-robin order (default {DEFAULT_IN_FLIGHT}); "
                    f"model workloads {' and '.join(ENGINE_WORKLOADS)}: serve through transformers' "
                    "continuous-batching engine with K requests in flight (cache on: mmcache under it); "
                    f"{', '.join(MSTAR_WORKLOADS)}: K in flight through M*'s Engine (default 1)")
    rp.add_argument("--limit", type=_positive, metavar="N",
                    help="replay only the first N sessions (Mooncake: requests; agent: trajectories; model "
                    "workloads: requests, each with a default cap; --replicas on a model workload: sessions, in "
                    "order of arrival)")
    rp.add_argument("--prefill-rate", type=float, default=ServiceModel.prefill_tokens_per_s, metavar="TOK_S",
                    help="timestamp order: uncached prompt tokens prefilled per second (default %(default)g)")
    rp.add_argument("--tpot", type=float, default=ServiceModel.s_per_output_token, metavar="S",
                    help="timestamp order: seconds per output token (default %(default)g)")
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
    rp.add_argument("--encoder-s", type=_seconds, metavar="S",
                    help=f"--replicas on {', '.join(registry.REPLICA_WORKLOADS)}: seconds per encoder run, added "
                    f"before the request's prefill (default {ServiceModel.encoder_s:g}: image decode + preprocess "
                    "measured here)")
    rp.add_argument("--json", type=Path, metavar="OUT.json", help="write the results as JSON")
    rp.add_argument("--plot", type=Path, metavar="OUT.png", help="draw realized reuse vs pool size as a PNG")
    rp.add_argument("--no-progress", action="store_true",
                    help="no progress bars on stderr, ours or the model libraries' (also off when stderr is not a "
                    "terminal)")
    _tier_options(rp)
    _model_options(rp, defaults)
    _data_parser(sub)
    return parser


def _data_parser(sub) -> None:
    """``mmcache data list|fetch``: the public data sets of ``workloads/data/sources.json`` (``workloads.datasets``)."""
    dp = sub.add_parser("data", help="list the public data sets the replays read, or fetch them into the data folder",
                        description="List the public data sets the replays and benchmarks read (source, licence, "
                        "whether present), or download them into the data folder with progress, resume and the "
                        "checks the manifest has (size, sha256).")
    actions = dp.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    for name, what in (("list", "each source, its licence and whether its files are present"),
                       ("fetch", "download the sources named (default: all) into the data folder")):
        ap = actions.add_parser(name, help=what, description=what)
        if name == "fetch":
            ap.add_argument("names", nargs="*", metavar="NAME", help="sources to fetch (default: every source with "
                            "files to download; a source made by hand says how to make it, and the command fails "
                            "until its folder is there)")
            ap.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
        ap.add_argument("--data", metavar="PATH", help=f"the data folder (default: ${registry.DATA_ENV}, else "
                        f"../shared/data beside this checkout when present, else the per-user data folder, "
                        f"{registry.user_data()}): where the replays look by default")
        ap.add_argument("--manifest", type=Path, metavar="FILE", help="a sources manifest other than the one shipped "
                        "(workloads/data/sources.json)")


def _model_options(rp, defaults: ModelWorkloadOptions) -> None:
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
    mg.add_argument("--metrics-linger", type=_seconds, metavar="S",
                    help="with --metrics-port: keep serving the final metrics S seconds after the replay, so a "
                    "Prometheus server scrapes the end state (Ctrl-C ends it early)")
    mg.add_argument("--max-new-tokens", type=int, metavar="N",
                    help=f"tokens generated per request (default {defaults.max_new_tokens})")
    mg.add_argument("--pool-pages", type=int, metavar="N",
                    help=f"KV pages in the prefix cache's pool of the cache-on run (default {defaults.pool_pages}); "
                    f"size it to the model: pages x layers x 2 x page size x kv heads x head dim x dtype bytes")
    mg.add_argument("--encoder-bytes", type=_bytes, metavar="SIZE",
                    help=f"bytes of each encoder store of the cache-on run, e.g. 256M, 2G (default "
                    f"{defaults.encoder_bytes >> 20}M)")



def _size(text: str) -> int:
    """One finite positive size in tokens (64k, 1M: binary units)."""
    sizes = _sizes(text)
    if len(sizes) != 1 or sizes[0] is None or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"must be one finite positive size in tokens, got {text!r}")
    return sizes[0]


def _rate(text: str) -> float:
    """A transfer rate in bytes per second: a positive number (1.7e9) or a size per second (50G)."""
    try:
        value = float(text)
    except ValueError:
        value = float(_bytes(text))
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive rate in bytes/s, got {text!r}")
    return value


def _tier_options(rp) -> None:
    """Tiers under the device pool (text replays): mmcache.tiers modeled by workloads.sizing.tiers."""
    d = TierModel()
    tg = rp.add_argument_group("tiers (text trace replay): a host-memory tier and a shared store under every pool")
    tg.add_argument("--host-tokens", type=_size, metavar="SIZE",
                    help="host tier of evicted pages, in tokens (e.g. 8M); default none")
    tg.add_argument("--store-tokens", type=_size, metavar="SIZE",
                    help="shared store (Mooncake Store) in tokens; pages are written through at teardown")
    tg.add_argument("--host-bw", type=_rate, default=d.host_bytes_per_s, metavar="B_S",
                    help="host->device bytes/s charged per host hit (default %(default)g: PCIe 5.0 x16 in practice)")
    tg.add_argument("--store-bw", type=_rate, default=d.store_bytes_per_s, metavar="B_S",
                    help="store->device bytes/s charged per store hit (default %(default)g: Mooncake Store over "
                    "loopback TCP, measured)")
    tg.add_argument("--kv-bytes-per-token", type=_bytes, default=d.kv_bytes_per_token, metavar="SIZE",
                    help="KV bytes of one token (default 128k: Llama-3-8B in bf16)")


def _fail(message: str) -> int:
    print(f"mmcache: error: {message}", file=sys.stderr)
    return 2


def _warn_skipped(trace) -> None:
    """Say what of the trace is not replayed: records skipped by reason, then malformed files."""
    if trace.skipped:
        print(f"note: not replayed from {trace.source}: "
              + "; ".join(f"{n:,} {why}" for why, n in trace.skipped.items()), file=sys.stderr)
    if not trace.errors:
        return
    print(f"warning: skipped {trace.malformed} malformed file(s) in {trace.source}:", file=sys.stderr)
    for e in trace.errors[:_SHOWN_ERRORS]:
        print(f"  {e}", file=sys.stderr)
    if trace.malformed > _SHOWN_ERRORS:
        print(f"  ... and {trace.malformed - _SHOWN_ERRORS} more", file=sys.stderr)


def _given(args, defaults: dict, dests) -> list[str]:
    """The options among ``dests`` set to something other than their default, as flags."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d) != defaults[d]]


def output_problem(args) -> str | None:
    """Why one of the output files (--json, --plot, --html) cannot be written, checked before any work runs."""
    for flag in ("json", "plot", "html"):
        path = getattr(args, flag, None)
        if path is None:
            continue
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            return f"--{flag} {path}: is a folder, not a file"
        if not folder.is_dir():
            return f"--{flag} {path}: folder {folder} does not exist"
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"--{flag} {path}: permission denied"
    return None


def _progress(args) -> bool:
    """Progress bars on stderr: on a terminal unless --no-progress; when off, the model libraries' bars go too."""
    from workloads.harness.progress import bars_available, quiet_third_party
    on = not args.no_progress and sys.stderr.isatty()
    if on and not bars_available():
        from mmcache.extras import install_hint
        print(f"note: no progress bars (tqdm is missing: {install_hint('replay')})", file=sys.stderr)
        on = False
    if not on:
        quiet_third_party()
    return on


def _missing_dependency(args) -> str | None:
    """Why an output or endpoint asked for cannot be made with what is installed, checked before any work runs."""
    from mmcache.errors import MissingDependency
    from mmcache.extras import require
    try:
        for flag, module in (("plot", "matplotlib"), ("html", "matplotlib"), ("metrics_port", "prometheus_client")):
            if getattr(args, flag, None) is not None:
                require("replay", "--" + flag.replace("_", "-"), module)
    except MissingDependency as e:
        return str(e)
    return None


def _save(flag: str, path: Path, data: bytes | str) -> bool:
    """Write one output (``workloads.output_files.save``): print where it went; False when it had to fall back."""
    from workloads.output_files import save
    where, problem = save(flag, path, data)
    print(f"wrote {where}" if problem is None else f"mmcache: error: {problem}", file=sys.stderr if problem else None)
    return problem is None


def replay_command(args, defaults: dict) -> int:
    """``defaults``: the replay options' defaults, to tell which options were given."""
    if problem := output_problem(args) or _missing_dependency(args):
        return _fail(problem)
    if args.encoder_s is not None and not (args.replicas and args.target in registry.MODEL_WORKLOADS):
        return _fail(f"--encoder-s: only with --replicas on a model workload ({', '.join(registry.REPLICA_WORKLOADS)})")
    if args.eviction and args.replicas:
        return _fail("--eviction: only for the pool-size sweep of a trace replay, not with --replicas")
    if args.target in registry.MODEL_WORKLOADS:
        if args.replicas:
            return model_replica_command(args, defaults)
        if misused := _given(args, defaults, TEXT_ONLY):
            return _fail(f"{', '.join(misused)}: only for trace replays, not for model workload {args.target!r}")
        return model_replay_command(args)
    if misused := _given(args, defaults, MODEL_ONLY):
        return _fail(f"{', '.join(misused)}: only for model workloads ({', '.join(registry.MODEL_WORKLOADS)})")
    if problem := _metrics_problem(args):
        return _fail(problem)
    if args.in_flight is None:
        args.in_flight = DEFAULT_IN_FLIGHT
    if args.in_flight < 1:
        return _fail(f"--in-flight must be >= 1, got {args.in_flight}")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return _fail("--prefill-rate must be > 0 and --tpot >= 0")
    try:
        fmt, path = registry.resolve(args.target, args.data, args.format)
    except registry.UnknownWorkload as e:
        return _fail(str(e))
    if fmt == "mooncake" and args.page_size not in (None, 512):
        return _fail(f"Mooncake traces fix the page size at 512 (one hash id per 512-token block); "
                     f"got --page-size {args.page_size}")
    if fmt == "mooncake" and args.tokenizer is not None:
        return _fail("--tokenizer: Mooncake traces hold block ids, not text")
    if args.page_size is not None and args.page_size < 1:
        return _fail(f"--page-size must be >= 1, got {args.page_size}")
    if problem := _replica_problem(args, defaults):
        return _fail(problem)
    progress = _progress(args)
    return _with_metrics(args, lambda exporter, port: _trace_replay(args, defaults, fmt, path, progress, exporter,
                                                                    port))


def _trace_replay(args, defaults: dict, fmt: str, path, progress: bool, exporter, port) -> int:
    """Load the trace, then replay it over replicas or through the pool-size sweep (sampled by ``exporter``)."""
    from mmcache.errors import MissingDependency, TraceError
    from workloads.sizing.sweep import format_table, run_sweep, sweep_json
    started = time.perf_counter()
    try:
        trace = registry.load(fmt, path, limit=args.limit, tokenizer=args.tokenizer)
    except (TraceError, MissingDependency) as e:
        return _fail(str(e))
    _warn_skipped(trace)
    if not trace.sessions:
        return _fail(f"no usable requests in {path}")
    page_size = args.page_size or trace.page_size or TEXT_PAGE_SIZE
    loaded = time.perf_counter() - started
    in_flight = f", {args.in_flight} in flight" if args.order == "round-robin" else ""
    n, sessions = trace.num_requests, len(trace.sessions)
    shape = (f"{n:,} requests, each its own session" if n == sessions
             else f"{n:,} requests in {sessions:,} sessions")
    kind = TRACE_KINDS.get(trace.kind, f"{trace.kind} trace")
    print(f"{kind} {path}: {shape}, {trace.prompt_tokens:,} prompt tokens; page size {page_size}, "
          f"order {args.order}{in_flight} (loaded in {loaded:.1f} s)")
    if trace.told and trace.kind in OTHER_READING:
        flag, other = OTHER_READING[trace.kind]
        print(f"told from the content: {trace.told}; --format {flag} reads it as {other}")
    service = ServiceModel(args.prefill_rate, args.tpot)
    if args.replicas:
        return _replica_replay(args, defaults, trace, page_size, service, started, args.router or list(TEXT_ROUTERS))
    from workloads.sizing.pool_checks import pool_problem
    if problem := pool_problem(trace, page_size, args.pool_tokens, host_tokens=args.host_tokens):
        return _fail(problem)
    tiers = TierModel(args.host_tokens, args.store_tokens, args.host_bw, args.store_bw, args.kv_bytes_per_token)
    from mmcache.eviction import DEFAULT_POLICY
    policies = args.eviction or [DEFAULT_POLICY]
    sweeps, stopped = [], False
    for policy in policies:
        try:
            sweep = run_sweep(trace, page_size=page_size, pool_sizes=args.pool_tokens, order=args.order,
                              in_flight=args.in_flight, service=service, progress=progress, tiers=tiers,
                              observer=exporter, eviction=policy, optimal=not sweeps)
        except KeyboardInterrupt:  # in a later policy's ceiling: the policies swept before it stand
            if not sweeps:
                raise
            stopped = True
            break
        if sweeps:  # the optimum of the same calls: replayed once
            sweep.optimal = sweeps[0].optimal[:len(sweep.runs)]
        sweeps.append(sweep)
        if len(policies) > 1:
            print(f"eviction {policy}:")
        print(format_table(sweep))
        if sweep.interrupted:
            stopped = True
            break
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
            saved &= _save("--json", args.json, json.dumps(doc, indent=2) + "\n")
        if args.plot:
            from workloads.sizing.plot import plot_sweeps
            saved &= _save("--plot", args.plot, plot_sweeps(sweeps))
    if held.received:
        _held_interrupt()
        stopped = True
    if exporter is not None and args.metrics_linger and not stopped:
        _linger(exporter, args.metrics_linger, port)
    return INTERRUPTED if stopped else 0 if saved else 1


def _held_interrupt() -> None:
    """Say that Ctrl-C came while the results were printed and written (``hold_interrupts``)."""
    print("mmcache: interrupted (Ctrl-C) while the results were written; they were written in full first",
          file=sys.stderr)


def _replica_pool(args, defaults: dict) -> int:
    return (args.pool_tokens if args.pool_tokens != defaults["pool_tokens"] else parse_sizes(DEFAULT_REPLICA_POOL))[0]


def _replica_problem(args, defaults: dict) -> str | None:
    """Why the --replicas options cannot run, checked before the trace loads."""
    if not args.replicas:
        return next((f"--{d.replace('_', '-')}: only with --replicas" for d in ("affinity_threshold", "key_pages")
                     if getattr(args, d) is not None), None)
    sizes = args.pool_tokens if args.pool_tokens != defaults["pool_tokens"] else [_replica_pool(args, defaults)]
    if args.order != "timestamp":
        return "--replicas: replica replays run in timestamp order (the service model needs arrival times)"
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


def _replica_replay(args, defaults: dict, trace, page_size: int, service: ServiceModel, started: float,
                    routers: list[str], encoder_bytes: int | None = None) -> int:
    """``--replicas``: one R = 1 reference run of the total pool (and encoder store), then every R x router."""
    from workloads.sizing.replicas import DEFAULT_ENCODER_BYTES, format_replica_table, replay_replicas
    total = _replica_pool(args, defaults)
    kw = dict(page_size=page_size, pool_tokens=total, service=service, threshold=args.affinity_threshold,
              key_pages=args.key_pages, seed=args.seed or 0, encoder_bytes=encoder_bytes or DEFAULT_ENCODER_BYTES)
    from workloads.sizing.pool_checks import pool_problem
    if problem := pool_problem(trace, page_size, [total], replicas=[1, *args.replicas], ceiling=False):
        return _fail(problem)
    try:
        one = replay_replicas(trace, replicas=1, router="random", **kw)
        runs, planned = [], [(r, p) for r in args.replicas for p in routers]
        for r, p in planned:
            try:
                runs.append(replay_replicas(trace, replicas=r, router=p, **kw))
            except KeyboardInterrupt:  # after the reference run: the runs done stand
                break
    except ValueError as e:
        return _fail(str(e))
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
            saved = _save("--json", args.json, json.dumps(doc, indent=2) + "\n")
    if held.received:
        _held_interrupt()
        stopped = True
    return INTERRUPTED if stopped else 0 if saved else 1


def model_replica_command(args, defaults: dict) -> int:
    """``--replicas`` on a model workload: its data as a metadata trace with media, replayed over replicas; no model
    runs, so the options of a model run are refused."""
    others = [d for d in defaults if d not in MODEL_REPLICA_OPTIONS + ("command", "target")]
    if misused := _given(args, defaults, others):
        return _fail(f"{', '.join(misused)}: not with --replicas on model workload {args.target!r} (a metadata "
                     f"replay of its data: no model runs)")
    if args.prefill_rate <= 0 or args.tpot < 0:
        return _fail("--prefill-rate must be > 0 and --tpot >= 0")
    if args.page_size is not None and args.page_size < 1:
        return _fail(f"--page-size must be >= 1, got {args.page_size}")
    if problem := _replica_problem(args, defaults):
        return _fail(problem)
    from mmcache.errors import MissingDependency, TraceError
    started = time.perf_counter()
    try:
        trace = registry.replica_trace(args.target, args.data, limit=args.limit, seed=args.seed or 0)
    except (registry.UnknownWorkload, TraceError, MissingDependency) as e:
        return _fail(str(e))
    page_size = args.page_size or ModelWorkloadOptions().page_size
    items = sum(len(s.build(i).encoded) for s in trace.sessions for i in range(len(s.calls)))
    print(f"{args.target} replica replay of {trace.source}: {trace.num_requests:,} requests in "
          f"{len(trace.sessions):,} sessions, {trace.prompt_tokens:,} prompt tokens, {items:,} encoded media items; "
          f"page size {page_size} (built in {time.perf_counter() - started:.1f} s; no model runs)")
    encoder_s = ServiceModel.encoder_s if args.encoder_s is None else args.encoder_s
    service = ServiceModel(args.prefill_rate, args.tpot, encoder_s)
    return _replica_replay(args, defaults, trace, page_size, service, started, args.router or list(ROUTERS),
                           args.encoder_bytes)


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
    if args.pool_pages is not None and args.pool_pages >= MAX_PAGES:
        return _fail(f"--pool-pages {args.pool_pages:,}: past what a pool can number (page ids are 32-bit: at most "
                     f"{MAX_PAGES - 1:,}), and far past any machine's memory")
    if args.in_flight is not None and args.in_flight < 1:
        return _fail(f"--in-flight must be >= 1, got {args.in_flight}")
    if args.in_flight is not None and args.target not in ENGINE_WORKLOADS + MSTAR_WORKLOADS:
        return _fail(f"--in-flight: {args.target!r} cannot be served through transformers' continuous-batching "
                     f"engine, which takes token ids only (image features, reference audio and diffusion do not go "
                     f"through it); it serves {', '.join(ENGINE_WORKLOADS)}; M*'s Engine serves "
                     f"{', '.join(MSTAR_WORKLOADS)}")
    if args.target in MSTAR_WORKLOADS and args.in_flight is None:
        args.in_flight = 1
    if problem := _metrics_problem(args):
        return _fail(problem)
    from workloads.harness.metrics import SLO
    from workloads.harness.serving import Schedule
    try:
        schedule = Schedule.parse(args.schedule or "trace", seed=args.seed or 0)
    except ValueError as e:
        return _fail(str(e))
    if args.model is not None and (problem := _model_folder_problem(args.model)):
        return _fail(f"--model {args.model}: {problem}")
    slo = SLO(ttft_s=args.slo_ttft, ttfa_s=args.slo_ttfa)
    progress = _progress(args)
    import torch
    threads = torch.get_num_threads()
    if args.model is None:  # tiny models: one intra-op thread is fastest; a spinning pool only adds contention
        torch.set_num_threads(1)
    try:
        return _serve_model_workload(args, schedule, slo, progress)
    finally:
        torch.set_num_threads(threads)


def _linger(exporter, seconds: float, port: int) -> None:
    """Keep the metrics endpoint up ``seconds`` after the replay (Ctrl-C ends the wait)."""
    print(f"serving the final metrics on http://127.0.0.1:{port}/metrics for {seconds:g} s (Ctrl-C to stop)",
          flush=True)
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        pass


def _metrics_problem(args) -> str | None:
    """Why ``--metrics-port``/``--metrics-linger`` cannot be served as given."""
    if args.metrics_port is not None and not 0 <= args.metrics_port < 65536:
        return f"--metrics-port must be in [0, 65535], got {args.metrics_port}"
    if args.metrics_linger is not None and args.metrics_port is None:
        return "--metrics-linger: needs --metrics-port (there is no metrics endpoint to keep up)"
    return None


def _with_metrics(args, run, **kw) -> int:
    """``run(exporter, bound port)`` with ``--metrics-port`` served on loopback (``Exporter(**kw)``; ``None, None``
    without it), closed after; a port that cannot be bound fails before anything runs. The exporter starts before
    the slow part loads, so a scraper sees every series at 0 before the first request."""
    if args.metrics_port is None:
        return run(None, None)
    from workloads.harness.prometheus import Exporter
    exporter = Exporter(**kw)
    try:
        port = exporter.serve(args.metrics_port)
    except OSError as e:
        return _fail(f"--metrics-port {args.metrics_port}: {e}")
    print(f"Prometheus metrics on http://127.0.0.1:{port}/metrics")
    try:
        return run(exporter, port)
    finally:
        exporter.close()


def _serve_model_workload(args, schedule, slo, progress: bool) -> int:
    started = time.perf_counter()
    return _with_metrics(args, lambda exporter, port: _replay_and_report(args, schedule, slo, progress, started,
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
        options = _options(args)
        if name == "mixed":
            from workloads.models import mixed
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
        return _fail(f"the cache's pools do not fit in memory ({str(e).strip().splitlines()[0]}); give a smaller "
                     f"--pool-pages (now {options.pool_pages:,}) or --encoder-bytes (now {options.encoder_bytes:,})")
    with hold_interrupts() as held:  # what was measured is printed and written whole, Ctrl-C or not
        status = _model_report(args, name, options, off, on, slo, started, mstar, equal if args.in_flight else None)
    if held.received:
        _held_interrupt()
        status = INTERRUPTED
    if exporter is not None and args.metrics_linger and status != INTERRUPTED:
        _linger(exporter, args.metrics_linger, port)
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
            _save("--json", args.json or args.html.with_suffix(".json"),
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
            rows = [sum(r.result.prompt_tokens - r.result.hit_tokens for r in run.completed) for run in (off, on)]
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
        saved &= _save("--html", args.html, report_html(off, on, slo))
    if args.json or args.html:
        saved &= _save("--json", args.json or args.html.with_suffix(".json"),
                       json.dumps(report_json(off, on, slo), indent=2) + "\n")
    if on.interrupted:
        return INTERRUPTED
    if failed := [run.label for run in (off, on) if run.records and not run.completed]:
        print(f"mmcache: error: every request failed with the cache {' and '.join(failed)} (see the failed: lines "
              "above); nothing was served", file=sys.stderr)
        return 1
    return 0 if saved else 1


def data_command(args) -> int:
    """``mmcache data list|fetch``; unknown names and an unreadable manifest fail before anything is fetched."""
    from workloads import datasets
    try:
        sources = datasets.load_sources(args.manifest)
    except datasets.DataError as e:
        return _fail(str(e))
    root, how = registry.data_place(args.data)
    if args.data_command == "list":
        for s in sources.values():
            present = sum((root / f.path).is_file() for f in s.files)
            state = (f"{present} of {len(s.files)} files present" if s.files else
                     f"made by hand, folder {'present' if (root / s.name).is_dir() else 'missing'} "
                     f"(mmcache data fetch {s.name} says how)")
            print(f"{s.name:15} {s.what}\n{'':15} read by {s.read_by}; licence {s.licence}; {s.home}; {state}")
        print(f"data folder: {root} (from {how})")
        return 0
    if unknown := [n for n in args.names if n not in sources]:
        return _fail(f"unknown data source {unknown[0]!r}; known: {', '.join(sources)}")
    if problem := _data_folder_problem(root):
        return _fail(f"data folder {root} (from {how}): {problem}")
    by_hand = [n for n, s in sources.items() if not s.files]
    chosen = args.names or [n for n in sources if n not in by_hand]  # by default, every source there is to download
    progress = not args.no_progress and sys.stderr.isatty()
    try:
        missing = datasets.fetch([sources[n] for n in chosen], root, progress)
    except datasets.DataError as e:
        print(f"mmcache: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mmcache: interrupted (Ctrl-C) while fetching: the files fetched stay; run the command again to "
              "resume the one in progress", file=sys.stderr)
        return INTERRUPTED
    if not args.names and by_hand:
        print(f"not fetched by default, made by hand: {', '.join(by_hand)} (mmcache data fetch NAME says how)")
    where = "replays read it by default" if how != "--data" else f"replays read it with --data {root}"
    print(f"data folder: {root} (from {how}); {where}")
    if missing:
        print(f"mmcache: error: nothing fetched for {', '.join(missing)}: made by hand, and the folder is missing "
              f"(see above for how to make it in {root})", file=sys.stderr)
        return 1
    return 0


def _data_folder_problem(root: Path) -> str | None:
    """Why files cannot be put under ``root`` (the folders missing on the way are made), or None."""
    if root.exists():
        return None if root.is_dir() and os.access(root, os.W_OK | os.X_OK) else "not a writable folder"
    parent = root.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be made: {parent} is not a writable folder"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "replay":
            return replay_command(args, vars(parser.parse_args(["replay"])))
        if args.command == "data":
            return data_command(args)
    except KeyboardInterrupt:  # a replay that was measuring returns its partial results itself
        print("mmcache: interrupted (Ctrl-C) before anything was measured", file=sys.stderr)
        return INTERRUPTED
    return _fail(f"unknown command {args.command!r}")  # pragma: no cover (argparse rejects it first)


if __name__ == "__main__":
    sys.exit(main())
