"""What keeping Qwen3-Omni's thinker states beside the KV pages costs (``PrefixReuse.row_outputs``,
``mmcache.mstar.row_outputs``), in one run.

    python benchmarks/bench_mstar_qwen3_omni_rows.py [--requests 4] [--prompt 32] [--decode 16] [--repeats 5]

1. Memory, from the configs: side bytes per row (``thinker_states``: 2 x hidden, bf16) against KV bytes per row
   (K and V of every layer, bf16) for Qwen3-Omni-30B-A3B as the published checkpoint has it (48 layers, 4 KV heads,
   head_dim 128, hidden 2048) and as M*'s ``ThinkerTextConfig`` / transformers' ``Qwen3OmniMoeConfig`` default it
   (28 layers).
2. Per step, the tiny thinker under M*'s real ``Engine`` on CPU (``workloads/peers/mstar_qwen3_omni.py``): a batched
   text prefill of ``--requests`` requests of ``--prompt`` ids (no two alike, so nothing is reused), then
   ``--decode`` batched decode steps, for reuse off, reuse on without row outputs, and reuse on with them (the
   forward hook and the commit's write of every row): ms per step, best of repeats, interleaved repeat by repeat.
3. ``SideRows.write`` alone at Qwen3-Omni's width (4096 bf16 per row, page 16) on this machine's CPU, for a decode
   step of 32 requests and a prefill chunk of 2048 rows: us per write, against the baseline measured in the same run
   (interleaved with it): a plain copy of the same rows' bytes into one contiguous block, and the ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import best  # noqa: E402
from mmcache.mstar.requirement import why_unavailable  # noqa: E402

SKIP = why_unavailable()
# Qwen3-Omni-30B-A3B's thinker: the checkpoint's text config, and the config classes' defaults
CONFIGS = {"checkpoint (48 layers)": dict(layers=48, kv_heads=4, head_dim=128, hidden=2048),
           "config defaults (28 layers)": dict(layers=28, kv_heads=4, head_dim=128, hidden=2048)}


def memory_table() -> list[str]:
    rows = ["| thinker | KV bytes/row | side bytes/row | side / KV |", "|---|---:|---:|---:|"]
    for name, c in CONFIGS.items():
        kv = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * 2
        side = 2 * c["hidden"] * 2
        rows.append(f"| {name} | {kv:,} | {side:,} | {side / kv:.1%} |")
    return rows


def step_table(requests: int, prompt: int, decode: int, repeats: int) -> list[str]:
    from workloads.peers import mstar_cpu_kernels as kernels

    with kernels.installed(keep_logits=True) as sampled:
        from workloads.peers import mstar_qwen3_omni as q

        torch.set_num_threads(1)
        weights = q.save_weights(Path(tempfile.mkdtemp()))
        pages = requests * (-(-(prompt + decode + 2) // 4)) * 2 + 8
        kinds = {"reuse off": None, "reuse on, no row outputs": dataclasses.replace(q.thinker_reuse(),
                                                                                    row_outputs=None),
                 "reuse on, row outputs kept": q.thinker_reuse()}
        engines = {k: q.thinker_engine(weights, reuse=r, pages=pages) for k, r in kinds.items()}
        times = {k: {"prefill": [], "decode": []} for k in kinds}
        gen = torch.Generator().manual_seed(0)
        for rep in range(repeats + 1):  # the first: a warm-up, not counted
            prompts = {f"r{rep}-{i}": torch.randint(1, 300, (prompt,), generator=gen) for i in range(requests)}
            for kind, te in engines.items():
                gc.collect()
                for rid in prompts:
                    te.engine.add_request(rid, q.greedy())
                t = best(lambda: q.walk(te, q.TEXT, prompts, sampled, last_prefill=True), 1)
                tokens = {rid: torch.tensor([1]) for rid in prompts}
                d = best(lambda: q.walk(te, q.DECODE, tokens, sampled), 1) if decode else 0.0
                ds = [best(lambda: q.walk(te, q.DECODE, tokens, sampled), 1) for _ in range(decode - 1)]
                for rid in prompts:
                    te.engine.remove_request(rid)
                if rep:
                    times[kind]["prefill"].append(t)
                    times[kind]["decode"].append(min([d, *ds]))
    rows = [f"| {requests} requests | prefill of {prompt} ids, ms | decode step, ms |", "|---|---:|---:|"]
    for kind, t in times.items():
        rows.append(f"| {kind} | {min(t['prefill']) * 1e3:.3f} | {min(t['decode']) * 1e3:.3f} |")
    return rows


def write_table(repeats: int) -> list[str]:
    from mmcache.mstar.row_outputs import RowOutputs, SideRows

    spec = RowOutputs(width=4096, dtype=torch.bfloat16, watch=None, needed=None, keep=None, restore=None)
    side = SideRows(num_pages=1024, page_size=16, spec=spec, device=torch.device("cpu"))  # 128 MiB
    plain = torch.empty(2048, 4096, dtype=torch.bfloat16)  # the baseline's destination
    rows = ["| rows in the step | segments | us per write | plain copy of the same rows, us | write / copy |",
            "|---:|---:|---:|---:|---:|"]
    for n_rows, segments in ((32, 32), (2048, 1), (2048, 4)):
        each = n_rows // segments
        parts = (torch.randn(n_rows, 2048).to(torch.bfloat16), torch.randn(n_rows, 2048).to(torch.bfloat16))
        n = -(-(37 + each) // 16)  # pages a stream at position 37 needs for ``each`` more rows
        spans = [(list(range(1 + s * n, 1 + (s + 1) * n)), 37, each, s * each) for s in range(segments)]

        def copy(parts=parts, n_rows=n_rows):  # the same bytes into one contiguous block: no index, no scatter
            plain[:n_rows, :2048].copy_(parts[0])
            plain[:n_rows, 2048:].copy_(parts[1])

        times = {"write": [], "copy": []}
        for _ in range(repeats):  # interleaved, the best of each: the machine's load moves both
            times["write"].append(best(lambda: side.write(spans, parts), 1, inner=20))
            times["copy"].append(best(copy, 1, inner=20))
        t, base = min(times["write"]), min(times["copy"])
        rows.append(f"| {n_rows} | {segments} | {t * 1e6:.1f} | {base * 1e6:.1f} | {t / base:.1f}x |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("\n".join(memory_table()), end="\n\n")
    if SKIP is not None:
        print(f"skipped the M* tables: {SKIP}")
        return
    print("\n".join(step_table(args.requests, args.prompt, args.decode, args.repeats)), end="\n\n")
    print("\n".join(write_table(args.repeats)))


if __name__ == "__main__":
    main()
