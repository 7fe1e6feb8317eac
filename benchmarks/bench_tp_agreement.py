"""Agreement cost per admission over loopback gloo: TPAgreement.admit vs the plain local PrefixCache.admit, on the
same ranks in the same run, for 2 and 4 ranks.

Each rank's cache holds one 2048-token prefix (page 128); an admission matches its 15 pages and is aborted again.
Per rank and mode: the mean over ``INNER`` admissions, repeated ``REPEATS`` times; the table shows rank 0's median
and the spread (min-max) over repeats, the added cost and its share of the agreed admission.

    PYTHONPATH=. python benchmarks/bench_tp_agreement.py   (from the repository root)
"""

import socket
import statistics
import sys
import time

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.tp import TPAgreement

P, PROMPT, INNER, REPEATS = 128, 2048, 200, 7


def _rank(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    fp = Fingerprint("bench", tp_rank=rank, tp_size=world, page_size=P)
    tokens = np.arange(PROMPT + 1, dtype=np.int32)
    local, tp = PrefixCache(PagePool(64), fp), PrefixCache(PagePool(64), fp, agreement=TPAgreement())
    for cache in (local, tp):
        cache.admit("warm", tokens)
        cache.grow("warm", len(tokens))
        cache.mark_computed("warm", len(tokens))
        cache.finish("warm")

    def once(cache):
        dist.barrier()
        t = time.perf_counter()
        for i in range(INNER):
            cache.admit(i, tokens)
            cache.abort(i)
        return (time.perf_counter() - t) / INNER

    plain, agreed = [], []
    for _ in range(REPEATS):
        plain.append(once(local))
        agreed.append(once(tp))
    if rank == 0:
        out.put((world, plain, agreed))
    dist.barrier()
    dist.destroy_process_group()


def main():
    print(f"{'ranks':>5} | {'local admit us':>16} | {'agreed admit us':>17} | {'agreement us':>12} | {'share %':>7}")
    ctx = mp.get_context("spawn")
    for world in (2, 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.SimpleQueue()
        mp.spawn(_rank, args=(world, port, q), nprocs=world, join=True)
        _, plain, agreed = q.get()
        p, a = statistics.median(plain) * 1e6, statistics.median(agreed) * 1e6
        spread = lambda xs: f"{min(xs) * 1e6:.0f}-{max(xs) * 1e6:.0f}"  # noqa: E731
        print(f"{world:>5} | {p:6.1f} ({spread(plain):>8}) | {a:7.1f} ({spread(agreed):>8}) | {a - p:12.1f} | "
              f"{100 * (a - p) / a:7.1f}")
    print(f"(median over {REPEATS} repeats of the mean of {INNER} admissions, rank 0; min-max in parentheses; "
          f"{PROMPT}-token prompt matching {PROMPT // P - 1} pages of {P}; loopback gloo, {sys.platform})")


if __name__ == "__main__":
    main()
