"""Per-step cost of M*'s KV resource with mmcache under it vs M*'s own ``KVManager``, in one run.

    python benchmarks/bench_mstar_kv.py [--requests 256] [--repeats 7] [--pages 16,128]

Both resources are built by M*'s ``build_resource`` and driven by M*'s ``StepRunner`` (admit, plan, commit) for decode
steps of ``--requests`` requests, one token each, after a prefill of 64 tokens per request, for two pages' worth of
decode steps (every request fills two pages), at each page size of ``--pages`` (16: a page fills every 16 steps; 128:
M*'s default ``KVConfig.page_size``). Rows: M*'s ``KVManager`` (the baseline), ``ReuseKVManager`` with reuse off (the
counted pool alone), and with reuse on (plus the seam's ``feed_rows`` of the step's tokens, each request's a
one-element view of the step's sampled tokens as M*'s nodes return them, and commit-as-written indexing the pages
that fill). The forward is not run: what is timed is the resource's own work. ms per step, best of
repeats, spread = max/min over repeats; rows are interleaved repeat by repeat so load on the machine hits every row
alike. A last row times, alone, what any resource that names the decoded ids must do with what M* 0.2.1 hands it:
join the step's one-element id tensors (one per request) into ints (``torch.cat``, ``tolist``); it is part of the
reuse-on row.

A second table times the seam itself (``mmcache.mstar.switch``): a decode step's ``prepare_inputs`` (one token) for
every request and its ``declare_step``, bare and with the seam on them (which feeds the step's tokens through
``feed_rows`` when it is declared), on the toy AR node of the tests (``tests/mstar_toy_ar.py``), per request, best
of repeats.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the toy AR node
from mmcache.mstar.requirement import why_unavailable  # noqa: E402

SKIP = why_unavailable()
if SKIP is None:
    from mstar.communication.tensors import LocalTransferEngine
    from mstar.engine.resources import KVConfig, KVSpec, KVStep, Segment, StepContext, StepRunner, SubmoduleStep
    from mstar.engine.resources.base import EngineResourceInfo, build_resource
    from mstar.engine.resources.kv.transfer import TransferEngineInfo

    from mmcache.mstar.kv_resource import PrefixReuse, ReuseKVSpec

PROMPT = 64


def build(kind: str, requests: int, page: int, steps: int):
    pages = requests * (-(-(PROMPT + steps + 1) // page)) + 16
    cfg = KVConfig(num_layers=2, num_kv_heads=2, head_dim=16, max_seq_len=pages * page, max_num_pages=pages,
                   page_size=page)
    spec = KVSpec(resource_key="kv", nodes={"n"}, config=cfg)
    if kind != "mstar":
        spec = ReuseKVSpec.of(spec, PrefixReuse(model="bench") if kind == "reuse on" else None)
    info = EngineResourceInfo(device=torch.device("cpu"), kv_dtype=torch.float16,
                              transfer_engine_info=TransferEngineInfo("e", "s", LocalTransferEngine("h")))
    kv = build_resource(spec, info)
    return kv, StepRunner({"kv": kv})


def run_step(runner, rids, span: int) -> None:
    s = SubmoduleStep(segments=[Segment(rid, "main", span) for rid in rids], steps={"kv": KVStep()})
    s.set_ctx(StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False))
    assert runner.admit(s).ok
    runner.plan(s)
    runner.commit(s)


def once(kind: str, requests: int, page: int, steps: int) -> float:
    gc.collect()  # the last run's garbage is collected here, not inside this run's timing
    kv, runner = build(kind, requests, page, steps)
    rids = [f"r{i}" for i in range(requests)]
    reuse = kind == "reuse on"
    for i, rid in enumerate(rids):
        runner.ingest_request(rid)
        if reuse:  # distinct prompts: what is measured is the bookkeeping, not hits
            kv.feed(rid, "main", torch.arange(PROMPT) + i * PROMPT)
    run_step(runner, rids, PROMPT)
    spent = 0.0
    for k in range(steps):
        # what the seam hands the resource for a decode step: every request's one id, at once, each a one-element
        # view of the step's sampled tokens (as M*'s nodes return them, ``new_tokens[i : i + 1]``); made untimed
        sampled = torch.arange(requests) + k
        rows = {rid: sampled[i:i + 1] for i, rid in enumerate(rids)} if reuse else None
        t = time.perf_counter()
        if reuse:
            kv.feed_rows("main", rows)
        run_step(runner, rids, 1)
        spent += time.perf_counter() - t
    return spent / steps


def seam_us(reuse: bool, requests: int, repeats: int) -> float:
    """Microseconds per request of a decode step's ``prepare_inputs`` of every request and its ``declare_step`` on the
    toy node, with or without the seam (which feeds the step's one-row feeds when it is declared)."""
    from mstar_toy_ar import KV, ROPE, fwd_info, ids_feed, node, step, weights

    n = node(weights(), pages=requests * 4, reuse=PrefixReuse(model="bench") if reuse else None)
    rids = [f"r{i}" for i in range(requests)]
    for i, rid in enumerate(rids):
        n.runner.ingest_request(rid)
        step(n, "prefill", {rid: ids_feed(range(1 + i, 9 + i))})
    resources, infos, feed = {KV: n.kv, ROPE: n.rope}, {rid: fwd_info(rid) for rid in rids}, ids_feed([5])
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        outs = [n.sub.prepare_inputs(graph_walk="decode", fwd_info=infos[rid], inputs=feed, resources=resources)
                for rid in rids]
        n.sub.declare_step("decode", rids, outs)
        best = min(best, time.perf_counter() - t)
    return best / requests * 1e6


def join_ms(requests: int, repeats: int) -> float:
    """ms to join one decode step's ids as M* 0.2.1 hands them to a node (one one-element tensor per request)."""
    sampled = torch.arange(requests)
    ids = [sampled[i:i + 1] for i in range(requests)]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.cat(ids).tolist()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def page_table(requests: int, page: int, repeats: int) -> None:
    steps = 2 * page  # every request fills two pages
    kinds = ("mstar", "reuse off", "reuse on")
    times = {k: [] for k in kinds}
    for k in kinds:  # warm-up, not counted: each kind's first run pays one-time costs (up to 8x its best)
        once(k, requests, page, 4)
    for _ in range(repeats):
        for k in kinds:
            times[k].append(once(k, requests, page, steps))
    base = min(times["mstar"])
    print(f"{f'KV resource (StepRunner, decode), page {page}':<44} | {'ms/step':>8} | {'vs M*':>6} | {'spread':>6}")
    names = {"mstar": "M*'s KVManager", "reuse off": "ReuseKVManager, reuse off",
             "reuse on": "ReuseKVManager, reuse on"}
    for k in kinds:
        best = min(times[k])
        print(f"{names[k]:<44} | {best * 1e3:8.3f} | {best / base:6.2f} | {max(times[k]) / best:6.2f}")
    join = join_ms(requests, 50 * repeats)
    print(f"{'  of which: the step ids joined (cat, tolist)':<44} | {join:8.3f} | {join / (base * 1e3):6.2f} |")
    print(f"({requests} requests per step, page {page}, {steps} decode steps after a {PROMPT}-token prefill, best of "
          f"{repeats}; {sys.platform}, {torch.get_num_threads()} threads)\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--pages", default="16,128", help="page sizes, comma-separated")
    args = ap.parse_args()
    if SKIP is not None:
        print(f"bench_mstar_kv: skipped ({SKIP})")
        return
    for page in (int(p) for p in args.pages.split(",")):
        page_table(args.requests, page, args.repeats)
    bare, seam = (seam_us(r, 64, 30 * args.repeats) for r in (False, True))  # 64: the toy vocabulary is 128
    print(f"{'prepare_inputs + declare_step, decode (toy node)':<44} | {'us/request':>10} | {'vs bare':>7}")
    print(f"{'bare':<44} | {bare:10.2f} | {1:7.2f}")
    print(f"{'with the seam (feed included)':<44} | {seam:10.2f} | {seam / bare:7.2f}")


if __name__ == "__main__":
    main()
