"""Time the continuous-batching engine spends in its KV cache's bookkeeping, with its own prefix sharing and with
mmcache's allocator under it, on the same replay in the same run.

    python benchmarks/bench_cb_allocator.py [--runs 5] [--trace mt-bench] [--inflight 4] [--pages 644] [--inside]

Requests per second on this 2-core machine swing by a third from one replay to the next for the same engine
(``bench_peer_transformers.py`` reports that spread), far more than either allocator costs, so this measures the
cost itself: the wall time inside the methods of transformers' ``PagedAttentionCache`` that the allocator serves
(prefix lookup at admission, block completion, teardown, capacity checks, read/write indices), summed over one
replay, for the engine with sharing on (the peer) and with mmcache (``mmcache.hf.continuous_batching``). The engines
take turns within each repetition; median and min-max over ``--runs``, and the ratio of medians. The replay itself
is ``bench_peer_transformers``'s (same model, requests and order).

``--inside`` adds a second table: where mmcache's share goes, per request, timed around the steps of its own
lifecycle that the allocator's calls reach (naming a prompt, the verified match, the pages taken, indexing what was
written, the index writes within it). Those timers cost a little themselves, so the first table is the one to
compare with the peer.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_peer_transformers as peer  # noqa: E402  (beside this script)

METHODS = ("search_prefix_match", "mark_complete_blocks", "free_blocks", "can_store_request_tokens",
           "extend_read_and_write_indices")
INSIDE = (("PrefixLifecycle", "name"), ("PrefixLifecycle", "match"), ("PrefixLifecycle", "take"),
          ("PrefixLifecycle", "commit_many"), ("PrefixIndex", "insert_runs"))


def add_timer(cls, name: str, label: str, spent: collections.Counter) -> None:
    """Wrap ``cls.name`` (for this process) to add its wall time to ``spent[label]``."""
    method = getattr(cls, name)

    @functools.wraps(method)  # keeps mmcache's install mark on its search_prefix_match: installed once
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - t

    setattr(cls, name, timed)


def timed_cache_methods(model) -> collections.Counter:
    """Wrap ``PagedAttentionCache``'s bookkeeping methods (for this process) to add their wall time to the counter
    returned, per method. mmcache's allocator is installed first (and turned off again for ``model``), so its wrapped
    ``search_prefix_match`` (mmcache's admission) is inside the timing, as the engine's own is."""
    from transformers.generation.continuous_batching import cache as cb_cache

    from mmcache.hf.continuous_batching import enable_prefix_cache

    enable_prefix_cache(model).disable()
    spent: collections.Counter = collections.Counter()
    for name in METHODS:
        add_timer(cb_cache.PagedAttentionCache, name, name, spent)
    return spent


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--trace", default="mt-bench", help="mt-bench, sharegpt, swe-agent or mooncake")
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--pages", type=int, default=644, help="KV blocks (644 holds every MT-Bench prompt page)")
    ap.add_argument("--inside", action="store_true", help="also time the steps of mmcache's own lifecycle")
    ap.add_argument("--model-dir", type=Path, default=Path(os.environ.get("MMCACHE_MODEL_DIR",
                                                                          Path.home() / ".cache/mmcache/models")))
    args = ap.parse_args(argv)
    if problem := peer.missing_data([args.trace]):
        sys.exit(f"bench_cb_allocator: {problem}")
    torch.set_num_threads(1)
    opts = peer.parser().parse_args([])  # the replay's defaults
    model = peer.load_model("tiny", args.model_dir)
    spent = timed_cache_methods(model)
    if args.inside:
        from mmcache import lifecycle, prefix_index
        for cls_name, name in INSIDE:
            cls = getattr(lifecycle, cls_name, None) or getattr(prefix_index, cls_name)
            add_timer(cls, name, f"{cls_name}.{name}", spent)
    calls = peer.load_calls(args.trace, opts)
    engines = {"peer share-on": False, "mmcache in peer": True}
    totals = {name: [] for name in engines}
    per_method = {name: collections.defaultdict(list) for name in engines}
    for name, mm in engines.items():  # warm-up: first-call costs land on neither
        peer.run_peer(model, calls[:8], share=True, pages=args.pages, args=opts, inflight=args.inflight, mmcache=mm)
    for _ in range(args.runs):
        for name, mm in engines.items():
            spent.clear()
            peer.run_peer(model, calls, share=True, pages=args.pages, args=opts, inflight=args.inflight,
                          mmcache=mm)
            totals[name].append(sum(spent[m] for m in METHODS) * 1e3)
            for m in spent:
                per_method[name][m].append(spent[m] * 1e3)
    base = statistics.median(totals["peer share-on"])
    print(f"# {args.trace}, {len(calls)} requests, {args.inflight} in flight, {args.pages} blocks; ms per replay in "
          f"the cache's bookkeeping, median (min-max) of {args.runs}; {os.cpu_count()} CPUs, torch threads 1")
    print(f"{'engine':<17} {'total ms':>20} {'x peer':>7}  " + "  ".join(f"{m[:18]:>18}" for m in METHODS))
    for name in engines:
        t = totals[name]
        cells = "  ".join(f"{statistics.median(per_method[name][m]):18.2f}" for m in METHODS)
        print(f"{name:<17} {statistics.median(t):8.2f} ({min(t):.2f}-{max(t):.2f}) "
              f"{statistics.median(t) / base:7.2f}  {cells}")
    if args.inside:
        print(f"# inside mmcache's share: us per request, median (min-max) of {args.runs}")
        for cls_name, name in INSIDE:
            t = [x * 1e3 / len(calls) for x in per_method["mmcache in peer"][f"{cls_name}.{name}"]]
            print(f"{cls_name + '.' + name:<30} {statistics.median(t):8.1f} ({min(t):.1f}-{max(t):.1f})")


if __name__ == "__main__":
    main()
