"""KV events: what publishing costs a request and how fast events leave.

1. Cost per stored page: admit + grow + mark_computed + finish of distinct prompts on a pool that evicts all the time
   (every page is stored once and removed once), with a ``KVEventPublisher`` vs without, and with an observer that
   only queues (the request path's own share).
2. Event throughput: pages stored per second that reach a ZMQ subscriber on 127.0.0.1 and are decoded there.

    python benchmarks/bench_kv_events.py [--quick]
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.timing import best
from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.events import BlockStored, decode_batch
from mmcache.kv_events import KVEventPublisher

P = 16


class QueueOnly:
    """What the request path itself pays: the observer's calls and a queue put, nobody encoding behind it."""

    def __init__(self):
        self.q = queue.SimpleQueue()

    def stored(self, *event):
        self.q.put(event)

    def removed(self, names):
        self.q.put(names)

    def cleared(self):
        self.q.put(None)


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
    stored = requests * pages
    pub = KVEventPublisher("tcp://127.0.0.1:*", P, medium="CPU", queue_events=10 * stored)

    def lifecycle(observer):
        return stream(PrefixCache(PagePool(64, (), torch.float32), fp, observer=observer), prompts)
    on, off, queued = [], [], []
    for _ in range(repeats):  # no subscriber in this process: a router decodes in its own
        on.append(best(lifecycle(pub), 1))
        pub.flush(60)
        off.append(best(lifecycle(None), 1))
        queued.append(best(lifecycle(QueueOnly()), 1))
    cost = sorted((o - b) / stored * 1e6 for o, b in zip(on, off))
    over = sorted(100 * (o - b) / b for o, b in zip(on, off))
    print(f"{requests} requests x {pages} pages of {P} tokens, 64-page pool (each page stored and removed once); "
          f"median [min-max] over {repeats} repeats")
    print(f"1. cost per stored page, its stored and removed events queued and encoded and sent by the publisher "
          f"thread (same process): {np.median(cost):.2f} [{cost[0]:.2f}-{cost[-1]:.2f}] us; lifecycle overhead "
          f"{np.median(over):.1f}% [{over[0]:.1f}-{over[-1]:.1f}]")
    hook = sorted((q - b) / stored * 1e6 for q, b in zip(queued, off))
    print(f"   of which the request path itself (the hook and the queue, no publisher thread): {np.median(hook):.2f} "
          f"[{hook[0]:.2f}-{hook[-1]:.2f}] us; the rest is the publisher thread's encoding sharing 2 cores and the GIL")
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    time.sleep(0.3)
    received = {"stored": 0}

    def drain():
        while sub.poll(1000):
            for ev in decode_batch(sub.recv_multipart()[2]).events:
                if isinstance(ev, BlockStored):
                    received["stored"] += len(ev.block_hashes)
    reader = threading.Thread(target=drain)
    reader.start()
    thru = []
    for _ in range(repeats):
        before, t = received["stored"], time.perf_counter()
        lifecycle(pub)()
        while received["stored"] - before < stored and time.perf_counter() - t < 60:
            time.sleep(0.0005)
        thru.append(stored / (time.perf_counter() - t))
    thru.sort()
    print(f"2. end to end, pages stored -> decoded by a subscriber thread on 127.0.0.1: {np.median(thru):,.0f} "
          f"[{thru[0]:,.0f}-{thru[-1]:,.0f}] pages/s; dropped {pub.counters['dropped']}, "
          f"events {pub.counters['events']}, messages {pub.counters['messages']}")
    pub.close()
    reader.join()
    sub.close(linger=0)

if __name__ == "__main__":
    main()
