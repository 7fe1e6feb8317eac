"""Allocator work per decode step for a 256-request batch: M*'s PagedAllocationManager vs the drop-in, in one run.

Each step does what M*'s plan_attention does per request (get_state, alloc(seq_len + 1), read page_indices) and then
advances seq_len by one; one request in page_size crosses a page each step. Rows: M*'s manager (per-request alloc),
the drop-in with reuse on (per-request alloc, as M*'s cache manager calls it unchanged), and the drop-in's batched
``alloc_many`` (one lock hold and one pool take per step). Prints ms per step (best of runs) with the spread over
runs (max/min), and each row's ratio to M*'s in the same run.

    python benchmarks/bench_mstar_allocator.py [--batch 256] [--steps 128] [--runs 7]
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mmcache.mstar.vendor import import_mstar  # noqa: E402

import_mstar()  # puts M* on sys.path
from mstar_helpers import config, dropin_manager, kv_tensor, mstar_manager  # noqa: E402


class _Patch:  # mstar_manager wants pytest's monkeypatch; a benchmark sets the attribute for its own process
    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def run(kind: str, batch: int, steps: int, page: int) -> float:
    cfg = config(max_num_pages=batch * (steps // page + 4), page_size=page)
    kv = kv_tensor(cfg)
    m = mstar_manager(cfg, kv, _Patch()) if kind == "mstar" else dropin_manager(cfg, kv, reuse=True)
    rids = [f"r{i}" for i in range(batch)]
    for i, rid in enumerate(rids):
        m.add_request(rid, ["main"])
        m.alloc(rid, "main", 1 + i % page)
        m.get_state(rid, "main").seq_len = 1 + i % page
    t = time.perf_counter()
    for _ in range(steps):
        states = [m.get_state(rid, "main") for rid in rids]
        if kind == "batched":
            m.alloc_many(rids, "main", [s.seq_len + 1 for s in states])
        else:
            for rid, s in zip(rids, states):
                m.alloc(rid, "main", s.seq_len + 1)
        pages = [s.page_indices for s in states]
        for s in states:
            s.seq_len += 1
    per_step = (time.perf_counter() - t) / steps
    assert len(pages) == batch
    return per_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    kinds = ("mstar", "dropin", "batched")
    times = {k: [] for k in kinds}
    for _ in range(a.runs):
        for k in kinds:  # interleaved, so drift hits every row alike
            times[k].append(run(k, a.batch, a.steps, a.page))
    base = min(times["mstar"])
    print(f"allocator work per decode step, {a.batch} requests, page {a.page}, best of {a.runs} runs")
    print(f"{'manager':<34}{'ms/step':>9}{'spread':>8}{'vs M*':>8}")
    names = {"mstar": "M* PagedAllocationManager.alloc", "dropin": "drop-in alloc (reuse on)",
             "batched": "drop-in alloc_many (reuse on)"}
    for k in kinds:
        best = min(times[k])
        print(f"{names[k]:<34}{best * 1e3:>9.3f}{max(times[k]) / best:>8.2f}{best / base:>8.2f}")


if __name__ == "__main__":
    main()
