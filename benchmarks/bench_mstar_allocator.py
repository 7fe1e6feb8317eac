"""Allocator work per decode step for a 256-request batch: M*'s PagedAllocationManager vs the drop-in, in one run.

Two tables, each row's ratio to M*'s manager measured in the same run, ms per step as the best of runs with the
spread over runs (max/min); rows are interleaved run by run so drift on the machine hits every row alike.

1. The allocator calls alone: per step what M*'s plan_attention does per request (get_state, alloc(seq_len + 1),
   read page_indices), then seq_len advances by one; one request in page_size crosses a page each step. Rows: M*'s
   manager, the drop-in with reuse on (per-request alloc), the drop-in's batched ``alloc_many``.
2. Inside M*'s real ``FlashInferCacheManager.plan_attention`` (decode: one new token per request, the flashinfer
   stand-in of tests/flashinfer_standin.py for the wrapper), a cache manager built per step as M*'s engine does and
   only ``plan_attention`` timed. Rows: over M*'s manager; over the drop-in (M*'s per-request ``alloc``); over the
   drop-in with the batched pre-allocation every step (``mmcache.mstar.cache_manager``), and as ``install`` sets it
   up (pre-allocating only when at least 1/8 of the requests can grow a page: with --page 16 a decode step stays
   per request, with --page 1 every step is batched); and a floor, the same plan over an allocator whose ``alloc``
   does nothing (the pages each step needs given before it is timed). "alloc ms" = row - floor: the allocator's
   share of a step, to read against the 0.1 ms target.

    python benchmarks/bench_mstar_allocator.py [--batch 256] [--steps 128] [--runs 7] [--page 16]
"""

import argparse
import sys
import time

import torch
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from mmcache.mstar.vendor import import_mstar  # noqa: E402

import_mstar()  # puts M* on sys.path
import flashinfer_standin  # noqa: E402
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



class _NoAlloc:
    """The floor: an ``alloc`` that does nothing, over states the benchmark gives exactly the pages each step needs
    before the step is timed (so the plan reads the same page lists as over a real allocator)."""

    def __init__(self, cfg):
        self.config, self.kv_cache, self.request_states, self._next = cfg, kv_tensor(cfg), {}, 0

    def add_request(self, rid, labels):
        from mstar.engine.kv_store import KVRequestState
        self.request_states[rid] = {label: KVRequestState() for label in labels}

    def get_state(self, rid, label):
        return self.request_states[rid][label]

    def give(self, state, seq_len):  # untimed: what alloc would have done
        need = -(-seq_len // self.config.page_size) - len(state.page_indices)
        state.page_indices.extend(range(self._next, self._next + max(need, 0)))
        self._next += max(need, 0)

    def alloc(self, rid, label, seq_len):
        pass


def plan_run(kind: str, batch: int, steps: int, page: int) -> float:
    """Seconds per ``plan_attention`` of a decode step over ``batch`` requests, averaged over ``steps`` steps."""
    from mstar.engine.cache_manager import WorkspaceBufferManager, create_cache_manager
    from mmcache.mstar.cache_manager import use_batched_planning
    cfg = config(max_num_pages=batch * (steps // page + 4), page_size=page)
    rids = [f"r{i}" for i in range(batch)]
    if kind == "floor":
        m = _NoAlloc(cfg)
    elif kind == "mstar":
        m = mstar_manager(cfg, kv_tensor(cfg), _Patch())
    else:
        m = dropin_manager(cfg, kv_tensor(cfg), reuse=True)
        if kind != "dropin":
            use_batched_planning(m.config)
    for i, rid in enumerate(rids):
        m.add_request(rid, ["main"])
        m.get_state(rid, "main").seq_len = 1 + i % page
        if kind == "floor":
            m.give(m.get_state(rid, "main"), 1 + i % page)
        else:
            m.alloc(rid, "main", 1 + i % page)
    states = [m.get_state(rid, "main") for rid in rids]
    buffers, cpu, ones, spent = WorkspaceBufferManager(1024, "cpu"), torch.device("cpu"), [1] * batch, 0.0
    for _ in range(steps):
        cm = create_cache_manager(request_ids=rids, active_labels_per_request=dict.fromkeys(rids, "main"),
                                  kv_cache=m.kv_cache, alloc_manager=m, buffer_manager=buffers,
                                  kv_cache_config=m.config, device=cpu)
        if kind == "batched":
            cm.min_growing_share = 0  # pre-allocate every step, whatever the share of requests that grow
        if kind == "floor":
            for s in states:
                m.give(s, s.seq_len + 1)
        t = time.perf_counter()
        cm.plan_attention(seq_lens=ones, dtype=torch.float32)
        spent += time.perf_counter() - t
        for s in states:
            s.seq_len += 1
    assert all(len(s.page_indices) * page >= s.seq_len for s in states)
    return spent / steps


def table(title, rows, times, base, floor=None):
    print(title)
    print(f"{'':<52}{'ms/step':>9}{'spread':>8}{'vs M*':>7}" + (f"{'alloc ms':>10}" if floor else ""))
    for k, name in rows.items():
        best = min(times[k])
        line = f"{name:<52}{best * 1e3:>9.3f}{max(times[k]) / best:>8.2f}{best / base:>7.2f}"
        if floor and k != "floor":
            line += f"{(best - floor) * 1e3:>10.3f}"
        print(line)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--page", type=int, default=16)
    a = ap.parse_args()
    sys.modules["flashinfer"] = flashinfer_standin.module()  # flashinfer has no CPU build
    kinds, plans = ("mstar", "dropin", "batched"), ("mstar", "dropin", "batched", "installed", "floor")
    times = {k: [] for k in kinds}
    ptimes = {k: [] for k in plans}
    for _ in range(a.runs):  # interleaved, so drift hits every row alike
        for k in kinds:
            times[k].append(run(k, a.batch, a.steps, a.page))
        for k in plans:
            ptimes[k].append(plan_run(k, a.batch, a.steps, a.page))
    print(f"{a.batch} requests per decode step, page {a.page}, {a.steps} steps per run, best of {a.runs} runs, "
          f"spread = max/min over runs")
    table("1. allocator calls alone (get_state + alloc + page_indices per request)",
          {"mstar": "M* PagedAllocationManager.alloc", "dropin": "drop-in alloc (reuse on)",
           "batched": "drop-in alloc_many (reuse on)"}, times, min(times["mstar"]))
    print()
    table("2. inside M*'s FlashInferCacheManager.plan_attention (flashinfer stand-in)",
          {"mstar": "M* plan_attention over M*'s manager", "dropin": "over the drop-in (per-request alloc)",
           "batched": "over the drop-in with the batched pre-allocation",
           "installed": "  as install() sets it (batched when >= 1/8 grow)", "floor": "floor: no-op allocator"},
          ptimes, min(ptimes["mstar"]), floor=min(ptimes["floor"]))


if __name__ == "__main__":
    main()
