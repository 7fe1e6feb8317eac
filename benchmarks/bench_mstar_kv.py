"""What a decode step of M*'s node costs with mmcache under it, against M*'s own, as a user pays it.

    python benchmarks/bench_mstar_kv.py [--requests 256] [--runs 3] [--steps 64] [--pages 16,128]

Three of M*'s real ``Engine``s, each with M*'s real Orpheus LLM node (``OrpheusLLMSubmodule``, tiny random weights
loaded by M*'s own loader, ``workloads.peers.mstar_orpheus``), built as M*'s worker builds one: M*'s own specs (the
baseline), mmcache's ``ReuseKVManager`` with reuse off (its counted pool alone, no seam), and reuse on (one
``enable_reuse`` call: the KV spec and the seam on the node's ``prepare_inputs``/``declare_step``/``postprocess``).
Each serves ``--requests`` requests with distinct prompts (what is measured is the bookkeeping, not hits) whose
lengths are staggered over a page, so that pages fill at the steady-state rate from the first step (requests / page
size pages a step). Then ``--steps`` decode steps, one batch of every request each, as M*'s worker runs one:
``prepare_inputs`` (every request), ``exec_and_postprocess`` (declare, admit, plan, preprocess, forward, commit,
postprocess), ``finalize_batch``. Timed: that step's thread CPU time less the forward's (``Engine._forward``: the
model's GPU work in a deployment; here torch on the CPU with stand-in kernels, the same for every engine). The three
engines run each step in turn, the order rotating, so load on the machine reaches them alike; ``--runs`` fresh sets.

Per engine: the median and the mean step (ms, over every timed step of every run) and the best run's mean step; "vs
M*" is the median over steps of the step's time over M*'s own same step, p10-p90 of those ratios beside it, and
"mean vs M*" the ratio of the means: reuse on indexes the pages decode steps fill a few steps' worth at once
(``ReuseState.due_rows``), so its cost is in a few heavier steps that the median leaves out and the mean counts.
Only flashinfer's and the sampler's kernels are stood in (``workloads.peers.mstar_cpu_kernels``).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmcache.mstar.requirement import why_unavailable  # noqa: E402

SKIP = why_unavailable()
KINDS = ("M*'s own", "reuse off", "reuse on")


def build(kind: str, weights: Path, requests: int, page: int, longest: int):
    """An Orpheus engine of ``kind`` with room for every request's ``longest`` tokens; (engine, forward seconds
    counter) where the counter accumulates the thread CPU time spent in ``Engine._forward``."""
    from mstar.engine.resources.kv.config import KVSpec

    from mmcache.mstar import PrefixReuse
    from mmcache.mstar.kv_resource import ReuseKVSpec
    from workloads.peers import mstar_orpheus as orpheus
    from workloads.peers.mstar_engine import cpu_engine

    model = orpheus.orpheus_model(weights)
    if kind == "reuse off":  # mmcache's KV resource without reuse: the counted pool alone, no seam
        specs_of = model.get_node_resources
        model.get_node_resources = lambda: [ReuseKVSpec.of(s, None) if type(s) is KVSpec else s for s in specs_of()]
    pages = requests * -(-longest // page) + 16
    engine, _ = cpu_engine(model, [orpheus.LLM], pages=pages, page_size=page, dtype=torch.bfloat16,
                           kv_key=orpheus.KV_CACHE, rope_key=orpheus.ROPE, label=orpheus.LABEL,
                           reuse=PrefixReuse(model="orpheus-bench") if kind == "reuse on" else None)
    spent = [0]
    forward = engine._forward

    def timed_forward(*args, **kwargs):
        t = time.thread_time_ns()
        try:
            return forward(*args, **kwargs)
        finally:
            spent[0] += time.thread_time_ns() - t

    engine._forward = timed_forward
    return engine, spent


def batch(walk: str, feeds: dict[str, torch.Tensor]):
    """The batch M*'s worker hands the LLM node: every request's ids under ``text_inputs``."""
    from workloads.peers import mstar_orpheus as orpheus
    from workloads.peers.mstar_engine import ExecutingBatch, StepContext, fwd_info

    configs = orpheus.greedy()
    return ExecutingBatch(node_name=orpheus.LLM,
                          per_request_info={rid: fwd_info(rid, walk, configs) for rid in feeds},
                          per_request_input_tensors={rid: {"text_inputs": [ids]} for rid, ids in feeds.items()},
                          step_context=StepContext(request_ids=tuple(feeds), graph_walk=walk, slot=0, capture=False))


def step_ns(engine, spent, b) -> int:
    """One step of batch ``b`` as M*'s worker runs it; thread CPU ns outside the forward."""
    before, t = spent[0], time.thread_time_ns()
    engine.prepare_inputs(b)
    engine.exec_and_postprocess(b)
    engine.finalize_batch(b)
    return time.thread_time_ns() - t - (spent[0] - before)


def one_run(weights: Path, requests: int, page: int, steps: int, warm: int) -> dict[str, list[int]]:
    """Fresh engines of every kind; per kind, the ns of each timed decode step."""
    from workloads.peers import mstar_orpheus as orpheus

    longest = 2 * page + warm + steps + 1
    engines = {k: build(k, weights, requests, page, longest) for k in KINDS}
    rids = [f"r{i}" for i in range(requests)]
    g = torch.Generator().manual_seed(page)
    # prompts of page + 1 + i * page / requests tokens: request i's second page fills at step about (page - i * page /
    # requests), each a page the decode steps fill continuing its chain, as after a prompt of more than a page
    prompts = {rid: torch.randint(1, orpheus.CFG.vocab_size, (page + 1 + i * page // requests,), generator=g)
               for i, rid in enumerate(rids)}
    last = {}
    for kind, (engine, _) in engines.items():
        for rid in rids:
            engine.add_request(rid, orpheus.greedy())
        for lo in range(0, requests, 64):  # prefill in batches of 64 (untimed)
            part = {rid: prompts[rid] for rid in rids[lo:lo + 64]}
            b = batch("prefill", part)
            engine.prepare_inputs(b)
            engine.exec_and_postprocess(b)
            engine.finalize_batch(b)
            last.setdefault(kind, {}).update({rid: b.outputs[rid]["new_token"][0].reshape(1) for rid in part})
    times = {k: [] for k in KINDS}
    gc.collect()
    gc.freeze()  # the engines' long-lived objects: a full collection's pass over them would land on one engine's step
    for k in range(warm + steps):
        order = KINDS[k % 3:] + KINDS[:k % 3]
        for kind in order:
            engine, spent = engines[kind]
            b = batch("decode", last[kind])
            ns = step_ns(engine, spent, b)
            last[kind] = {rid: b.outputs[rid]["new_token"][0].reshape(1) for rid in rids}
            if k >= warm:
                times[kind].append(ns)
    gc.unfreeze()
    want = last["M*'s own"]
    assert all(torch.equal(last[k][r], want[r]) for k in KINDS for r in rids), "the engines sampled differently"
    return times


def table(weights: Path, requests: int, page: int, steps: int, runs: int) -> None:
    per_run = [one_run(weights, requests, page, steps, warm=8) for _ in range(runs)]
    base = [t for run in per_run for t in run["M*'s own"]]
    print(f"{f'M* Orpheus node, decode step, page {page}':<32} | {'median ms':>9} | {'mean ms':>7} | {'best run':>8} | "
          f"{'vs M*':>5} | {'p10-p90':>11} | {'mean vs M*':>10}")
    for kind in KINDS:
        mine = [t for run in per_run for t in run[kind]]
        ratios = sorted(m / b for m, b in zip(mine, base))
        best = min(statistics.fmean(run[kind]) for run in per_run)
        p10, p90 = ratios[len(ratios) // 10], ratios[(9 * len(ratios)) // 10]
        print(f"{kind:<32} | {statistics.median(mine) / 1e6:9.3f} | {statistics.fmean(mine) / 1e6:7.3f} | "
              f"{best / 1e6:8.3f} | {statistics.median(ratios):5.2f} | {p10:5.2f}-{p90:5.2f} | "
              f"{statistics.fmean(mine) / statistics.fmean(base):10.2f}")
    print(f"({requests} requests a step, page {page}, {requests / page:g} pages fill a step; {steps} timed steps x "
          f"{runs} runs; thread CPU time outside the forward. 'vs M*': the median of each step's time over M*'s own "
          f"same step; 'mean vs M*': the ratio of the means, which counts in full the steps where decode pages are "
          f"indexed, a few steps' worth at once)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--pages", default="16,128", help="page sizes, comma-separated")
    args = ap.parse_args()
    if SKIP is not None:
        print(f"bench_mstar_kv: skipped ({SKIP})")
        return
    from workloads.peers import mstar_orpheus as orpheus
    from workloads.peers.mstar_cpu_kernels import installed

    torch.set_num_threads(1)  # the timed work is the calling thread's; the forward is not timed
    print(f"{platform.node()}: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as folder, installed():
        weights = orpheus.save_weights(Path(folder))
        for page in (int(p) for p in args.pages.split(",")):
            table(weights, args.requests, page, args.steps, args.runs)


if __name__ == "__main__":
    main()
