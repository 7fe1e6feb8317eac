"""Eviction policies on long-running generated traffic, window by window: the hit share of every 1,000 requests under
each policy, beside the offline optimum of the same calls (``benchmarks/traffic.py``: sessions that end, a burst that
stops, encoder traffic that stops midway).

A mean over a long run hides a policy that is fine for a while and then collapses; a default must be safe in its worst
window. Per generator, serving and pool size: each window's prompt-token hit share (and, where the traffic has images,
the share of images the encoder did not run for) per policy, then each policy's worst window against ``lru`` after
the first over every run, the default's last (the first window is the warm-up every policy shares; a last, partial
window is left out). Deterministic: one run each.

    python benchmarks/bench_traffic.py                                 # every generator, 20,000 requests each
    python benchmarks/bench_traffic.py --traffic burst --requests 5000 --windows
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from traffic import GENERATORS, KV_PAGE_BYTES, PAGE

from mmcache.eviction import DEFAULT_POLICY, POLICIES, LookupRecorder
from workloads.sizes import format_size, parse_sizes
from workloads.sizing.encoders import EncoderPlace
from workloads.sizing.ordering import Serving
from workloads.sizing.replay import replay_trace

WINDOW = 1000
POOLS = {"agent-sessions": "2k,4k,6k", "ending-chats": "1k,2k,4k", "hot-prompts": "2k,4k,8k",
         "burst": "1k,2k,4k", "encoder-stop": "2k,4k,8k"}


class Windows:
    """A replay's hits per window of ``WINDOW`` calls (a ``ReplayObserver``)."""

    def __init__(self, requests: int):
        n = -(-requests // WINDOW)
        self.hit, self.asked, self.images, self.encoded = (np.zeros(n) for _ in range(4))

    def served(self, request, req, matched, encoder_runs) -> None:
        w = request // WINDOW
        self.asked[w] += req.prompt_len
        self.hit[w] += matched or 0
        self.images[w] += len(req.encoded)
        self.encoded[w] += encoder_runs if matched is not None else len(req.encoded)

    def shares(self) -> tuple[np.ndarray, np.ndarray]:
        """Prompt-token hit share and image hit share (NaN where a window had no image) per window."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.hit / self.asked, 1 - self.encoded / self.images


def run(name: str, requests: int, serving: Serving, sizes, policies, show_windows: bool) -> list[dict]:
    trace = GENERATORS[name](requests)
    encoders = EncoderPlace(kv_page_bytes=KV_PAGE_BYTES) if name == "encoder-stop" else None
    recorder, started, rows = LookupRecorder(), time.perf_counter(), []
    replay_trace(trace, page_size=PAGE, pool_tokens=None, serving=serving, eviction=recorder, encoders=encoders)
    for size in sizes:
        windows = {}
        for p in [*policies, "optimal"]:
            windows[p] = Windows(trace.num_requests)
            replay_trace(trace, page_size=PAGE, pool_tokens=size, serving=serving, eviction=p, encoders=encoders,
                         lookups=recorder.lookups, watch=windows[p])
        kv = {p: w.shares()[0] for p, w in windows.items()}
        img = {p: w.shares()[1] for p, w in windows.items()}
        print(f"\n{name}: {trace.num_requests:,} requests, page {PAGE}, {serving.describe()}, pool {format_size(size)}"
              f" ({time.perf_counter() - started:.0f} s)")
        if show_windows:
            print("window | " + " | ".join(f"{p:>7}" for p in kv) + (" | images: " + " | ".join(
                f"{p:>7}" for p in img) if encoders else ""))
            for w in range(len(kv["lru"])):
                line = f"{w:6d} | " + " | ".join(f"{100 * kv[p][w]:7.2f}" for p in kv)
                if encoders:
                    line += " |         " + " | ".join(f"{100 * img[p][w]:7.2f}" for p in img)
                print(line)
        means = {p: float(w.hit.sum() / w.asked.sum()) for p, w in windows.items()}
        full = trace.num_requests // WINDOW  # a last, partial window is a few requests: not a window
        worst = {p: float(np.min(kv[p][1:full] - kv["lru"][1:full])) if full > 1 else 0.0 for p in policies}
        print("mean: " + ", ".join(f"{p} {100 * m:.2f}%" for p, m in means.items()))
        print("worst window after the first, against lru: "
              + ", ".join(f"{p} {100 * worst[p]:+.2f}" for p in policies if p != "lru"))
        rows.append({"traffic": name, "serving": serving.describe(), "pool_tokens": size, "means": means,
                     "worst": worst})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traffic", default=",".join(GENERATORS))
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--in-service", default="1,4")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--pools", help="pool sizes (default: each generator's own)")
    ap.add_argument("--windows", action="store_true", help="print every window")
    args = ap.parse_args()
    policies = args.policies.split(",")
    if "lru" not in policies:
        policies.insert(0, "lru")
    rows = []
    for name in args.traffic.split(","):
        for n in args.in_service.split(","):
            rows += run(name, args.requests, Serving("round-robin", args.sessions, int(n)),
                        parse_sizes(args.pools or POOLS[name]), policies, args.windows)
    for policy in sorted((p for p in policies if p != "lru"), key=lambda p: p == DEFAULT_POLICY):  # the default last
        print(f"\n{policy}'s worst window after the first against lru, over every run: "
              f"{100 * min(r['worst'][policy] for r in rows):+.2f} points")


if __name__ == "__main__":
    main()
