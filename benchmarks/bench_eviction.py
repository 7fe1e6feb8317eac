"""Eviction policies against the offline optimum on the same calls: realized reuse per pool size, per trace.

Each trace is replayed (``workloads.sizing.sweep.run_sweep``) once per policy at every pool size, and once under the
offline optimum (Belady on the lookups the ceiling recorded). Printed per row: each policy's realized reuse, the
optimum's, and the share of the gap between ``lru`` and the optimum that each policy closes ("closed"; negative: below
``lru``). Needs ../shared/data (the traces are read from there).

    python benchmarks/bench_eviction.py                                  # every trace, its knee sizes
    python benchmarks/bench_eviction.py --traces mooncake --pools 1M,4M

Traces: the Mooncake conversation trace with its timestamps; the 100 mini-swe-agent sessions round-robin, 8 in
flight; MT-Bench's two-turn chats; vlm-chat's image chats and voice-clone's voice sessions (the replica replay's media
traces; prefix pages only here, their encoder outputs are in ``bench_mixed_pool.py``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from mmcache.eviction import POLICIES
from workloads.sizes import format_size, parse_sizes
from workloads.sizing.sweep import run_sweep

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# trace: (loader, page size, order, in flight, pool sizes at and around the knee)
TRACES = {
    "mooncake": ("mooncake/conversation_trace.jsonl", 512, "timestamp", 8, "512k,1M,2M,4M,8M"),
    "agent": ("mini-swe-agent/trajs", 128, "round-robin", 8, "32k,64k,96k,128k,192k,256k"),
    "mt-bench": ("mt-bench", 16, "timestamp", 8, "4k,8k,10k,12k,14k,20k,24k"),
    "image-chats": ("mmmu", 128, "timestamp", 8, "32k,48k,64k,96k,128k"),  # vlm-chat's sessions, 8 users an image
    "voice-sessions": ("seedtts", 128, "timestamp", 8, "4k,6k,8k,12k"),     # voice-clone's sessions
}


def load(name: str):
    from workloads import registry
    path, *_ = TRACES[name]
    if name == "mt-bench":
        from workloads.traces.mt_bench import load_mt_bench
        return load_mt_bench(DATA / path)
    if name == "image-chats":
        from workloads.traces.image_chats import load_image_chats
        return load_image_chats(DATA)
    if name == "voice-sessions":
        from workloads.traces.voice_sessions import load_voice_sessions
        return load_voice_sessions(DATA)
    return registry.load({"mooncake": "mooncake", "agent": "swe-agent"}[name], DATA / path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--pools", help="pool sizes (default: each trace's own)")
    args = ap.parse_args()
    policies = args.policies.split(",")
    for name in args.traces.split(","):
        _, page, order, in_flight, pools = TRACES[name]
        trace = load(name)
        sizes = parse_sizes(args.pools or pools)
        started = time.perf_counter()
        sweeps = {p: run_sweep(trace, page_size=page, pool_sizes=sizes, order=order, in_flight=in_flight,
                               eviction=p, optimal=(k == 0)) for k, p in enumerate(policies)}
        best = sweeps[policies[0]].optimal
        print(f"\n{name}: page {page}, order {order}{f', {in_flight} in flight' if order == 'round-robin' else ''}, "
              f"ceiling {100 * sweeps[policies[0]].ceiling.hit_rate:.2f}% ({time.perf_counter() - started:.0f} s)")
        print(f"{'pool':>6} | " + " | ".join(f"{p:>16}" for p in policies) + f" | {'optimal':>8}")
        for i, size in enumerate(sizes):
            lru = sweeps["lru"].runs[i].hit_rate if "lru" in sweeps else None
            opt = best[i].hit_rate
            cells = []
            for p in policies:
                r = sweeps[p].runs[i].hit_rate
                closed = "" if lru is None or opt - lru < 1e-9 else f" ({100 * (r - lru) / (opt - lru):+4.0f}%)"
                cells.append(f"{100 * r:6.2f}{closed:>9}")
            print(f"{format_size(size):>6} | " + " | ".join(f"{c:>16}" for c in cells) + f" | {100 * opt:8.2f}")


if __name__ == "__main__":
    main()
