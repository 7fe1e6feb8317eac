"""KV events: what publishing costs a request and how fast events leave.

1. Cost per stored page on the request path: admit + grow + mark_computed + finish of distinct prompts on a pool that
   evicts all the time (every page is stored once and removed once), with a ``KVEventPublisher`` vs without.
2. Event throughput: pages stored per second that reach a ZMQ subscriber on 127.0.0.1 and are decoded there.

    python benchmarks/bench_kv_events.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import best  # noqa: E402
from mmcache import Fingerprint, PagePool, PrefixCache  # noqa: E402
from mmcache.kv_events import KVEventPublisher  # noqa: E402

P = 16


def stream(cache, prompts):
    def run():
        for i, ids in enumerate(prompts):
            cache.admit(i, ids)
            cache.grow(i, ids.size)
            cache.mark_computed(i, ids.size)
            cache.finish(i)
    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    repeats, requests = (3, 300) if args.quick else (5, 1000)
    fp = Fingerprint(model="events", page_size=P)
    pages = 8
    prompts = np.random.default_rng(0).integers(1, 30000, (requests, pages * P + 1)).astype(np.int32)
    pub = KVEventPublisher("tcp://127.0.0.1:*", P, medium="CPU", queue_events=10 * requests * pages)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.3)
    received = {"stored": 0, "removed": 0}

    def drain():
        while sub.poll(1000):
            for ev in msgpack.unpackb(sub.recv_multipart()[2])[1]:
                if ev[0] == "BlockStored":
                    received["stored"] += len(ev[1])
                elif ev[0] == "BlockRemoved":
                    received["removed"] += len(ev[1])
    reader = threading.Thread(target=drain)
    reader.start()
    on, off, thru = [], [], []
    for _ in range(repeats):
        with_pub = PrefixCache(PagePool(64, (), torch.float32), fp, observer=pub)
        before = received["stored"]
        t = time.perf_counter()
        stream(with_pub, prompts)()
        pub.flush(60)
        while received["stored"] - before < requests * pages and time.perf_counter() - t < 60:
            time.sleep(0.001)
        thru.append(requests * pages / (time.perf_counter() - t))
        with_pub.clear()
        on.append(best(stream(PrefixCache(PagePool(64, (), torch.float32), fp, observer=pub), prompts), 1))
        pub.flush(60)
        off.append(best(stream(PrefixCache(PagePool(64, (), torch.float32), fp), prompts), 1))
    stored = requests * pages
    cost = sorted((o - b) / stored * 1e6 for o, b in zip(on, off))
    over = sorted(100 * (o - b) / b for o, b in zip(on, off))
    print(f"{requests} requests x {pages} pages of {P} tokens, 64-page pool (each page stored and removed once); "
          f"median [min-max] over {repeats} repeats")
    print(f"request-path cost per stored page (its store + its removal events): {np.median(cost):.2f} "
          f"[{cost[0]:.2f}-{cost[-1]:.2f}] us; lifecycle overhead {np.median(over):.1f}% [{over[0]:.1f}-{over[-1]:.1f}]")
    thru.sort()
    print(f"end-to-end: pages stored -> decoded by a subscriber: {np.median(thru):,.0f} [{thru[0]:,.0f}-{thru[-1]:,.0f}]"
          f" pages/s; dropped {pub.counters['dropped']}, messages {pub.counters['messages']}")
    pub.close()
    reader.join()
    sub.close(linger=0)


if __name__ == "__main__":
    main()
