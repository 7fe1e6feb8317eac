"""Eviction policies against the offline optimum on the same calls, as an engine serves them: realized reuse per pool
size, per trace, per order and number of requests in service.

Each trace is replayed (``workloads.sizing.sweep.run_sweep``) once per policy at every pool size, and once under the
offline optimum (Belady on the lookups the ceiling recorded, the same calls in the same order). A request holds its
pages from admission to completion only (``workloads.sizing.ordering``). Printed per (trace, order, requests in
service): each policy's realized reuse, the optimum's, and the share of the gap between ``lru`` and the optimum that
each policy closes ("closed"; negative: below ``lru``); then, per trace, the default's worst point against ``lru``
over every size and serving. Reads the traces from the data folder (``--data``; default ``../shared/data`` beside
this checkout, else where ``mmcache data fetch`` puts them).

    python benchmarks/bench_eviction.py                                   # every trace, order and serving
    python benchmarks/bench_eviction.py --traces agent --orders round-robin --in-service 1,8 --pools 96k,128k
    python benchmarks/bench_eviction.py --json eviction.json              # every figure, for the docs

Traces: the Mooncake conversation trace (each request its own session), the 100 mini-swe-agent trajectories, MT-Bench
two-turn chats, ShareGPT first turns, vlm-chat's image chats and voice-clone's voice sessions (their media named in
the chain; the encoder outputs are in ``bench_mixed_pool.py``), and the generated hot-prefix users. Deterministic: one
run each (the replay has no timing in it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mmcache.eviction import DEFAULT_POLICY, POLICIES
from workloads.sizes import format_size, parse_sizes
from workloads.sizing.ordering import ORDERS, Serving
from workloads.sizing.sweep import run_sweep

# trace: (page size, pool sizes at and around its knees)
TRACES = {
    "mooncake": (512, "512k,1M,2M,4M,8M"),
    "agent": (128, "32k,64k,96k,128k,192k,256k"),
    "mt-bench": (16, "4k,8k,10k,12k,14k,20k,24k"),
    "sharegpt": (16, "1k,2k,4k,64k"),
    "image-chats": (128, "32k,48k,64k,96k,128k"),
    "voice-sessions": (128, "4k,6k,8k,12k"),
    "hot-prefix": (128, "64k,128k,256k,512k,1M"),
}


def data_folder(given: str | None) -> Path:
    from workloads import registry
    return Path(given) if given else registry.default_data()


def load(name: str, data: Path):
    from workloads import registry
    if name == "mt-bench":
        from workloads.traces.mt_bench import load_mt_bench
        return load_mt_bench(data / "mt-bench")
    if name == "image-chats":
        from workloads.traces.image_chats import load_image_chats
        return load_image_chats(data)
    if name == "voice-sessions":
        from workloads.traces.voice_sessions import load_voice_sessions
        return load_voice_sessions(data)
    if name == "hot-prefix":
        return registry.load("hot-prefix", "hot-prefix", limit=400)
    fmt, path = {"mooncake": ("mooncake", "mooncake/conversation_trace.jsonl"),
                 "agent": ("swe-agent", "mini-swe-agent/trajs"), "sharegpt": ("sharegpt", "sharegpt")}[name]
    path = data / path
    if name == "sharegpt":
        path = next(path.glob("*.json"))
    return registry.load(fmt, path)


def servings(orders: list[str], in_service: list[int | None], sessions: int) -> list[Serving]:
    """Every (order, requests in service) asked for; round-robin has no uncapped serving (a request completes when
    another needs its place)."""
    return [Serving(order, sessions, n) for order in orders for n in in_service
            if not (order == "round-robin" and n is None)]


def closed(r: float, lru: float | None, opt: float) -> str:
    return "" if lru is None or not opt - lru >= 1e-9 else f" ({100 * (r - lru) / (opt - lru):+4.0f}%)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--orders", default=",".join(ORDERS))
    ap.add_argument("--in-service", default="1,2,4,8,none", help="requests in service; none: no cap (clocked orders)")
    ap.add_argument("--sessions", type=int, default=8, help="round-robin: sessions interleaved; closed: clients")
    ap.add_argument("--pools", help="pool sizes (default: each trace's own)")
    ap.add_argument("--data", help="the data folder (default: ../shared/data beside this checkout, else the fetched)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--no-optimal", action="store_true",
                    help="leave the optimum out (faster: what the default's bound against lru needs)")
    args = ap.parse_args()
    policies = args.policies.split(",")
    in_service = [None if n == "none" else int(n) for n in args.in_service.split(",")]
    data, figures = data_folder(args.data), []
    for name in args.traces.split(","):
        page, pools = TRACES[name]
        trace = load(name, data)
        sizes = parse_sizes(args.pools or pools)
        worst = None  # (default - lru, serving, size)
        for serving in servings(args.orders.split(","), in_service, args.sessions):
            started = time.perf_counter()
            sweeps = {p: run_sweep(trace, page_size=page, pool_sizes=sizes, serving=serving, eviction=p,
                                   optimal=(k == 0 and not args.no_optimal)) for k, p in enumerate(policies)}
            best = sweeps[policies[0]].optimal
            print(f"\n{name}: page {page}, {serving.describe()}, ceiling "
                  f"{100 * sweeps[policies[0]].ceiling.hit_rate:.2f}% ({time.perf_counter() - started:.0f} s)")
            print(f"{'pool':>6} | " + " | ".join(f"{p:>16}" for p in policies) + f" | {'optimal':>8}")
            for i, size in enumerate(sizes):
                lru = sweeps["lru"].runs[i].hit_rate if "lru" in sweeps else None
                opt = best[i].hit_rate if best[i] is not None else float("nan")
                rates = {p: sweeps[p].runs[i].hit_rate for p in policies}
                print(f"{format_size(size):>6} | " + " | ".join(
                    f"{100 * rates[p]:6.2f}{closed(rates[p], lru, opt):>9}" for p in policies) + f" | {100 * opt:8.2f}")
                figures.append({"trace": name, "page_size": page, "order": serving.order, "sessions": serving.sessions,
                                "in_service": serving.cap, "pool_tokens": size, "optimal": opt, **rates})
                if lru is not None and DEFAULT_POLICY in rates:
                    diff = rates[DEFAULT_POLICY] - lru
                    if worst is None or diff < worst[0]:
                        worst = (diff, serving.describe(), size)
        if worst is not None:
            print(f"{name}: {DEFAULT_POLICY} against lru at its worst: {100 * worst[0]:+.2f} points "
                  f"({worst[1]}, {format_size(worst[2])})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
