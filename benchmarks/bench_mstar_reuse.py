"""Prefix reuse through M*'s real ``Engine`` with mmcache's KV resource, reuse on vs off in one run.

    python benchmarks/bench_mstar_reuse.py [--conversations 16] [--batch 8] [--decode 8] [--repeats 3]

The node is the tests' toy AR model (``tests/mstar_toy_ar.py``: M*'s ``KVManager``/``RopeManager`` under M*'s
``Engine``, attention computed densely, one query row at a time, so it is slow per token and every figure here is
about the cache, not the model), and for MT-Bench also M*'s real Orpheus LLM node
(``workloads/peers/mstar_orpheus.py``: its ``OrpheusLLMSubmodule`` and all its resources under M*'s ``Engine``, tiny
random weights through M*'s loader, bf16, flashinfer's kernels as torch stand-ins,
``workloads/peers/mstar_cpu_kernels.py``, whose attention also runs one query row at a time). The workloads, each
served with reuse off (M*'s own ``KVSpec``) and on (``ReuseKVSpec``, for Orpheus through ``enable_reuse``) on the
same batch schedule:

- MT-Bench two-turn conversations (``--data``, default the replays' data folder; an embedded two-turn stand-in
  without it, labelled as such): turn 1 of a batch of ``--batch`` conversations, then their turn 2, which re-sends
  turn 1 and its answer. Token ids are the Mistral tokenizer's, taken modulo the model's vocabulary.
- a burst of ``--batch`` requests behind one 512-token system prompt, the first admitted one step ahead of the rest
  (commit-as-written lets the rest hit what it wrote while it still runs).

Rows: prompt tokens computed (exact counts) and TTFT of the requests that could reuse (turn 2; the burst's followers),
median with the min-max over repeats.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from mmcache.mstar.requirement import why_unavailable  # noqa: E402
from workloads.registry import data_place  # noqa: E402

SKIP = why_unavailable()


def conversations(data: Path, n: int, vocab: int | None = None):
    """(label, [(turn 1 ids, turn 2 ids)]) from MT-Bench, or a stand-in; ids below ``vocab`` (default: the toy's)."""
    from mstar_toy_ar import V
    V = vocab or V
    folder = data / "mt-bench"
    if (folder / "question.jsonl").is_file():
        from workloads.traces.mt_bench import load_mt_bench
        trace = load_mt_bench(folder, limit=n)
        label = f"MT-Bench ({folder})"
    else:
        trace, label = None, "embedded stand-in (no MT-Bench data): two-turn random prompts"
    out = []
    if trace is not None:
        for s in trace.sessions:
            t1, t2 = s.build(0), s.build(1)
            ids1 = [int(x) % V for x in t1.token_ids]
            ids2 = [int(x) % V for x in t2.token_ids]
            out.append((ids1, ids2))
    else:
        import random
        rng = random.Random(0)
        for _ in range(n):
            a = [rng.randrange(V) for _ in range(rng.randrange(40, 120))]
            b = a + [rng.randrange(V) for _ in range(rng.randrange(60, 160))]
            out.append((a, b))
    return label, out


def serve_batch(engine, prompts: dict[str, list[int]], decode: int, arrival: float) -> dict[str, float]:
    """Prefill ``prompts`` in one batch, decode ``decode`` steps; returns rid -> TTFT (from ``arrival``)."""
    from mstar_toy_ar import engine_step
    for rid in prompts:
        engine.add_request(rid)
    logits = engine_step(engine, "prefill", prompts)
    ttft = {rid: time.perf_counter() - arrival for rid in prompts}
    for _ in range(decode):
        logits = engine_step(engine, "decode", {rid: [int(lg.argmax())] for rid, lg in logits.items()})
    for rid in prompts:
        engine.remove_request(rid)
    return ttft


def run_mt_bench(reuse, convs, batch: int, decode: int):
    from mstar_toy_ar import PrefixReuse, engine_node, weights
    engine, node = engine_node(weights(), pages=4096, reuse=PrefixReuse(model="toy@0") if reuse else None)
    ttfts = []
    for i in range(0, len(convs), batch):
        group = convs[i:i + batch]
        serve_batch(engine, {f"c{i + j}-1": c[0] for j, c in enumerate(group)}, decode, time.perf_counter())
        t2 = {f"c{i + j}-2": c[1] for j, c in enumerate(group)}
        ttfts += serve_batch(engine, t2, decode, time.perf_counter()).values()
    return node.fed, ttfts


def run_mt_bench_orpheus(reuse, convs, batch: int, decode: int, weights: Path):
    """``run_mt_bench`` on M*'s Orpheus LLM node (page size 4, as the toy's): (prompt tokens its forward computed,
    turn-2 TTFTs)."""

    from workloads.peers.mstar_cpu_kernels import installed
    from workloads.peers.mstar_orpheus import PrefixReuse, engine_step, greedy, orpheus_engine

    def serve(oe, sampled, prompts, arrival):
        for rid in prompts:
            oe.engine.add_request(rid, greedy())
        got = engine_step(oe, "prefill", prompts, sampled)
        fed, ttft = oe.embedded[-1], {rid: time.perf_counter() - arrival for rid in prompts}
        for _ in range(decode):
            got = engine_step(oe, "decode", {rid: [tok] for rid, (tok, _) in got.items()}, sampled)
        for rid in prompts:
            oe.engine.remove_request(rid)
        return fed, ttft

    with installed() as sampled:  # keeps the tokens only: no logits copied inside the timing
        oe = orpheus_engine(weights, reuse=PrefixReuse(model="orpheus-tiny@bench") if reuse else None, pages=4096)
        fed, ttfts = 0, []
        for i in range(0, len(convs), batch):
            group = convs[i:i + batch]
            fed += serve(oe, sampled, {f"c{i + j}-1": c[0] for j, c in enumerate(group)}, time.perf_counter())[0]
            n, ttft = serve(oe, sampled, {f"c{i + j}-2": c[1] for j, c in enumerate(group)}, time.perf_counter())
            fed, ttfts = fed + n, ttfts + list(ttft.values())
        return fed, ttfts


def run_burst(reuse, batch: int, decode: int):
    import random

    from mstar_toy_ar import PrefixReuse, V, engine_node, engine_step, weights
    rng = random.Random(1)
    system = [rng.randrange(V) for _ in range(512)]
    prompts = {f"b{j}": system + [rng.randrange(V) for _ in range(32)] for j in range(batch)}
    engine, node = engine_node(weights(), pages=4096, reuse=PrefixReuse(model="toy@0") if reuse else None)
    first, rest = "b0", {r: p for r, p in prompts.items() if r != "b0"}
    engine.add_request(first)
    engine_step(engine, "prefill", {first: prompts[first]})          # the first is prefilled, still running
    ttft = serve_batch(engine, rest, decode, time.perf_counter())
    engine_step(engine, "decode", {first: [1]})
    engine.remove_request(first)
    return node.fed, list(ttft.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", type=Path, default=data_place()[0])
    args = ap.parse_args()
    if SKIP is not None:
        print(f"bench_mstar_reuse: skipped ({SKIP})")
        return
    import torch
    torch.set_num_threads(1)
    import logging
    import tempfile

    import transformers

    from workloads.peers.mstar_orpheus import CFG, save_weights
    logging.getLogger("mstar").setLevel(logging.ERROR)  # "no CUDA, no graph capture", the loader's hub lookup
    transformers.utils.logging.disable_progress_bar()
    label, convs = conversations(args.data, args.conversations)
    convs_orpheus = conversations(args.data, args.conversations, vocab=CFG.vocab_size)[1]
    folder = tempfile.TemporaryDirectory(prefix="bench-orpheus-")
    weights = save_weights(Path(folder.name))
    print(f"MT-Bench: {label}; {len(convs)} conversations in batches of {args.batch}, {args.decode} decode steps")
    print(f"{'workload':<34} {'reuse':<5} | {'prompt tokens computed':>22} | {'vs off':>6} | "
          f"{'TTFT ms (median, min-max over repeats)':>40}")
    for name, run in (("MT-Bench turn 2", lambda r: run_mt_bench(r, convs, args.batch, args.decode)),
                      ("MT-Bench turn 2, M*'s Orpheus LLM",
                       lambda r: run_mt_bench_orpheus(r, convs_orpheus, args.batch, args.decode, weights)),
                      (f"burst of {args.batch}, 512-token system", lambda r: run_burst(r, args.batch, args.decode))):
        rows = {}
        for _ in range(args.repeats):
            for reuse in (False, True):
                fed, ttft = run(reuse)
                rows.setdefault(reuse, []).append((fed, statistics.median(ttft)))
        base = rows[False][0][0]
        for reuse in (False, True):
            fed = rows[reuse][0][0]
            t = [x[1] * 1e3 for x in rows[reuse]]
            print(f"{name:<34} {'on' if reuse else 'off':<5} | {fed:>22} | {fed / base:6.2f} | "
                  f"{statistics.median(t):>20.1f} ({min(t):.1f}-{max(t):.1f})")
    print(f"({sys.platform}, 1 thread; toy AR model: dense attention per query row, float64; Orpheus LLM: "
          f"{CFG.num_hidden_layers} layers, hidden {CFG.hidden_size}, bf16, torch stand-ins for flashinfer's kernels)")


if __name__ == "__main__":
    main()
