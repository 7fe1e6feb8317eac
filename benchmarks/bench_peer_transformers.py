"""mmcache beside a real peer measured in the same run: transformers' continuous-batching engine with its prefix
sharing off and on, the same engine with mmcache under it (``mmcache.hf.continuous_batching``: "mmcache in peer"),
and at one in flight mmcache's own runner (``mmcache.hf.runner.serve`` over ``PagedKVCache``, a batch of one), on one
random-weight Llama from ``workloads.fixtures``, replaying the same requests in the same arrival order with
``--inflight`` requests in flight (a list: 1,4,16).

Traces: MT-Bench two-turn chats, ShareGPT (the shared sample is single-turn: nothing to reuse, it shows the cost of
the caches alone), mini-swe-agent sessions (the first calls of a few sessions, interleaved), the Mooncake
conversation slice (each request cut to its first 4 blocks of ``2 * page`` tokens, as ``mooncake-model``; the real
trace under the data folder, else the embedded 2,000-line slice, labelled). Pools: from
just above the largest request to unbounded (every distinct prompt page fits). Per pool size and engine: prompt tokens
computed, realized reuse vs the ceiling (what an unbounded exact prefix cache could match: full pages of earlier
prompts, the last prompt token always computed), TTFT p50/p99, requests/s, and whether the outputs equal the
peer's with sharing off. Timings: median over ``--runs`` with the min-max spread, the engines taking turns within each
repetition; reuse is deterministic.

Knee section (``--knee``; with ``--knee`` and no ``--traces`` only the knee runs): agent sessions round-robin, 8 in
flight (the mini-swe-agent trajectories of the data folder, the first ``--knee-calls`` calls of ``--knee-sessions``
sessions; without them agent-model's generated sessions of the same shape, labelled), at the ``--knee-points`` pool
sizes where the replay's ``lru`` and its offline optimum differ most on these calls (or ``--knee-pools``): the peer's
own sharing, mmcache under the same engine with ``eviction="lru"`` and with the default, beside the replay's ``lru``,
default and optimum on the same calls (``workloads.sizing.sweep.run_sweep``, as ``mmcache replay --eviction
optimal``). Per row: prompt tokens computed, hit share, and "of optimal" (tokens matched over the optimum's).

Run: python benchmarks/bench_peer_transformers.py [--model bigger] [--runs 3] [--inflight 1,4,16]
     python benchmarks/bench_peer_transformers.py --knee [--knee-sessions 8 --knee-calls 4]   # the knee alone
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmcache.hf.paged_kv import PagedKVCache  # noqa: E402
from mmcache.hf.runner import serve  # noqa: E402
from workloads import registry  # noqa: E402
from workloads.peers.transformers_cb import Call, Outcome, PeerEngine  # noqa: E402

DATA = registry.data_place()[0]  # where the replays read: $MMCACHE_DATA, else what mmcache data fetch fills
TRACE_FILES = {"mt-bench": ("mt-bench", "mt-bench/question.jsonl"),
               "sharegpt": ("sharegpt", "sharegpt/sharegpt_sample_50_single_turn.json"),
               "swe-agent": ("mini-swe-agent", "mini-swe-agent/trajs")}  # mooncake runs on the embedded slice without
DEFAULT_TRACES = "mt-bench,sharegpt,swe-agent"


def missing_data(traces: list[str]) -> str | None:
    """Why a trace asked for cannot run (an unknown name, or its data not in DATA), in one line; None if all can."""
    for trace in traces:
        if trace == "mooncake":
            continue
        if trace not in TRACE_FILES:
            return f"unknown trace {trace!r}; expected {', '.join(TRACE_FILES)} or mooncake"
        source, path = TRACE_FILES[trace]
        if not (DATA / path).exists():
            return (f"no {trace} data: looked for {DATA / path} (the data folder the replays read); get it with "
                    f"`mmcache data fetch {source}` or leave {trace} out of --traces")
    return None
BIGGER = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


def load_model(which: str, model_dir: Path):
    """The tiny Llama of ``workloads.fixtures``, or (``bigger``) the same builder with wider, deeper layers."""
    from transformers import AutoModelForCausalLM

    from workloads import fixtures
    from workloads.options import ModelWorkloadOptions

    config = fixtures.tiny_llama_config()
    if which == "bigger":
        for k, v in BIGGER.items():
            setattr(config, k, v)
    return fixtures.load_model(AutoModelForCausalLM, ModelWorkloadOptions(model_dir=model_dir), "tiny-llama",
                               config)[0]


def load_mooncake_calls(args) -> tuple[list[Call], str]:
    """The first ``--questions`` Mooncake requests, scaled as ``mooncake-model`` does; and where they came from."""
    from workloads.models.agent import scaled_prompt
    from workloads.registry import embedded_slice
    from workloads.traces.mooncake import load_mooncake

    path = DATA / "mooncake" / "conversation_trace.jsonl"
    source = str(path) if path.is_file() else f"embedded slice {embedded_slice()} (no {path})"
    trace = load_mooncake(path if path.is_file() else embedded_slice(), limit=args.mooncake_requests)
    vocab = 32000  # the tiny Llama's
    calls = [Call(s.name, s.name, scaled_prompt(s.hash_ids, s.calls[0].prompt_len, 2 * args.page_size,
                                                vocab).tolist()) for s in trace.sessions]
    return calls, source


def load_calls(trace: str, args) -> list[Call]:
    """The trace's calls in arrival order (ties: session order). Chat logs carry no times, so call i of every session
    arrives at i; swe-agent sessions, cut to their first ``--calls`` calls, do the same (sessions start together
    and interleave, as concurrent agents do) unless ``--swe-order timestamp`` keeps their recorded times."""
    from workloads.traces.chat import load_sharegpt
    from workloads.traces.mt_bench import load_mt_bench
    from workloads.traces.swe_agent import load_swe_agent

    if trace == "mooncake":
        return load_mooncake_calls(args)[0]
    if trace == "mt-bench":
        t = load_mt_bench(DATA / "mt-bench", limit=args.questions)
    elif trace == "sharegpt":
        t = load_sharegpt(DATA / "sharegpt" / "sharegpt_sample_50_single_turn.json", limit=args.questions)
    else:
        t = load_swe_agent(DATA / "mini-swe-agent" / "trajs", limit=args.sessions)
    keyed = []
    for s_i, s in enumerate(t.sessions):
        for i in range(min(len(s.calls), args.calls if trace == "swe-agent" else len(s.calls))):
            t_i = i if trace == "swe-agent" and args.swe_order == "index" else s.calls[i].arrival_s
            keyed.append(((t_i, s_i, i), s, i))
    keyed.sort(key=lambda x: x[0])
    return [Call(r.rid, r.session, r.token_ids.tolist()) for r in (s.build(i) for _, s, i in keyed)]


def ceiling(calls: list[Call], P: int) -> list[int]:
    """Per call, the prompt tokens an unbounded exact prefix cache could match: leading full pages (at most
    ``(n-1)//P``) equal to a prefix of an earlier prompt. Generated tokens never recur here: the next prompt carries
    the trace's recorded reply, not the random-weight model's."""
    seen, out = set(), []
    for c in calls:
        key, keys = None, []
        for i in range(len(c.token_ids) // P):
            key = hash((key, tuple(c.token_ids[i * P:(i + 1) * P])))
            keys.append(key)
        limit = (len(c.token_ids) - 1) // P
        k = next((i for i in range(limit) if keys[i] not in seen), limit)
        out.append(k * P)
        seen.update(keys)
    return out


@dataclasses.dataclass
class Run:
    outcomes: list[Outcome]
    wall_s: float


def run_peer(model, calls, *, share, pages, args, inflight, mmcache=False, eviction=None,
             probe=None) -> tuple[Run, int]:
    """One replay through the peer engine; its run and the blocks the engine really held. ``eviction``: the policy
    of mmcache under the engine (None: mmcache's default); ``probe(engine)`` is called as each request completes."""
    with PeerEngine(model, share=share, page_size=args.page_size, num_blocks=pages, mmcache=mmcache,
                    max_batch_tokens=args.batch_tokens, max_new_tokens=args.new_tokens, eviction=eviction) as e:
        t = time.perf_counter()
        out = e.replay(calls, inflight=inflight, on_done=None if probe is None else lambda _: probe(e))
        return Run(out, time.perf_counter() - t), e.num_blocks


def run_ours(model, calls, *, pages, args) -> tuple[Run, int]:
    kv = PagedKVCache.for_model(model, num_pages=pages, page_size=args.page_size)
    t, out = time.perf_counter(), []
    for c in calls:  # one request at a time: the runner serves a batch of one
        s = serve(model, kv, c.rid, c.token_ids, max_new_tokens=args.new_tokens, chunk_tokens=args.batch_tokens)
        out.append(Outcome(c.rid, s.output_ids, s.matched_tokens, s.ttft_s))
    return Run(out, time.perf_counter() - t), pages


def summarize(name, runs: list[Run], pages, calls, ceil, reference) -> dict:
    prompt = sum(len(c.token_ids) for c in calls)
    matched = sum(o.matched_tokens for o in runs[0].outcomes)
    ttfts = [sorted(o.ttft_s for o in r.outcomes) for r in runs]
    p50 = [float(np.percentile(t, 50)) * 1e3 for t in ttfts]
    p99 = [float(np.percentile(t, 99)) * 1e3 for t in ttfts]
    rps = [len(calls) / r.wall_s for r in runs]
    same = sum(a.output_ids == b.output_ids for a, b in zip(runs[0].outcomes, reference)) if reference else None
    return dict(engine=name, pages=pages, computed=prompt - matched, reuse=matched / prompt,
                of_ceiling=matched / max(1, sum(ceil)), p50=p50, p99=p99, rps=rps, same=same, n=len(calls))


def spread(xs: list[float], fmt: str) -> str:
    med = statistics.median(xs)
    return (fmt % med) + (f" ({fmt % min(xs)}-{fmt % max(xs)})" if len(xs) > 1 else "")


def parser() -> argparse.ArgumentParser:
    """This script's options; ``parser().parse_args([])`` are the replay's defaults (page size, new tokens, trace cuts)
    that the benchmarks beside it replay with."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "bigger"), default="tiny")
    ap.add_argument("--traces", default=None, help=f"any of mt-bench, sharegpt, swe-agent, mooncake (default "
                    f"{DEFAULT_TRACES}; none with --knee unless given)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=256, help="peer max_batch_tokens = mmcache prefill chunk")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--inflight", default="1", help="requests in flight, a list (1,4,16); mmcache's runner serves "
                    "one at a time and runs at 1 only")
    ap.add_argument("--mooncake-requests", type=int, default=200, help="first requests of the Mooncake trace")
    ap.add_argument("--questions", type=int, default=40, help="MT-Bench questions / ShareGPT conversations")
    ap.add_argument("--sessions", type=int, default=3, help="mini-swe-agent sessions")
    ap.add_argument("--calls", type=int, default=4, help="first calls of each mini-swe-agent session")
    ap.add_argument("--swe-order", choices=("index", "timestamp"), default="index")
    ap.add_argument("--pools", default="0,0.25,0.5,1", help="pool sizes as fractions of unbounded (every "
                    "distinct prompt page plus the largest request, over the peer's 15%% margin), floored at the "
                    "largest request (0: that floor)")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MMCACHE_MODEL_DIR",
                                                                          Path.home() / ".cache/mmcache/models")))
    add_knee_args(ap)
    return ap


def add_knee_args(ap: argparse.ArgumentParser, takes: str = "about 1.5 minutes at the defaults on a 2-core "
                  "machine") -> None:
    """The knee section's options (this script's and ``bench_vllm.py``'s); ``takes``: how long, for ``--help``."""
    g = ap.add_argument_group("knee", "pools at the knee of agent sessions round-robin 8 in flight, against the "
                              "offline optimum on the same calls")
    g.add_argument("--knee", action="store_true", help="run the knee section (after the --traces tables; alone when "
                   f"--traces is not given); {takes}")
    g.add_argument("--knee-sessions", type=int, default=8, help="agent sessions (round-robin, 8 in flight)")
    g.add_argument("--knee-calls", type=int, default=4, help="first calls of each session")
    g.add_argument("--knee-page-size", type=int, default=32, help="page (block) size of the knee section")
    g.add_argument("--knee-points", type=int, default=3, help="pool sizes: where the replay's lru and optimum "
                   "differ most on these calls")
    g.add_argument("--knee-pools", help="pool sizes in tokens instead (16k,24k,32k)")


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    traces = [t for t in (args.traces if args.traces is not None else "" if args.knee else DEFAULT_TRACES
                          ).split(",") if t]
    if problem := missing_data(traces):
        sys.exit(f"bench_peer_transformers: {problem}")
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.model_dir)
    P = args.page_size
    import transformers
    print(f"# machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, transformers {transformers.__version__}")
    cfg = model.config
    print(f"# model: random-weight Llama ({args.model}) hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_key_value_heads} KV heads; prefill chunk {args.batch_tokens}, {args.new_tokens} new tokens"
          + (f"; page {P}, in flight {args.inflight}, {args.runs} runs (median, min-max)" if traces else ""))
    print(f"# data: {DATA if DATA.is_dir() else 'missing: ' + str(DATA)}")
    warm = [Call("warm", "warm", list(range(3, 3 + 4 * P)))]
    run_peer(model, warm, share=True, pages=64, args=args, inflight=1), run_ours(model, warm, pages=64, args=args)
    for trace in traces:
        calls = load_calls(trace, args)
        if trace == "mooncake":
            print(f"\n# mooncake source: {load_mooncake_calls(args)[1]}")
        for inflight in map(int, args.inflight.split(",")):
            bench_trace(model, trace, calls, inflight, args)
    if args.knee:
        bench_knee(model, args)


def bench_trace(model, trace: str, calls: list[Call], inflight: int, args) -> None:
    """One table: every engine on ``calls`` at ``inflight`` in flight, at each pool size."""
    P = args.page_size
    ceil = ceiling(calls, P)
    prompt = sum(len(c.token_ids) for c in calls)
    largest = max(-(-(len(c.token_ids) + args.new_tokens) // P) for c in calls) * inflight
    distinct = len({hash(tuple(c.token_ids[:(i + 1) * P])) for c in calls for i in range(len(c.token_ids) // P)})
    floor = int(largest * 1.25) + 2  # the peer keeps a 15% margin free before admitting a prefill
    unbounded = int((distinct + largest) / 0.85) + 2  # every prompt page stays, margin included: no eviction
    pools = sorted({max(floor, int(float(f) * unbounded)) for f in args.pools.split(",")})
    print(f"\n## {trace}, {inflight} in flight: {len(calls)} requests, {prompt:,} prompt tokens, ceiling "
          f"{sum(ceil) / prompt:.1%} reusable, {distinct:,} distinct prompt pages, largest request x in flight "
          f"{largest} pages")
    print(f"{'pool':>6} {'engine':<15} {'computed':>9} {'reuse':>6} {'of ceil':>7} {'TTFT p50 ms':>20} "
          f"{'TTFT p99 ms':>20} {'req/s':>18} {'x peer-off':>10} {'same out':>8}")
    base = None
    for pages in pools:
        rows = []
        engines = (
            ("peer share-off", lambda: run_peer(model, calls, share=False, pages=pages, args=args,
                                                inflight=inflight)),
            ("peer share-on", lambda: run_peer(model, calls, share=True, pages=pages, args=args,
                                               inflight=inflight)),
            ("mmcache in peer", lambda: run_peer(model, calls, share=True, pages=pages, args=args,
                                                 inflight=inflight, mmcache=True)),
            ("mmcache runner", lambda: run_ours(model, calls, pages=pages, args=args)))
        engines = [(name, fn) for name, fn in engines
                   if not (name == "peer share-off" and base is not None)  # pool-independent: measured once
                   and not (name == "mmcache runner" and inflight > 1)]  # a batch of one: compared at 1 only
        runs: dict[str, list[Run]] = {name: [] for name, _ in engines}
        got: dict[str, int] = {}
        for _ in range(args.runs):  # engines take turns, so a change in the shared machine's load hits them alike
            for name, fn in engines:
                r, got[name] = fn()
                runs[name].append(r)
        for name, _ in engines:
            rows.append(summarize(name, runs[name], got[name], calls, ceil, base[0].outcomes if base else None))
            if name == "peer share-off":
                base = (runs[name][0], rows[-1])
        for row in rows:
            ratio = statistics.median(row["rps"]) / statistics.median(base[1]["rps"])
            same = "ref" if row["same"] is None else f"{row['same']}/{row['n']}"
            print(f"{row['pages']:>6} {row['engine']:<15} {row['computed']:>9,} {row['reuse']:>6.1%} "
                  f"{row['of_ceiling']:>7.1%} {spread(row['p50'], '%.1f'):>20} {spread(row['p99'], '%.1f'):>20} "
                  f"{spread(row['rps'], '%.1f'):>18} {ratio:>9.2f}x {same:>8}")


# ------------------------------------------------------------------------------------------------------- the knee
KNEE_IN_FLIGHT = 8  # round-robin, 8 in flight: docs/eviction.md's agent rows
KNEE_GRID = 16      # pool sizes the replay tries to find the knee
KNEE_NOTE = """\
computed: prompt tokens prefilled (prompt - matched); hit share: matched / prompt; of optimal: matched over what the
offline optimum matched on the same calls at the same pool; live: requests holding pages as each request completed
(mmcache's cache under the engine, mean; the replay: at most).
The optimum (Belady, as `mmcache replay --eviction optimal`: workloads.sizing.sweep.run_sweep) is prompt-page reuse in
the replay's service model: a call is matched when admitted, in round-robin order, prefilled at once and holds its
prompt + {new} new tokens until it finishes, {inflight} live (the oldest finished early when the pool is short).
The engines are sent the same calls in the same order, {inflight} at a time (a session's next call once its previous
one finished), but serve them their own way: a request is matched when the engine schedules it, not when it is sent;
the engine prefills {chunk} tokens a step, so sent requests wait in its queue holding no pages and few run at once
(see live); the peer keeps 15% of its blocks free and drops every cached block when under that margin. With fewer
pages live, more of the pool caches than in the replay, so an engine's 'of optimal' can pass 100%: it is a share of
this replay's optimum, not a bound on the engine. Compare engine rows with each other, replay rows with the optimum."""


@dataclasses.dataclass
class KneeSession:
    """One agent session as the engines and the replay both see it: the prompts the engines are sent, each followed by
    ``new_tokens`` generated tokens that no later prompt carries (the next prompt holds the trace's recorded reply,
    not the random-weight model's), so the replay is given no output ids and indexes no output page."""

    name: str
    prompts: list[np.ndarray]
    new_tokens: int
    calls: list = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        from workloads.traces.text_trace import CallInfo
        self.calls = [CallInfo(float(i), int(p.size), self.new_tokens) for i, p in enumerate(self.prompts)]

    def build(self, i: int):
        from workloads.traces.text_trace import TextRequest
        return TextRequest(rid=f"{self.name}#{i}", session=self.name, arrival_s=float(i), token_ids=self.prompts[i],
                           names=None, output_ids=None, output_len=self.new_tokens)


def load_knee_trace(args):
    """The knee section's sessions as a ``TextTrace`` (the replay's input), and where they came from: the first
    ``--knee-calls`` calls of the first ``--knee-sessions`` mini-swe-agent trajectories of the data folder, else as
    many of agent-model's generated sessions (its embedded default: system prompt, task, command / output turns)."""
    from workloads.traces.text_trace import TextTrace

    folder = DATA / TRACE_FILES["swe-agent"][1]
    if folder.exists():
        from workloads.traces.swe_agent import load_swe_agent
        trajs = load_swe_agent(folder, limit=args.knee_sessions).sessions
        source = f"mini-swe-agent ({folder})"
    else:
        from workloads import fixtures
        from workloads.models.agent import agent_messages, agent_trajectory
        tok, rng = fixtures.text_tokenizer(None), np.random.default_rng(0)
        trajs = [agent_trajectory(f"gen-{k}", agent_messages(rng, args.knee_calls), tok, 0.0, 1.0)
                 for k in range(args.knee_sessions)]
        source = f"agent-model's generated agent sessions (no {folder}: not the real trace)"
    sessions = [KneeSession(t.name, [t.build(i).token_ids for i in range(min(args.knee_calls, len(t.calls)))],
                            args.new_tokens) for t in trajs]
    return TextTrace(source=source, kind="swe-agent", sessions=sessions), source


def knee_calls(trace) -> list[Call]:
    """The engines' calls in the replay's round-robin order (``workloads.sizing.ordering.schedule``)."""
    from workloads.sizing.ordering import Serving, schedule

    order = schedule(trace.sessions, Serving("round-robin", KNEE_IN_FLIGHT))
    return [Call(r.rid, r.session, r.token_ids.tolist()) for r in (trace.sessions[s].build(i) for s, i, _ in order)]


def knee_sweep(trace, P: int, pages: list[int]):
    """The replay on the same calls at ``pages`` (blocks of ``P``): ``lru`` with the offline optimum, and the
    default (``workloads.sizing.sweep.run_sweep``, the code path of ``mmcache replay --eviction ...,optimal``)."""
    from mmcache.eviction import DEFAULT_POLICY
    from workloads.sizing.ordering import Serving
    from workloads.sizing.sweep import run_sweep

    sizes = [n * P for n in pages]  # the sessions of the engine's calls, each served before the next is admitted
    kw = dict(page_size=P, pool_sizes=sizes, serving=Serving("round-robin", KNEE_IN_FLIGHT, 1))
    return run_sweep(trace, eviction="lru", **kw), run_sweep(trace, eviction=DEFAULT_POLICY, optimal=False, **kw)


def knee_pages(trace, P: int, args) -> tuple[list[int], str]:
    """The pool sizes (blocks) of the knee: ``--knee-pools``, else the ``--knee-points`` sizes of a grid from one
    largest request (over the peer's margin) to every distinct prompt page plus 8 requests where the replay's ``lru``
    and optimum differ most; and a line saying how they were found."""
    from workloads.sizes import format_size, parse_sizes

    if args.knee_pools:
        return [max(1, int(t) // P) for t in parse_sizes(args.knee_pools)], "given (--knee-pools)"
    requests = [trace.sessions[s].build(i) for s in range(len(trace.sessions))
                for i in range(len(trace.sessions[s].calls))]
    largest = max(-(-(r.prompt_len + r.output_len) // P) for r in requests)
    distinct = len({hash(r.token_ids[:(i + 1) * P].tobytes()) for r in requests for i in range(r.prompt_len // P)})
    lo, hi = int(largest * 1.25) + 2, distinct + KNEE_IN_FLIGHT * largest
    grid = sorted({lo + (hi - lo) * k // (KNEE_GRID - 1) for k in range(KNEE_GRID)})
    lru, _ = knee_sweep(trace, P, grid)
    gaps = [(o.hit_tokens - r.hit_tokens, n) for r, o, n in zip(lru.runs, lru.optimal, grid)]
    best = sorted(n for _, n in sorted(gaps, key=lambda g: (-g[0], g[1]))[:args.knee_points])
    by = ", ".join(f"{g:,}" for g, n in gaps if n in best)
    none = "" if max(g for g, _ in gaps) > 0 else "; lru matched the optimum at every size: no knee on these calls"
    return best, (f"the {len(best)} of {len(grid)} sizes from {format_size(lo * P)} to {format_size(hi * P)} tokens "
                  f"where the replay's lru and optimum differ most (by {by} prompt tokens){none}")


def bench_knee(model, args, extra=()) -> None:
    """The knee table: per pool size, prompt tokens computed, hit share and share of the optimum's reuse for the peer's
    own sharing, mmcache under the same engine with ``lru`` and with the default, each of ``extra`` (``(label,
    fn(calls, pages, args) -> (Run, blocks held, live))``: bench_vllm's vLLM; ``args`` carries the knee's page size),
    and the replay's ``lru``, default and optimum on the same calls at the blocks the peer engine held."""
    from mmcache.eviction import DEFAULT_POLICY

    kargs = argparse.Namespace(**{**vars(args), "page_size": args.knee_page_size})
    P = kargs.page_size
    started = time.perf_counter()
    trace, source = load_knee_trace(args)
    calls = knee_calls(trace)
    prompt = sum(len(c.token_ids) for c in calls)
    pages, how = knee_pages(trace, P, args)
    print(f"\n## knee: {len(trace.sessions)} agent sessions x up to {args.knee_calls} calls, round-robin, "
          f"{KNEE_IN_FLIGHT} in flight, page {P}: {len(calls)} requests, {prompt:,} prompt tokens, ceiling "
          f"{sum(ceiling(calls, P)) / prompt:.1%} reusable")
    print(f"# source: {source}")
    print(f"# pools: {how}")

    def mmcache_in_peer(pg, policy):  # also how many requests held pages in its cache as each one completed
        live: list[int] = []
        run, held = run_peer(model, calls, share=True, pages=pg, args=kargs, inflight=KNEE_IN_FLIGHT, mmcache=True,
                             eviction=policy, probe=lambda e: live.append(e.prefix_cache.stats().requests_live))
        return run, held, f"{statistics.mean(live):.1f}"

    engines = [("peer share-on", lambda pg: run_peer(model, calls, share=True, pages=pg, args=kargs,
                                                     inflight=KNEE_IN_FLIGHT) + ("-",)),
               ("mmcache lru", lambda pg: mmcache_in_peer(pg, "lru")),
               (f"mmcache {DEFAULT_POLICY} (default)", lambda pg: mmcache_in_peer(pg, DEFAULT_POLICY))]
    engines += [(name, lambda pg, fn=fn: fn(calls, pg, kargs)) for name, fn in extra]
    measured = []  # per pool: (blocks the first engine held, [(label, run, blocks held, live)])
    for pg in pages:
        rows = [(name, *fn(pg)) for name, fn in engines]
        measured.append((rows[0][2], rows))
    lru, default = knee_sweep(trace, P, [held for held, _ in measured])
    print(f"{'pool tok':>8} {'blocks':>6} {'engine / policy':<26} {'computed':>9} {'hit share':>9} {'of optimal':>10} "
          f"{'live':>5} {'same out':>8} {'wall s':>6}")
    for k, (held, rows) in enumerate(measured):
        opt = lru.optimal[k].hit_tokens
        of = lambda hit: f"{hit / opt:.1%}" if opt else "-"  # noqa: E731
        ref = rows[0][1].outcomes
        for label, run, blocks, live in rows:
            hit = sum(o.matched_tokens for o in run.outcomes)
            agree = sum(a.output_ids == b.output_ids for a, b in zip(run.outcomes, ref))
            same = "ref" if run.outcomes is ref else f"{agree}/{len(ref)}"
            note = "" if blocks == held else f" ({blocks} blocks)"
            print(f"{held * P:>8,} {held:>6} {label + note:<26} {prompt - hit:>9,} {hit / prompt:>9.1%} {of(hit):>10} "
                  f"{live:>5} {same:>8} {run.wall_s:>6.1f}")
        for label, r in (("replay lru", lru.runs[k]), (f"replay {DEFAULT_POLICY} (default)", default.runs[k]),
                         ("replay optimal", lru.optimal[k])):
            print(f"{held * P:>8,} {held:>6} {label:<26} {prompt - r.hit_tokens:>9,} {r.hit_tokens / prompt:>9.1%} "
                  f"{of(r.hit_tokens):>10} {f'<={r.peak_live_requests}':>5} {'':>8} {'':>6}")
    print(f"# {time.perf_counter() - started:.0f} s, one run of each engine (the reuse repeats; wall s is one "
          f"sample on a shared machine)")
    print("\n".join("# " + line for line in KNEE_NOTE.format(new=args.new_tokens, inflight=KNEE_IN_FLIGHT,
                                                              chunk=args.batch_tokens).splitlines()))


if __name__ == "__main__":
    main()
