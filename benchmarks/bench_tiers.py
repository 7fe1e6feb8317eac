"""Tiers under the device pool: each figure against a baseline measured in the same run, as a ratio, with the spread
(min-max over repeats of the best-of timing).

1. Host tier write-out (``HostTier.put`` of evicted pages, ids included) and read-in (copy-up into device pages) vs a
   plain torch index copy of the same bytes. Pinned vs not: pinned memory needs CUDA; on a CPU-only machine both
   sides are host memcpys and the pinned row is reported as not measurable.
2. Store: whole-page put/get through ``StoreTier`` (payload encode + put; get + verification) vs the raw Mooncake
   put/get of the same byte sizes, on a master started here on loopback.
3. Lookups per second of chains of 100 and 1,000 pages: host tier and store vs the device index.
4. Tier overhead on an all-miss stream: admit + grow + finish of distinct prompts on a full pool with a host tier
   (every evicted page is written back for nothing) vs none, metadata-only and with 256 KiB pages.
5. Store reads of a 64-page chain batched (``get_batch``, 16 pages a call) vs one get per page.
6. Authenticated entries: get + verify with a keyed BLAKE2b MAC vs the plain checksum (an in-process store).
7. Admission latency, p50/p99/max, under steady traffic that asks the store on every admission, with the master up,
   killed (for 8 s, past Mooncake's ~4.4 s stalls) and restarted, against the bound (the store's deadline).
8. Tier availability and fresh-read hit rate at the tier's default settings (deadline, probe, health window): one
   instance publishes a 64 KiB entry every step and reads back the one it published 8 steps earlier, on a store with
   room (the baseline), a full 16 MiB store, the full store beside CPU hogs (one per core), the full store turned
   over faster than the master's read lease (with its default lease and a short one), and a store whose master is
   killed then restarted; availability is the share of steps with the store up, "max ms" the slowest read (bound:
   the deadline).

9. The soak (``--only soak``, not in the default run): the full 16 MiB store beside CPU hogs (one per core), a put
   every 50 ms, for ``--soak-s`` seconds (default 600): availability, fresh-read hits and the slowest read over the
   whole run, against the bound (a loaded but healthy machine must see no outage).

    python benchmarks/bench_tiers.py [--quick] [--only availability|soak] [--soak-s 600]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the loopback Mooncake master
from benchmarks.timing import best  # noqa: E402
from mmcache import Fingerprint, PagePool, PrefixCache  # noqa: E402
from mmcache.pool import HostPagePool  # noqa: E402
from mmcache.reclaim import make_room  # noqa: E402
from mmcache.tiers import HostTier, MemoryStore, StoreTier, TierStack, mooncake  # noqa: E402
from mmcache.tiers.lineage import RequestLineage, root_lineage  # noqa: E402
from mmcache.tiers.page_format import Expected  # noqa: E402
from mmcache.tiers.stack import copy_up  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402

P = 128


def spread(values):
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def row(name, ours, base, unit, scale):
    r = [b / o for o, b in zip(ours, base)]  # base time / our time: >1 means we are faster
    print(f"{name:<44} {spread([scale / t for t in ours]):>26} {spread([scale / t for t in base]):>26} {unit:<8} "
          f"{spread(r):>22}")


def header(title, ours, base):
    print(f"\n{title}\n{'':<44} {ours:>26} {base:>26} {'unit':<8} {'ours/base (time)':>22}")


def host_bandwidth(repeats, pages):
    shape = (4, 2, P, 8, 64)  # 4 layers of a GQA model, bf16: 1 MiB pages
    dev = PagePool(pages * 2, shape, torch.bfloat16)
    dev.data.normal_()
    fp = Fingerprint(model="bench", page_size=P)
    ids = list(range(pages))
    names = list(range(1, pages + 1))
    toks = np.zeros((pages, P), dtype=np.int32)
    media = np.zeros((pages, 2), dtype=np.uint64)
    plins = [root_lineage(fp, b"")] * pages
    nbytes = pages * dev.page_bytes
    w_ours, w_base, r_ours, r_base = [], [], [], []
    for _ in range(repeats):
        host_pool = HostPagePool.like(dev, pages)
        tier = HostTier(host_pool, P)

        def write():
            tier._drop(np.flatnonzero(tier._held))
            tier.put(dev, ids, names, toks, media, plins, list(range(pages)))
        w_ours.append(best(write, 3))
        idx = torch.as_tensor(ids)
        w_base.append(best(lambda: host_pool.data.index_copy_(0, idx, dev.data.index_select(0, idx)), 3))
        hp = list(tier._pages.values())
        dst = list(range(pages, 2 * pages))
        r_ours.append(best(lambda: copy_up(host_pool, hp, dev, dst), 3))
        didx = torch.as_tensor(dst)
        r_base.append(best(lambda: dev.data.index_copy_(0, didx, host_pool.data.index_select(0, idx)), 3))
    header(f"1. host tier, {pages} pages of {dev.page_bytes >> 20} MiB (unpinned: no CUDA here; pinned not "
           f"measurable)", "host tier GB/s", "torch copy GB/s")
    row("write-out (device -> host, with ids)", w_ours, w_base, "GB/s", nbytes / 1e9)
    row("read-in (host -> device)", r_ours, r_base, "GB/s", nbytes / 1e9)


def pinned_bandwidth(repeats, pages):
    """Copy-up from pinned vs pageable host pages into a CUDA pool (the tier's async path vs copy_pages)."""
    if not torch.cuda.is_available():
        print("   pinned vs pageable host memory: not measured (no CUDA on this machine; pinned memory needs it)")
        return
    dev = PagePool(pages, (4, 2, P, 8, 64), torch.bfloat16, device="cuda")
    ids = list(range(pages))
    pinned, pageable = HostPagePool.like(dev, pages, pin_memory=True), HostPagePool.like(dev, pages)

    def up(src):
        ev = copy_up(src, ids, dev, ids)
        (ev.synchronize() if ev is not None else torch.cuda.synchronize())
    ours = [best(lambda: up(pinned), 3) for _ in range(repeats)]
    base = [best(lambda: up(pageable), 3) for _ in range(repeats)]
    row("read-in to CUDA, pinned vs pageable", ours, base, "GB/s", pages * dev.page_bytes / 1e9)


def store_bandwidth(repeats, pages):
    why = mooncake.available()
    if why:
        print(f"\n2./3. store: skipped ({why})")
        return None
    master = MooncakeMaster().start()
    client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 1 << 30, 256 << 20)
    try:
        for page_kib in (256, 1024):
            shape = (page_kib * 1024 // (P * 2 * 64 * 2), 2, P, 1, 64)  # layers chosen so a page is page_kib KiB
            dev = PagePool(pages * 2, shape, torch.bfloat16)
            dev.data.normal_()
            fp = Fingerprint(model=f"bench{page_kib}", page_size=P)
            cache = PrefixCache(dev, fp)  # no tier: its pages are published below, timed alone
            store = StoreTier(client, publish_async=False, deadline_s=None)
            stack = TierStack(fp, store=store)
            rng = np.random.default_rng(page_kib)
            put_o, put_b, get_o, get_b = [], [], [], []
            for rep in range(repeats):
                ids = rng.integers(0, 30000, pages * P + 1).astype(np.int32)
                names = [int(x) for x in rng.integers(1, 1 << 62, pages)]
                cache.admit("w", ids, names=names)
                cache.grow("w", ids.size)
                cache.mark_computed("w", ids.size)
                rec = cache._live["w"]
                mids = np.zeros((pages, 2), dtype=np.uint64)
                put_o.append(best(lambda: stack.publish(dev, rec.pages, list(range(pages)), names, ids, mids,
                                                        b""), 1))
                cache.abort("w")
                raw = [dev.data[p].view(torch.uint8).numpy().tobytes() for p in range(pages)]
                keys = [f"raw/{rep}/{j}/{page_kib}" for j in range(pages)]
                mc = client._connected()  # Mooncake's own put (the tier's asks is_exist first: published means stored)
                put_b.append(best(lambda: [mc.put(k, v) for k, v in zip(keys, raw)], 1))
                lineage = RequestLineage(root_lineage(fp, b""), ids, mids, P)
                want = Expected(fp, b"", dev.page_shape, dev.dtype, dev.page_bytes)
                got = []
                get_o.append(best(lambda: got.append(store.match(names, 0, ids, mids, lineage, want)), 2))
                assert len(got[-1]) == pages, (len(got[-1]), store.counters)
                get_b.append(best(lambda: [client.get(k) for k in keys], 2))
            header(f"2. Mooncake Store (loopback TCP), {pages} pages of {page_kib} KiB", "store tier GB/s",
                   "raw put/get GB/s")
            row("put (encode + put)", put_o, put_b, "GB/s", pages * dev.page_bytes / 1e9)
            row("get (get + verify)", get_o, get_b, "GB/s", pages * dev.page_bytes / 1e9)
        return client, master
    except BaseException:
        client.close()
        master.stop()
        raise


def lookups(repeats, store_client):
    header("3. lookups of a whole chain (metadata; the store's pages are 4 KiB)", "tier lookups/s",
           "device index lookups/s")
    for chain_pages in (100, 1000):
        fp = Fingerprint(model="lookups", page_size=P)
        n = chain_pages * P + 1
        ids = np.random.default_rng(chain_pages).integers(0, 30000, n).astype(np.int32)
        shape = (16, 64)  # 4 KiB pages
        dev = PagePool(chain_pages * 2 + 2, shape, torch.float32)
        host = HostTier(HostPagePool.like(dev, chain_pages + 1), P)
        cache = PrefixCache(dev, fp, tiers=TierStack(fp, host=host))
        cache.admit("a", ids)
        cache.grow("a", n)
        cache.mark_computed("a", n)
        cache.finish("a")
        names, mids = cache.index._name, np.zeros((chain_pages, 2), dtype=np.uint64)
        chain_names = [int(names[p]) for p in sorted(cache.index._pages.values(), key=lambda p: cache.index._depth[p])]
        tokens = ids
        salt_id = cache.index.salt_id(b"")
        dev_t = [best(lambda: cache.index.match(chain_names, tokens, mids, salt_id), 5) for _ in range(repeats)]
        make_room(dev, dev.num_pages, dev.num_pages)  # every cached page goes to the host tier
        assert len(host) == chain_pages

        def host_lookup():
            got = host.match(chain_names, 0, tokens, mids, RequestLineage(root_lineage(fp, b""), tokens, mids, P))
            host.pool.release(got)
            assert len(got) == chain_pages
        host_t = [best(host_lookup, 3) for _ in range(repeats)]
        row(f"host tier, chain of {chain_pages}", host_t, dev_t, "chains/s", 1.0)
        if store_client is not None:
            store = StoreTier(store_client, publish_async=False, deadline_s=None)
            stack = TierStack(fp, store=store)
            rows = list(range(chain_pages))
            dev2 = PagePool(chain_pages, shape, torch.float32)
            stack.publish(dev2, rows, rows, chain_names, tokens, mids, b"")
            want = Expected(fp, b"", dev2.page_shape, dev2.dtype, dev2.page_bytes)
            st = [best(lambda: store.match(chain_names, 0, tokens, mids,
                                           RequestLineage(root_lineage(fp, b""), tokens, mids, P), want), 1)
                  for _ in range(repeats)]
            assert store.counters["hit_pages"] >= chain_pages, store.counters
            row(f"store, chain of {chain_pages}", st, dev_t, "chains/s", 1.0)


def all_miss(repeats, requests):
    header(f"4. all-miss stream: {requests} distinct 1,024-token prompts", "with host tier", "no tier")
    prompts = np.random.default_rng(1).integers(0, 30000, (requests, 8 * P + 1)).astype(np.int32)
    for shape, label in (((), "metadata-only"), ((2, 2, P, 2, 64), "256 KiB pages")):
        def cache_for(tiered, pages=64):
            fp = Fingerprint(model="miss", page_size=P)
            pool = PagePool(pages, shape, torch.bfloat16)
            tiers = TierStack(fp, host=HostTier(HostPagePool.like(pool, 256), P)) if tiered else None
            return PrefixCache(pool, fp, tiers=tiers)

        def admissions(tiered):  # admission only: the lookup misses on the device and in the tier
            cache = cache_for(tiered)

            def run():
                for i, ids in enumerate(prompts):
                    cache.admit(i, ids)
                    cache.abort(i)
            return run

        def stream(tiered):  # the whole lifecycle on a full pool: every evicted page is written back
            cache = cache_for(tiered)

            def run():
                for i, ids in enumerate(prompts):
                    cache.admit(i, ids)
                    cache.grow(i, ids.size)
                    cache.mark_computed(i, ids.size)
                    cache.finish(i)
                cache.clear()
            return run
        ours = [best(admissions(True), 3) for _ in range(repeats)]
        base = [best(admissions(False), 3) for _ in range(repeats)]
        row(f"admit (miss) per second, {label}", ours, base, "req/s", float(requests))
        over = [(o - b) / b for o, b in zip(ours, base)]
        print(f"{'':<44} admission overhead {100 * statistics.median(over):.2f}% "
              f"[{100 * min(over):.2f}-{100 * max(over):.2f}]")
        ours = [best(stream(True), 1) for _ in range(repeats)]
        base = [best(stream(False), 1) for _ in range(repeats)]
        row(f"admit+grow+finish per second, {label}", ours, base, "req/s", float(requests))
        evicted = requests * 8  # every request's 8 full pages are evicted by a later one (64-page pool)
        cost = [(o - b) / evicted * 1e6 for o, b in zip(ours, base)]
        print(f"{'':<44} write-back cost per evicted page {spread(cost)} us (ids, lineage, bytes)")


def published_chain(client, pages, shape, key=None, model="chain"):
    """A ``pages``-page chain published through a StoreTier on ``client``; what a reader needs to look it up."""
    fp = Fingerprint(model=model, page_size=P)
    ids = np.random.default_rng(pages).integers(0, 30000, pages * P + 1).astype(np.int32)
    mids = np.zeros((pages, 2), dtype=np.uint64)
    names = [int(x) for x in np.random.default_rng(zlib.crc32(model.encode())).integers(1, 1 << 62, pages)]
    dev = PagePool(pages, shape, torch.float32)
    dev.data.normal_()
    writer = StoreTier(client, publish_async=False, deadline_s=None, key=key)
    rows = list(range(pages))
    TierStack(fp, store=writer).publish(dev, rows, rows, names, ids, mids, b"")
    want = Expected(fp, b"", dev.page_shape, dev.dtype, dev.page_bytes)
    return names, ids, mids, want, lambda: RequestLineage(root_lineage(fp, b""), ids, mids, P), dev.page_bytes


def batched_reads(repeats, client):
    header("5. store reads of a 64-page chain", "batched (16/call) pages/s", "one get per page pages/s")
    for shape, label in (((16, 64), "4 KiB pages"), ((64, 1024), "256 KiB pages")):
        names, ids, mids, want, lineage, _ = published_chain(client, 64, shape, model=label)
        readers = [StoreTier(client, publish_async=False, deadline_s=None, batch_pages=b) for b in (16, 1)]

        def read(store):
            assert len(store.match(names, 0, ids, mids, lineage(), want)) == 64, store.counters
        ours = [best(lambda: read(readers[0]), 3) for _ in range(repeats)]
        base = [best(lambda: read(readers[1]), 3) for _ in range(repeats)]
        row(f"chain read + verify, {label}", ours, base, "pages/s", 64.0)


def mac_cost(repeats):
    header("6. store get + verify, 16 pages of 1 MiB (in-process store)", "keyed MAC pages/s", "checksum pages/s")
    shared = MemoryStore(1024)
    key = b"bench-deployment-key-0123456789ab"
    plain = published_chain(shared, 16, (256, 1024), model="plain")
    keyed = published_chain(shared, 16, (256, 1024), key=key, model="keyed")
    ours_t, base_t = StoreTier(shared, publish_async=False, deadline_s=None, key=key), \
        StoreTier(shared, publish_async=False, deadline_s=None)

    def read(store, chain):
        names, ids, mids, want, lineage, _ = chain
        assert len(store.match(names, 0, ids, mids, lineage(), want)) == 16, store.counters
    ours = [best(lambda: read(ours_t, keyed), 3) for _ in range(repeats)]
    base = [best(lambda: read(base_t, plain), 3) for _ in range(repeats)]
    row("get + verify", ours, base, "pages/s", 16.0)
    cost = [(o - b) / 16 * 1e6 for o, b in zip(ours, base)]
    print(f"{'':<44} MAC cost per 1 MiB page {spread(cost)} us")


def killed_master(deadline_s=0.05, dead_s=8.0, commit_while_dead=True):
    """Steady traffic (one admission every ~10 ms, each missing on the device and asking the store for a 6-page
    chain of 4 KiB pages) through a master that is killed after 2 s and restarted ``dead_s`` later. Requests commit
    (and publish) their pages, except while the master is dead with ``commit_while_dead=False``: then no put fails
    first and only the reads' deadline can mark the store down."""
    master = MooncakeMaster().start()
    client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
    store = StoreTier(client, deadline_s=deadline_s, probe_s=0.5)
    fp = Fingerprint(model="killed", page_size=P)
    cache = PrefixCache(PagePool(64, (16, 64), torch.float32), fp, evict_batch_pages=1,
                        tiers=TierStack(fp, store=store))
    rng = np.random.default_rng(0)
    work = [rng.integers(1, 30000, 6 * P + 1).astype(np.int32) for _ in range(8)]
    phases = {"master up": [], "master killed": [], "restarted": []}
    hits = {k: 0 for k in phases}
    try:
        start, i, restarted = time.monotonic(), 0, None
        while True:
            now = time.monotonic() - start
            if master.proc is not None and restarted is None and now > 2.0:
                master.stop()
            elif master.proc is None and now > 2.0 + dead_s:
                master.start()
                restarted = now
            phase = "master up" if now <= 2.0 else "master killed" if restarted is None else "restarted"
            cache.clear()
            ids = work[i % len(work)]
            t = time.perf_counter()
            state = cache.admit(i, ids)
            phases[phase].append(time.perf_counter() - t)
            hits[phase] += state.matched_tokens > 0
            if phase == "master killed" and not commit_while_dead:
                cache.abort(i)
                i += 1
                time.sleep(0.01)
                continue
            cache.grow(i, ids.size)
            cache.mark_computed(i, ids.size)
            cache.finish(i)
            i += 1
            if restarted is not None and (hits["restarted"] >= 20 or now > restarted + 30):
                break
            time.sleep(0.01)
        print(f"\n7. admission latency, store deadline {deadline_s * 1e3:.0f} ms, master killed {dead_s:.0f} s, "
              f"{'requests commit' if commit_while_dead else 'reads only'} while it is dead")
        print(f"{'phase':<16} {'admissions':>10} {'hit':>6} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for k, v in phases.items():
            ms = np.array(v) * 1e3
            print(f"{k:<16} {len(v):>10} {hits[k]:>6} {np.percentile(ms, 50):>8.2f} {np.percentile(ms, 99):>8.2f} "
                  f"{ms.max():>8.2f}")
        print(f"store counters: {store.counters}")
    finally:
        store.close()
        client.close()
        master.stop()


class Hogs:
    """``n`` processes that spin on a core each while the context is open: a loaded machine beside the tier."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.join()


def _spin():
    while True:
        pass


def availability_run(segment_bytes, seconds, step_s=0.05, lag=8, entry_bytes=64 << 10, kill_at=None, hogs=0,
                     master_flags=()):
    """One instance at the tier's defaults: every ``step_s`` it publishes a fresh entry and reads back the one it
    published ``lag`` steps before (a fresh read). A store smaller than 64 MiB is filled past its size first. With
    ``kill_at`` (seconds into the measured run) the master is killed and restarted 5 s later. Returns the steps,
    the fresh reads, their hits, the steps with the store up, the slowest step's store time and the tier's
    counters over the run."""
    master = MooncakeMaster(*master_flags).start()
    client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, segment_bytes, 32 << 20)
    store = StoreTier(client)
    body = np.random.default_rng(0).bytes(entry_bytes)

    def entry(i):
        key = f"mmcache/bench/{i:08d}"
        return key, key.encode() + body
    try:
        fill = 2 * segment_bytes // entry_bytes if segment_bytes < (64 << 20) else 0
        for i in range(fill):
            store.publish([entry(i)])
        store.flush(60)
        before = dict(store.counters)
        steps = reads = hits = up = 0
        worst = 0.0
        with Hogs(hogs):
            start = time.monotonic()
            killed = restarted = None
            while (now := time.monotonic() - start) < seconds:
                if kill_at is not None and killed is None and now > kill_at:
                    master.stop()
                    killed = now
                elif killed is not None and restarted is None and now > killed + 5.0:
                    master.start()
                    restarted = now
                i = fill + steps
                store.publish([entry(i)])
                if steps >= lag:
                    key, want = entry(i - lag)
                    t = time.perf_counter()
                    got = store.fetch([key])[0]
                    worst = max(worst, time.perf_counter() - t)
                    reads += 1
                    hits += got == want
                up += store.up
                steps += 1
                time.sleep(step_s)
        delta = {k: v - before.get(k, 0) for k, v in store.counters.items() if v != before.get(k, 0)}
        return steps, reads, hits, up, worst, delta
    finally:
        store.close()
        client.close()
        master.stop()


def availability(quick):
    """Section 8: each scenario against the store with room at the same rate."""
    seconds = 8.0 if quick else 20.0
    cores = os.cpu_count() or 1
    slow, fast = 0.05, 0.004  # a 16 MiB store of 64 KiB entries turns over in ~13 s and ~1 s
    print(f"\n8. tier availability and fresh-read hits at the tier's defaults (deadline 50 ms, probe 5 s), "
          f"{seconds:.0f} s each: a 64 KiB entry published every step, the one published 8 steps earlier read back; "
          f"the master's settings are its defaults (a read's lease 10 s) unless said")
    print(f"{'store':<58} {'steps':>6} {'up %':>6} {'reads':>6} {'hit %':>6} {'max ms':>7}  counters")
    runs = (("room (512 MiB), a put every 50 ms", dict(segment_bytes=512 << 20, step_s=slow)),
            ("full (16 MiB), a put every 50 ms", dict(segment_bytes=16 << 20, step_s=slow)),
            (f"full (16 MiB), a put every 50 ms, {cores} CPU hog(s)",
             dict(segment_bytes=16 << 20, step_s=slow, hogs=cores)),
            ("room (512 MiB), a put every 4 ms", dict(segment_bytes=512 << 20, step_s=fast)),
            ("full (16 MiB), a put every 4 ms", dict(segment_bytes=16 << 20, step_s=fast)),
            ("full (16 MiB), a put every 4 ms, master lease 200 ms", dict(
                segment_bytes=16 << 20, step_s=fast, master_flags=("--default_kv_lease_ttl=200",))),
            ("room, a put every 4 ms, master killed 1 s in for 5 s", dict(
                segment_bytes=512 << 20, step_s=fast, kill_at=1.0, seconds=max(seconds, 15.0))))
    for label, kw in runs:
        steps, reads, hits, up, worst, delta = availability_run(**{"seconds": seconds, **kw})
        print(f"{label:<58} {steps:>6} {100 * up / steps:>6.1f} {reads:>6} {100 * hits / max(reads, 1):>6.1f} "
              f"{worst * 1e3:>7.1f}  {delta}", flush=True)


def soak(seconds: float) -> None:
    """Section 9: section 8's full store beside CPU hogs, for ``seconds``."""
    cores = os.cpu_count() or 1
    print(f"\n9. soak: {seconds:.0f} s of section 8's full store (16 MiB, a put every 50 ms) beside {cores} CPU "
          f"hog(s), the tier at its defaults (deadline 50 ms, probe 5 s)")
    print(f"{'store':<58} {'steps':>6} {'up %':>6} {'reads':>6} {'hit %':>6} {'max ms':>7}  counters")
    steps, reads, hits, up, worst, delta = availability_run(segment_bytes=16 << 20, seconds=seconds, step_s=0.05,
                                                            hogs=cores)
    print(f"{'full (16 MiB), CPU hogs, ' + f'{seconds:.0f} s':<58} {steps:>6} {100 * up / steps:>6.1f} {reads:>6} "
          f"{100 * hits / max(reads, 1):>6.1f} {worst * 1e3:>7.1f}  {delta}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("batched", "mac", "killed", "availability", "soak"),
                    help="run one of the store sections alone (soak: only so)")
    ap.add_argument("--soak-s", type=float, default=600.0, help="the soak's length in seconds")
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 5
    if args.only == "soak":
        return soak(args.soak_s)
    if args.only:
        return only(args.only, repeats, args.quick)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, CUDA {torch.cuda.is_available()}; "
          f"median [min-max] over {repeats} repeats of best-of timings")
    host_bandwidth(repeats, 32)
    pinned_bandwidth(repeats, 32)
    store = store_bandwidth(repeats, 32)
    try:
        lookups(repeats, store[0] if store else None)
        if store:
            batched_reads(repeats, store[0])
    finally:
        if store:
            store[0].close()
            store[1].stop()
    all_miss(repeats, 200 if args.quick else 500)
    mac_cost(repeats)
    if store:
        killed_master()
        killed_master(commit_while_dead=False)
        availability(args.quick)


def only(section, repeats, quick=False):
    if section == "mac":
        return mac_cost(repeats)
    if section == "availability":
        return availability(quick)
    if section == "killed":
        killed_master()
        return killed_master(commit_while_dead=False)
    with MooncakeMaster() as master:
        client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 256 << 20, 128 << 20)
        try:
            batched_reads(repeats, client)
        finally:
            client.close()


if __name__ == "__main__":
    main()
