"""mmcache beside a real peer measured in the same run: transformers' continuous-batching engine with its prefix
sharing off and on, and mmcache's runner (``mmcache.hf.runner.serve`` over ``PagedKVCache``), on one random-weight
Llama from ``workloads.fixtures``, replaying the same requests in the same arrival order.

Traces: MT-Bench two-turn chats, ShareGPT (the shared sample is single-turn: nothing to reuse, it shows the cost of
the caches alone), mini-swe-agent sessions (the first calls of a few sessions, interleaved). Pools: from
just above the largest request to unbounded (every distinct prompt page fits). Per pool size and engine: prompt tokens
computed, realized reuse vs the ceiling (what an unbounded exact prefix cache could match: full pages of earlier
prompts, the last prompt token always computed), TTFT p50/p99, requests/s, and whether the outputs equal the
peer's with sharing off. Timings: median over ``--runs`` with the min-max spread; reuse is deterministic.

Run: python benchmarks/bench_peer_transformers.py [--model bigger] [--runs 3] [--inflight 4]
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

DATA = registry.data_place()[0]  # $MMCACHE_DATA, else ../shared/data: where the replays read
TRACE_FILES = {"mt-bench": ("mt-bench", "mt-bench/question.jsonl"),
               "sharegpt": ("sharegpt", "sharegpt/sharegpt_sample_50_single_turn.json"),
               "swe-agent": ("mini-swe-agent", "mini-swe-agent/trajs")}


def missing_data(traces: list[str]) -> str | None:
    """Why a trace asked for cannot run (an unknown name, or its data not in DATA), in one line; None if all can."""
    for trace in traces:
        if trace not in TRACE_FILES:
            return f"unknown trace {trace!r}; expected {', '.join(TRACE_FILES)}"
        source, path = TRACE_FILES[trace]
        if not (DATA / path).exists():
            return (f"no {trace} data: looked for {DATA / path} ($MMCACHE_DATA, else ../shared/data); get it with "
                    f"`mmcache data fetch {source} --data {DATA}` or leave {trace} out of --traces")
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


def load_calls(trace: str, args) -> list[Call]:
    """The trace's calls in arrival order (ties: session order). Chat logs carry no times, so call i of every session
    arrives at i; swe-agent sessions, cut to their first ``--calls`` calls, do the same (sessions start together
    and interleave, as concurrent agents do) unless ``--swe-order timestamp`` keeps their recorded times."""
    from workloads.traces.chat import load_sharegpt
    from workloads.traces.mt_bench import load_mt_bench
    from workloads.traces.swe_agent import load_swe_agent

    path = DATA / TRACE_FILES[trace][1]
    if trace == "mt-bench":
        t = load_mt_bench(path, limit=args.questions)
    elif trace == "sharegpt":
        t = load_sharegpt(path, limit=args.questions)
    else:
        t = load_swe_agent(path, limit=args.sessions)
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


def run_peer(model, calls, *, share, pages, args) -> tuple[Run, int]:
    with PeerEngine(model, share=share, page_size=args.page_size, num_blocks=pages,
                    max_batch_tokens=args.batch_tokens, max_new_tokens=args.new_tokens) as e:
        t = time.perf_counter()
        out = e.replay(calls, inflight=args.inflight)
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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "bigger"), default="tiny")
    ap.add_argument("--traces", default="mt-bench,sharegpt,swe-agent")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--batch-tokens", type=int, default=256, help="peer max_batch_tokens = mmcache prefill chunk")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=1, help="peer requests in flight (mmcache's runner: always 1)")
    ap.add_argument("--questions", type=int, default=40, help="MT-Bench questions / ShareGPT conversations")
    ap.add_argument("--sessions", type=int, default=3, help="mini-swe-agent sessions")
    ap.add_argument("--calls", type=int, default=4, help="first calls of each mini-swe-agent session")
    ap.add_argument("--swe-order", choices=("index", "timestamp"), default="index")
    ap.add_argument("--pools", default="0,0.25,0.5,1", help="pool sizes as fractions of unbounded (every "
                    "distinct prompt page plus the largest request, over the peer's 15%% margin), floored at the "
                    "largest request (0: that floor)")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MMCACHE_MODEL_DIR",
                                                                          Path.home() / ".cache/mmcache/models")))
    args = ap.parse_args(argv)
    if problem := missing_data(args.traces.split(",")):
        sys.exit(f"bench_peer_transformers: {problem}")
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.model_dir)
    P = args.page_size
    import transformers
    print(f"# machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, transformers {transformers.__version__}")
    cfg = model.config
    print(f"# model: random-weight Llama ({args.model}) hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.num_key_value_heads} KV heads; page {P}, prefill chunk {args.batch_tokens}, {args.new_tokens} new "
          f"tokens, peer in flight {args.inflight}, {args.runs} runs (median, min-max)")
    if args.inflight > 1:
        print("# mmcache serves one request at a time and its TTFT starts when its serve starts (no queueing): "
              "compare req/s, not TTFT, against the peer's in-flight requests")
    warm = [Call("warm", "warm", list(range(3, 3 + 4 * P)))]
    run_peer(model, warm, share=True, pages=64, args=args), run_ours(model, warm, pages=64, args=args)
    for trace in args.traces.split(","):
        calls = load_calls(trace, args)
        ceil = ceiling(calls, P)
        prompt = sum(len(c.token_ids) for c in calls)
        largest = max(-(-(len(c.token_ids) + args.new_tokens) // P) for c in calls) * args.inflight
        distinct = len({hash(tuple(c.token_ids[:(i + 1) * P])) for c in calls for i in range(len(c.token_ids) // P)})
        floor = int(largest * 1.25) + 2  # the peer keeps a 15% margin free before admitting a prefill
        unbounded = int((distinct + largest) / 0.85) + 2  # every prompt page stays, margin included: no eviction
        pools = sorted({max(floor, int(float(f) * unbounded)) for f in args.pools.split(",")})
        print(f"\n## {trace} ({DATA / TRACE_FILES[trace][1]}): {len(calls)} requests, {prompt:,} prompt tokens, "
              f"ceiling {sum(ceil) / prompt:.1%} "
              f"reusable, {distinct:,} distinct prompt pages, largest request {largest} pages")
        print(f"{'pool':>6} {'engine':<14} {'computed':>9} {'reuse':>6} {'of ceil':>7} {'TTFT p50 ms':>20} "
              f"{'TTFT p99 ms':>20} {'req/s':>18} {'x peer-off':>10} {'same out':>8}")
        base = None
        for pages in pools:
            rows = []
            for name, fn in (("peer share-off", lambda: run_peer(model, calls, share=False, pages=pages, args=args)),
                             ("peer share-on", lambda: run_peer(model, calls, share=True, pages=pages, args=args)),
                             ("mmcache", lambda: run_ours(model, calls, pages=pages, args=args))):
                if name == "peer share-off" and base is not None:
                    continue  # its work does not depend on the pool: measured once, at the smallest
                runs, got = [], pages
                for _ in range(args.runs):
                    r, got = fn()
                    runs.append(r)
                rows.append(summarize(name, runs, got, calls, ceil, base[0].outcomes if base else None))
                if name == "peer share-off":
                    base = (runs[0], rows[-1])
            for row in rows:
                ratio = statistics.median(row["rps"]) / statistics.median(base[1]["rps"])
                same = "ref" if row["same"] is None else f"{row['same']}/{row['n']}"
                print(f"{row['pages']:>6} {row['engine']:<14} {row['computed']:>9,} {row['reuse']:>6.1%} "
                      f"{row['of_ceiling']:>7.1%} {spread(row['p50'], '%.1f'):>20} {spread(row['p99'], '%.1f'):>20} "
                      f"{spread(row['rps'], '%.1f'):>18} {ratio:>9.2f}x {same:>8}")


if __name__ == "__main__":
    main()
