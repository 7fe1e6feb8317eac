"""Where a replay's wall time goes under transformers' continuous-batching engine, with its own prefix sharing and with
mmcache's allocator under it, in one run: inside the model's forward and outside it (scheduling, the cache's
bookkeeping, the replay loop), and mmcache's evictions.

    python benchmarks/bench_cb_forward_split.py [--runs 5] [--trace mooncake] [--inflight 1] [--pages 599]

``bench_peer_transformers.py`` reports requests per second, whose spread on this shared 2-core machine is as wide as
the difference between the engines; this splits the same replay (same model, requests and order) so a difference
shows where it lies: the forwards (their number and their time, from hooks on the model) or the rest. The engines
take turns within each repetition; median and min-max over ``--runs``. For mmcache, the evictions its allocations
made (``mmcache.reclaim.reclaim`` calls that evicted) and the time one took, median over the runs.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer_transformers as peer  # noqa: E402  (beside this script)


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):8.1f} ({min(xs):.1f}-{max(xs):.1f})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trace", default="mooncake", help="mt-bench, sharegpt, swe-agent or mooncake")
    ap.add_argument("--inflight", type=int, default=1)
    ap.add_argument("--pages", type=int, default=599, help="the engine's pool, in blocks")
    ap.add_argument("--model", choices=("tiny", "bigger"), default="tiny")
    args = ap.parse_args(argv)
    opts = peer.parser().parse_args(["--model", args.model])  # the replay's defaults
    if problem := peer.missing_data([args.trace]):
        sys.exit(f"bench_cb_forward_split: {problem}")
    torch.set_num_threads(opts.threads)
    model = peer.load_model(opts.model, opts.model_dir)
    calls = peer.load_calls(args.trace, opts)

    forward = {"n": 0, "s": 0.0, "t0": 0.0}

    def before(module, a, k):
        forward["t0"] = time.perf_counter()

    def after(module, a, k, out):
        forward["n"] += 1
        forward["s"] += time.perf_counter() - forward["t0"]

    hooks = (model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True))
    import mmcache.reclaim as reclaim_module

    evictions: list[float] = []
    reclaim = reclaim_module.reclaim

    @functools.wraps(reclaim)
    def timed_reclaim(*a, **k):
        t = time.perf_counter()
        n = reclaim(*a, **k)
        if n:
            evictions.append(time.perf_counter() - t)
        return n

    reclaim_module.reclaim = timed_reclaim  # make_room calls it through the module
    peer.run_peer(model, calls[:5], share=True, pages=args.pages, args=opts, inflight=args.inflight)  # warm-up
    rows = {"peer share-on": [], "mmcache in peer": []}
    for _ in range(args.runs):
        for name in rows:
            forward.update(n=0, s=0.0)
            evictions.clear()
            run, _ = peer.run_peer(model, calls, share=True, pages=args.pages, args=opts, inflight=args.inflight,
                                   mmcache=name == "mmcache in peer")
            rows[name].append((run.wall_s * 1e3, forward["n"], forward["s"] * 1e3, len(evictions),
                               statistics.median(evictions) * 1e6 if evictions else 0.0))
    for h in hooks:
        h.remove()
    print(f"# {args.trace}, {len(calls)} requests, {args.inflight} in flight, {args.pages} blocks, model {args.model}; "
          f"ms per replay, median (min-max) of {args.runs}; torch threads {torch.get_num_threads()}")
    print(f"{'engine':<16} {'wall ms':>22} {'forwards':>8} {'in forward ms':>22} {'outside ms':>22} "
          f"{'evictions':>9} {'us each':>8}")
    for name, got in rows.items():
        wall, n, inside, ev, ev_us = zip(*got)
        outside = [w - i for w, i in zip(wall, inside)]
        print(f"{name:<16} {spread(list(wall)):>22} {statistics.median(n):8.0f} {spread(list(inside)):>22} "
              f"{spread(outside):>22} {statistics.median(ev):9.0f} {statistics.median(ev_us):8.1f}")


if __name__ == "__main__":
    main()
