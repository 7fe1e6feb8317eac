"""Prefix reuse through M*'s KVCacheEngine on a two-turn trace (mt-bench question.jsonl), tiny AR model on the CPU.

Each conversation's turn 2 re-sends turn 1's prompt and answer, then its second question. Conversations run in
batches of ``--batch`` through ``KVCacheEngine.execute_batch`` (one prefill step per turn, then greedy decode);
turn 2 starts after every turn 1 of its batch has finished. Rows, in one run on the same trace and schedule:
- M*'s own PagedAllocationManager (reuse off): the baseline;
- the drop-in with reuse off (its overhead vs M*);
- the drop-in with reuse on (turn 2 matches turn 1's prompt and generated pages).
Columns: prefill tokens computed, turn-2 TTFT (the wall time of the batch's prefill step, best of runs), the whole
trace's wall time, each as a ratio to M*'s row, and the spread over runs (max/min). Token ids are the text's bytes
mod the tiny vocabulary (no tokenizer: the tiny model has none).

    python benchmarks/bench_mstar_reuse.py [--conversations 32] [--batch 8] [--decode 16] [--runs 5]
"""

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import mmcache.mstar  # noqa: E402,F401  (puts M* on sys.path)
import flashinfer_standin  # noqa: E402
from mstar.engine import kv_store  # noqa: E402
from mmcache.mstar.allocator import CPUKVTransferEngine  # noqa: E402
from mstar_tiny_ar import P, V, TinyAR, engine, step  # noqa: E402
from workloads.traces.jsonl import read_jsonl  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "mt-bench" / "question.jsonl"
SYSTEM = "You are a helpful assistant. Answer carefully and concisely. "


def ids(text: str) -> list[int]:
    return [b % V for b in text.encode()]


def run(kind: str, convs: list[list[str]], batch: int, decode: int) -> tuple[int, float, float]:
    """(prefill tokens computed, mean turn-2 TTFT seconds, trace wall seconds) for one allocator kind."""
    pages = batch * (-(-max(len(ids(SYSTEM + " ".join(t))) for t in convs) // P) + 2 * decode // P + 4) * 3
    eng, sub = engine(TinyAR(), reuse=(kind == "reuse"), drop_in=(kind != "mstar"), pages=pages)
    computed, ttft2, start = 0, [], time.perf_counter()
    for b in range(0, len(convs), batch):
        group = {f"c{b + i}": turns for i, turns in enumerate(convs[b:b + batch])}
        history = {rid: ids(SYSTEM) for rid in group}
        for turn in range(2):
            prompts = {f"{rid}.{turn}": history[rid] + ids(t[turn]) for rid, t in group.items()}
            for rid in prompts:
                eng.add_request(rid, ["main"])
            t0 = time.perf_counter()
            nxt = step(eng, prompts)
            if turn:
                ttft2.append(time.perf_counter() - t0)
            computed += sum(len(p) - sub.matched.get(rid, 0) for rid, p in prompts.items())
            out = {rid: [] for rid in prompts}
            for _ in range(decode):
                for rid, t in nxt.items():
                    out[rid].append(t)
                nxt = step(eng, {rid: [t] for rid, t in nxt.items()})
            for rid in prompts:
                eng.remove_request(rid)
                history[rid.split(".")[0]] = prompts[rid] + out[rid]
    return computed, sum(ttft2) / len(ttft2), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", "User provided device_type of 'cuda'")  # M* autocasts "cuda" on any device
    sys.modules["flashinfer"] = flashinfer_standin.module()
    kv_store.CudaIpcKVTransferEngine = lambda kv, max_workers=3: CPUKVTransferEngine(kv)  # this process only
    convs = [q["turns"] for _, q in read_jsonl(DATA)][:args.conversations]
    kinds = ("mstar", "dropin", "reuse")
    results = {k: [] for k in kinds}
    for k in kinds:  # warm-up, discarded: first-call costs (imports, allocator start-up) hit whichever row ran first
        run(k, convs[:args.batch], args.batch, 2)
    for _ in range(args.runs):
        for k in kinds:  # interleaved, so drift on a shared machine hits every row alike
            results[k].append(run(k, convs, args.batch, args.decode))
    base = results["mstar"]
    print(f"{len(convs)} two-turn mt-bench conversations, batch {args.batch}, decode {args.decode}, page {P}, "
          f"{args.runs} runs (best; spread = max/min)")
    print(f"{'allocator':<22}{'prefill tok':>12}{'vs M*':>7}{'TTFT2 ms':>10}{'vs M*':>7}{'spread':>8}"
          f"{'trace s':>9}{'vs M*':>7}{'spread':>8}")
    for k, label in zip(kinds, ("M* manager", "drop-in, reuse off", "drop-in, reuse on")):
        tok = results[k][0][0]
        t2 = [r[1] for r in results[k]]
        wall = [r[2] for r in results[k]]
        b2, bw = min(r[1] for r in base), min(r[2] for r in base)
        print(f"{label:<22}{tok:>12}{tok / base[0][0]:>7.2f}{min(t2) * 1e3:>10.2f}{min(t2) / b2:>7.2f}"
              f"{max(t2) / min(t2):>8.2f}{min(wall):>9.2f}{min(wall) / bw:>7.2f}{max(wall) / min(wall):>8.2f}")


if __name__ == "__main__":
    main()
