"""Reuse while requests are still running: pages indexed as their KV is written vs only at teardown, in one run.

    python benchmarks/bench_inflight_sharing.py [--trace PATH] [--limit 400] [--in-flight 1,4,16] [--chunk 2048]

Requests run as a continuous-batching engine runs them: at most N in flight, each admitted at the first step at or
after its arrival with a slot free, each step advancing every in-flight request by one prefill chunk (``mark_computed``
after it) or one decode token, then finishing. A step stands for ``--step-ms`` of the trace's clock (an assumption:
the engine's step time), so a request arriving while another is still prefilling or decoding is admitted then. Two
rows per N on the same schedule and a metadata-only pool large enough that nothing is
evicted: ``teardown`` marks the KV written only just before ``finish`` (the indexing moment before commit-as-written),
``as written`` marks it after every chunk. A request admitted while another with the same prefix is still running
hits the pages that request has written. Traces: the embedded Mooncake slice (default; any Mooncake JSONL with
``--trace``) and a burst of requests sharing one system prompt (``--burst``: all arrive at once).
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mmcache import Fingerprint, PagePool, PrefixCache  # noqa: E402
from workloads.traces.mooncake import load_mooncake  # noqa: E402

EMBEDDED = Path(__file__).resolve().parents[1] / "workloads" / "data" / "mooncake_slice.jsonl"


def requests_of(trace, step_ms: float) -> list:
    """Every call in arrival order, as (arrival step, token ids, names, output length)."""
    calls = [s.build(i) for s in trace.sessions for i in range(len(s.calls))]
    calls.sort(key=lambda r: r.arrival_s)
    t0 = calls[0].arrival_s if calls else 0.0
    return [(int((r.arrival_s - t0) * 1000 / step_ms), r.token_ids, r.names, r.output_len) for r in calls]


def burst(n: int, system: int, own: int) -> list:
    """``n`` requests behind one ``system``-token prompt, one arriving per step."""
    rng = np.random.default_rng(0)
    head = rng.integers(0, 30000, system).astype(np.int32)
    return [(i, np.concatenate((head, rng.integers(0, 30000, own).astype(np.int32))), None, 8) for i in range(n)]


def replay(reqs, in_flight: int, chunk: int, page: int, as_written: bool, decode_cap: int = 16) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of ``reqs`` run ``in_flight`` at a time (see the module docstring)."""
    total = sum(len(t) + min(o, decode_cap) for _, t, _, o in reqs)
    cache = PrefixCache(PagePool(total // page + 2 * len(reqs) + 8), Fingerprint("bench", page_size=page))
    queue, live, rid, step = deque(reqs), {}, 0, 0
    while queue or live:
        step += 1
        if not live and queue and queue[0][0] > step:
            step = queue[0][0]  # idle until the next arrival
        while queue and len(live) < in_flight and queue[0][0] <= step:
            _, tokens, names, out = queue.popleft()
            st = cache.admit(rid, tokens, names=names)
            live[rid] = [tokens, st.matched_tokens, min(out, decode_cap)]
            rid += 1
        for r in list(live):
            tokens, done, left = live[r]
            if done < len(tokens):
                done = min(len(tokens), done + chunk)
                cache.grow(r, done)
                if as_written:
                    cache.mark_computed(r, done)
            elif left:
                done, left = done + 1, left - 1
                cache.grow(r, done)
                if as_written:
                    cache.mark_computed(r, done)
            else:
                cache.mark_computed(r, done)
                cache.finish(r)
                del live[r]
                continue
            live[r] = [tokens, done, left]
    s = cache.stats()
    return s.hit_tokens, s.queried_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=EMBEDDED)
    ap.add_argument("--limit", type=int, default=400)
    ap.add_argument("--in-flight", default="1,4,16")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--step-ms", type=float, default=50.0, help="trace time one engine step stands for")
    ap.add_argument("--burst", type=int, default=32, help="requests in the shared-system-prompt burst (0: none)")
    args = ap.parse_args()
    trace = load_mooncake(args.trace, limit=args.limit)
    page = trace.page_size
    cases = [(f"{args.trace.name} ({trace.num_requests} requests)", requests_of(trace, args.step_ms))]
    if args.burst:
        cases.append((f"burst of {args.burst}, 4,096-token system prompt", burst(args.burst, 4096, 512)))
    print(f"{'trace':<46} {'N':>3} | {'teardown':>9} | {'as written':>10} | {'ratio':>6}")
    for label, reqs in cases:
        for n in (int(x) for x in args.in_flight.split(",")):
            before, prompt = replay(reqs, n, args.chunk, page, as_written=False)
            after, _ = replay(reqs, n, args.chunk, page, as_written=True)
            print(f"{label:<46} {n:>3} | {before / prompt:9.2%} | {after / prompt:10.2%} | "
                  f"{after / max(before, 1):6.2f}")
    print(f"(realized share of prompt tokens, page {page}, prefill chunk {args.chunk} tokens per step, a step = "
          f"{args.step_ms:g} ms of trace time, the burst one arrival per step; deterministic: counts, not times)")


if __name__ == "__main__":
    main()
