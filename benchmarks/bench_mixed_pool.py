"""KV pages and encoder outputs on ONE pool under pressure: the time each kind saves under each policy against ``lru``
(recency alone: an image's output and a KV page weigh the same): the default ``dip`` (weighs no cost either),
``dip-costs`` (weighs what an entry saves, bounded: a KV page its prefill, an encoder output its forward over its
pages) and ``lfu``, at pool sizes from tight to roomy.

Traces (the replica replay's media traces, one replica, ``shared_pool=True``, ``workloads.sizing.replicas``):
vlm-chat's image chats (several users per image: outputs shared across users, KV within a session) and voice-clone's
voice sessions (a reference voice per user). A KV page of ``--page-size`` tokens holds ``page x kv_bytes_per_token``
bytes (Llama-3-8B's 128 KiB a token by default), an encoder output its feature bytes over that (at least a page);
prefill at ``--prefill`` tokens/s, an encoder run ``--encoder-s`` seconds (the service model). Printed per pool and
policy: prefix hit %, encoder hits (store; inside matched prefixes), seconds saved by the KV pages and by the encoder
store, and the total against ``lru``'s. The replay is deterministic: one run, no spread.

    python benchmarks/bench_mixed_pool.py                      # needs the mmmu and seedtts data (mmcache data fetch NAME)
    python benchmarks/bench_mixed_pool.py --encoder-s 0.2      # a costlier encoder
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workloads import registry  # noqa: E402
from workloads.service import ServiceModel  # noqa: E402
from workloads.sizes import format_size, parse_sizes  # noqa: E402
from workloads.sizing.replicas import replay_replicas  # noqa: E402


def load(name: str, data: Path):
    if name == "image-chats":
        from workloads.traces.image_chats import load_image_chats
        return load_image_chats(data)
    from workloads.traces.voice_sessions import load_voice_sessions
    return load_voice_sessions(data)


POOLS = {"image-chats": "32k,48k,64k,96k", "voice-sessions": "4k,6k,8k"}  # where lru and the optimum differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", default="image-chats,voice-sessions")
    ap.add_argument("--pools", help="pool sizes for every trace (default: each trace's own, around its knee: "
                    + "; ".join(f"{t} {p}" for t, p in POOLS.items()) + ")")
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--policies", default="lru,dip,dip-costs,lfu")
    ap.add_argument("--prefill", type=float, default=ServiceModel.prefill_tokens_per_s)
    ap.add_argument("--encoder-s", type=float, default=ServiceModel.encoder_s)
    args = ap.parse_args()
    data = registry.data_place()[0]
    service = ServiceModel(prefill_tokens_per_s=args.prefill, encoder_s=args.encoder_s)
    policies = args.policies.split(",")
    for name in args.traces.split(","):
        trace = load(name, data)
        print(f"\n{name}: {trace.source}; page {args.page_size}, prefill {args.prefill:g} tokens/s, encoder "
              f"{args.encoder_s:g} s a run")
        print(f"{'pool':>6} | {'policy':>9} | {'prefix hit %':>12} | {'encoder hits (store; prefix)':>28} | "
              f"{'KV saved s':>10} | {'encoder saved s':>15} | {'total s':>8} | {'vs lru':>6}")
        for size in parse_sizes(args.pools or POOLS[name]):
            runs = {p: replay_replicas(trace, replicas=1, router="random", page_size=args.page_size,
                                       pool_tokens=size, service=service, eviction=p, shared_pool=True)
                    for p in policies}
            base = runs["lru"].kv_saved_s + runs["lru"].encoder_saved_s if "lru" in runs else None
            for p, r in runs.items():
                total = r.kv_saved_s + r.encoder_saved_s
                vs = f"{total / base:.3f}" if base else "-"
                hits = f"{r.encoder_store_hits:,} of {r.encoder_items:,}; {r.encoder_in_prefix:,}"
                print(f"{format_size(size):>6} | {p:>9} | {100 * r.hit_rate:12.2f} | {hits:>28} | "
                      f"{r.kv_saved_s:10.1f} | {r.encoder_saved_s:15.1f} | {total:8.1f} | {vs:>6}")


if __name__ == "__main__":
    main()
