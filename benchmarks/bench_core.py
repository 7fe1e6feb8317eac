"""Core figures: page-name throughput, 1,000-page lookup, allocation/teardown cost, eviction, metadata bytes.

Each row carries a baseline measured in the same run and the ratio to it. Run: python benchmarks/bench_core.py

The index's and the pool's rows run under ``CORE_POLICY`` (``lru``, whose key is the tick), so they time the core;
what each eviction policy adds is in the rows "eviction policy" (the default's duel serves sampled pools on every
lookup and release: at a pool of about 1,000 pages every page is sampled).
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import sys
import time
from unittest import mock

import numpy as np
import torch
from timing import best  # benchmarks/timing.py, beside this script

from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache, page_names
from mmcache.eviction import POLICIES
from mmcache.names import chain, chain_root
from mmcache.prefix_index import PrefixIndex
from mmcache.reclaim import coldest_of


def vllm_style_names(tokens: list[int], page: int) -> list[bytes]:
    """vLLM's default block hash: SHA-256 over a pickle of (parent, token tuple, extra keys), one per full block."""
    parent, out = b"", []
    for i in range(len(tokens) // page):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * page:(i + 1) * page]), None))).digest()
        out.append(parent)
    return out


def python_loop_lookup(index: dict, page_tokens: dict, counts: list, names, tokens: list[int], page: int):
    """nano-vllm style: per block, probe the hash table, compare the token list, bump the ref count."""
    hit = []
    for i, name in enumerate(names):
        p = index.get(name)
        if p is None or page_tokens[p] != tokens[i * page:(i + 1) * page]:
            break
        counts[p] += 1
        hit.append(p)
    return hit


CORE_POLICY = "lru"


def evicting_request(fp: Fingerprint, P: int, n_pages: int) -> float:
    """Median seconds of a request of 9 pages (admit, grow, finish) through a full pool of ``n_pages`` cached pages,
    each evicting what it is short of (``evict_batch_pages=1``)."""
    pool = PagePool(n_pages, eviction=CORE_POLICY)
    cache = PrefixCache(pool, fp, evict_batch_pages=1)
    rng, i, times = np.random.default_rng(1), 0, []
    while pool.num_free >= 9:  # fill the pool with cached pages
        p = rng.integers(0, 32000, size=8 * P + 1, dtype=np.int32)
        cache.admit(i, p)
        cache.grow(i, p.size)
        cache.finish(i, computed_tokens=p.size)
        i += 1
    for _ in range(200):
        p = rng.integers(0, 32000, size=8 * P + 1, dtype=np.int32)
        t0 = time.perf_counter()
        cache.admit(i, p)
        cache.grow(i, p.size)
        cache.finish(i, computed_tokens=p.size)
        times.append(time.perf_counter() - t0)
        i += 1
    assert cache.stats().eviction_batches >= 200
    return float(np.median(times))


def evicting_put(n_entries: int, page: int = 4096) -> float:
    """Median seconds of a put into an ``EncoderStore`` full of ``n_entries`` one-page entries, each evicting one."""
    store = EncoderStore(capacity_bytes=n_entries * page, page_bytes=page, eviction=CORE_POLICY)
    value, times = torch.zeros(page // 4), []
    for i in range(n_entries + 200):
        key = EncoderKey(digest=i.to_bytes(8, "little"), fingerprint="bench", modality="image")
        t0 = time.perf_counter()
        store.put(key, value)
        if i >= n_entries:
            times.append(time.perf_counter() - t0)
    assert store.stats().totals.evictions >= 200
    return float(np.median(times))


def sessions_replay(fp: Fingerprint, policy: str) -> tuple[float, float]:
    """Seconds per page looked up, and the share of pages hit, of 24 sessions taking turns, each re-sending its
    history 4 pages longer, through a pool that holds a quarter of their last turn (the knee: lookups, hits, commits
    and evictions every request) under ``policy``."""
    P = fp.page_size
    pool = PagePool(24 * 4 * 3, eviction=policy)
    cache = PrefixCache(pool, fp, evict_batch_pages=1)
    rng = np.random.default_rng(2)
    history = [rng.integers(0, 32000, size=4 * P, dtype=np.int32) for _ in range(24)]
    looked = hit = 0
    t0 = time.perf_counter()
    for turn in range(12):
        for s in range(24):
            p = np.concatenate((history[s], [1])).astype(np.int32)
            rid = (turn, s)
            hit += cache.admit(rid, p).matched_tokens // P
            looked += (p.size - 1) // P
            cache.grow(rid, p.size)
            cache.mark_computed(rid, p.size)
            cache.finish(rid)
            history[s] = np.concatenate((history[s], rng.integers(0, 32000, size=4 * P, dtype=np.int32)))
    return (time.perf_counter() - t0) / looked, hit / looked


def long_hit(fp: Fingerprint, P: int, policy: str, repeat: int) -> float:
    """Best seconds per page of admitting (and aborting) a request whose 1,000 pages are all cached, under
    ``policy``."""
    rng = np.random.default_rng(3)
    p = rng.integers(0, 32000, size=1000 * P + 1, dtype=np.int32)
    names = page_names(fp, p)
    cache = PrefixCache(PagePool(1008, eviction=policy), fp)
    cache.admit("warm", p, names=names)
    cache.grow("warm", p.size)
    cache.mark_computed("warm", p.size)
    cache.finish("warm")
    rid = iter(range(10 ** 9))

    def once():
        i = next(rid)
        cache.admit(i, p, names=names)
        cache.abort(i)
    return best(once, repeat) / 1000


class PolicyClock:
    """Times every call a pool makes to its policy, summed per request (``begin`` starts one): the longest is the most
    one admission or teardown waited on the policy's upkeep."""

    def __init__(self, policy):
        self.per_request, self._now = [], 0.0
        for hook in ("looked_up", "released", "evicted", "key", "keys"):
            setattr(policy, hook, self._timed(getattr(policy, hook)))

    def _timed(self, call):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return call(*args, **kw)
            finally:
                self._now += time.perf_counter() - t
        return timed

    def begin(self) -> None:
        self.per_request.append(self._now)
        self._now = 0.0


def policy_upkeep(policy: str, pages: int = 20_000, requests: int = 20_000,
                  traced: bool = False) -> tuple[float, float, float]:
    """Agent traffic through a ``pages``-page pool of 16-token pages under ``policy``: 256 sessions in turn, each
    re-sending its history 4 pages longer and starting over after 200 pages, one request at a time (lookups, commits,
    evictions every request). Returns the longest time one request spent in the policy and the 99.9th percentile;
    ``traced``, the bytes per page of the pool the policy's state holds at the end instead (allocations made in
    ``mmcache/eviction`` and still alive: tracemalloc, which slows every call, so never in a timed run)."""
    import tracemalloc
    fp16 = Fingerprint("bench/upkeep@0", page_size=16)
    if traced:
        tracemalloc.start()
    pool = PagePool(pages, eviction=policy)
    clock = PolicyClock(pool.policy)
    cache = PrefixCache(pool, fp16)
    rng = np.random.default_rng(4)
    history = [rng.integers(0, 32000, size=64, dtype=np.int32) for _ in range(256)]
    for i in range(requests):
        s = i % 256
        history[s] = (np.concatenate((history[s], rng.integers(0, 32000, size=64, dtype=np.int32)))
                      if history[s].size < 200 * 16 else rng.integers(0, 32000, size=64, dtype=np.int32))
        p = np.concatenate((history[s], [1])).astype(np.int32)
        clock.begin()
        cache.admit(i, p)
        cache.grow(i, p.size)
        cache.mark_computed(i, p.size)
        cache.finish(i)
    clock.begin()
    if traced:
        held = sum(stat.size for stat in tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*mmcache/eviction/*")]).statistics("filename"))
        tracemalloc.stop()
        return held / pages, 0.0
    times = np.asarray(clock.per_request[1:])
    return float(times.max()), float(np.percentile(times, 99.9))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--page-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4_000_000, help="tokens hashed for the name benchmark")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    P = args.page_size
    fp = Fingerprint("bench/model@0", page_size=P)
    rng = np.random.default_rng(0)
    rows = []

    # 1. names: tokens per second on one core
    toks = rng.integers(0, 32000, size=args.tokens, dtype=np.int32)
    root = chain_root(fp)
    t_ours = best(lambda: chain(root, toks, P), args.repeat)
    base_toks = toks[: args.tokens // 8].tolist()
    t_base = best(lambda: vllm_style_names(base_toks, P), max(1, args.repeat // 2)) * 8
    rows.append(("page names, tokens/s (P=%d)" % P, f"{args.tokens / t_ours / 1e6:,.0f} M/s",
                 f"{args.tokens / t_base / 1e6:,.1f} M/s (SHA-256 of pickle, vLLM default)", t_base / t_ours))
    t_list = best(lambda: page_names(fp, base_toks), args.repeat) * 8
    rows.append(("  same, from a Python list", f"{args.tokens / t_list / 1e6:,.0f} M/s", "(includes list->int32)",
                 t_base / t_list))

    # 2. lookup: a 1,000-page hit (probe + verify + retain)
    k = 1000
    pool = PagePool(k + 8, eviction=CORE_POLICY)
    cache = PrefixCache(pool, fp)
    prompt = rng.integers(0, 32000, size=k * P + 1, dtype=np.int32)
    names = page_names(fp, prompt)
    cache.admit("seed", prompt, names=names)
    cache.grow("seed", prompt.size)
    cache.mark_computed("seed", prompt.size)
    cache.finish("seed")
    state = {"i": 0}

    def hit_once():
        state["i"] += 1
        st = cache.admit(state["i"], prompt, names=names)
        assert st.matched_tokens == k * P
        return st

    def lookup_and_release():
        t0 = time.perf_counter()
        hit_once()
        dt = time.perf_counter() - t0
        cache.abort(state["i"])
        return dt

    t_hit = min(lookup_and_release() for _ in range(max(20, args.repeat)))
    plist = prompt.tolist()
    index = {n: i for i, n in enumerate(names)}
    page_tokens = {i: plist[i * P:(i + 1) * P] for i in range(k)}
    counts = [1] * k
    t_loop = best(lambda: python_loop_lookup(index, page_tokens, counts, names, plist, P), max(20, args.repeat))
    rows.append((f"lookup, {k}-page hit (probe+verify+retain)", f"{t_hit * 1e6:,.0f} us",
                 f"{t_loop * 1e6:,.0f} us (per-page Python loop, nano-vllm style)", t_loop / t_hit))

    # 3. allocation and teardown, per page
    n_req, req_pages = 200, 64
    pool = PagePool(n_req * req_pages, eviction=CORE_POLICY)
    cache = PrefixCache(pool, fp)
    prompts = [rng.integers(0, 32000, size=req_pages * P, dtype=np.int32) for _ in range(n_req)]
    pre = [page_names(fp, p) for p in prompts]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        cache.admit(i, p, names=pre[i])
        cache.grow(i, p.size)
    t_alloc = (time.perf_counter() - t0) / (n_req * req_pages)
    t0 = time.perf_counter()  # pages are indexed when marked written; finish releases the request's owners
    for i, p in enumerate(prompts):
        cache.mark_computed(i, p.size)
        cache.finish(i)
    t_fin = (time.perf_counter() - t0) / (n_req * req_pages)
    raw = PagePool(n_req * req_pages)
    t0 = time.perf_counter()
    held = [raw.alloc(req_pages) for _ in range(n_req)]
    t_raw_alloc = (time.perf_counter() - t0) / (n_req * req_pages)
    t0 = time.perf_counter()
    for h in held:
        raw.release(h)
    t_raw_free = (time.perf_counter() - t0) / (n_req * req_pages)
    rows.append(("admit+grow, per page (no hit)", f"{t_alloc * 1e6:.2f} us",
                 f"{t_raw_alloc * 1e6:.2f} us (bare pool alloc)", t_raw_alloc / t_alloc))
    rows.append(("mark_computed (indexes all pages) + finish, per page", f"{t_fin * 1e6:.2f} us",
                 f"{t_raw_free * 1e6:.2f} us (bare pool release)", t_raw_free / t_fin))

    # 4. eviction under saturation: distinct requests through a full pool
    pool = PagePool(2048, eviction=CORE_POLICY)
    cache = PrefixCache(pool, fp)
    t0 = time.perf_counter()
    for i in range(2000):
        p = rng.integers(0, 32000, size=8 * P + 5, dtype=np.int32)
        cache.admit(("sat", i), p)
        cache.grow(("sat", i), p.size + 40)
        cache.mark_computed(("sat", i), p.size + 40)
        cache.finish(("sat", i), rng.integers(0, 32000, size=40))
    t_sat = (time.perf_counter() - t0) / 2000
    s = cache.stats()
    rows.append(("saturated pool: evicted pages / eviction batch", f"{s.evicted_pages / s.eviction_batches:.1f}",
                 f"{s.shortfall_pages / s.eviction_batches:.2f} pages short per batch; "
                 f"{s.eviction_batches} batches for 2000 requests", None))
    rows.append(("saturated pool: per request (admit..finish, 9 pages)", f"{t_sat * 1e6:.0f} us", "", None))

    # 4b. eviction sized to the shortfall (evict_batch_pages=1, what the continuous-batching allocator does) in full
    # pools of growing size: the index's heap against the pass over the pool it replaced, same state, same requests;
    # 4c. the same for the encoder store: a put that evicts in full stores of growing entry counts
    cases = [(PrefixIndex, n, "full pool of {:,} pages: request (9 pages) that evicts", "pool",
              lambda n=n: evicting_request(fp, P, n)) for n in (1024, 16384, 131072)]
    cases += [(EncoderStore, n, "full encoder store of {:,} entries: put that evicts", "entries",
               lambda n=n: evicting_put(n)) for n in (256, 2048, 8192)]
    for cache_class, n, label, what, measure in cases:
        heap = measure()
        with mock.patch.object(cache_class, "coldest", lambda cache, k: coldest_of(cache.eviction_candidates(), k)):
            scan = measure()
        rows.append((label.format(n), f"{heap * 1e6:.0f} us",
                     f"{scan * 1e6:.0f} us (a pass over the {what} per eviction)", scan / heap))

    # 4d. each eviction policy's cost against lru's: a replay at the knee (admission, commits, evictions), and a
    # 1,000-page hit (admit + abort: the lookup counted, the chain keyed twice); runs interleaved, best of 3 each
    timed: dict[str, list[float]] = {}
    for _ in range(3):
        for policy in POLICIES:
            timed.setdefault(policy, []).append(sessions_replay(fp, policy)[0])
            timed.setdefault(("hit", policy), []).append(long_hit(fp, P, policy, max(10, args.repeat)))
    for policy in POLICIES:
        if policy != "lru":
            ours, base = min(timed[policy]), min(timed["lru"])
            rows.append((f"eviction policy {policy}: per page looked up, sessions at the knee", f"{ours * 1e6:.2f} us",
                         f"{base * 1e6:.2f} us (lru, same run; hit {100 * sessions_replay(fp, 'lru')[1]:.0f}% "
                         f"vs {100 * sessions_replay(fp, policy)[1]:.0f}%)", base / ours))
            ours, base = min(timed[("hit", policy)]), min(timed[("hit", "lru")])
            rows.append((f"eviction policy {policy}: 1,000-page hit, per page", f"{ours * 1e6:.2f} us",
                         f"{base * 1e6:.2f} us (lru, same run)", base / ours))

    # 4e. each policy's upkeep at 20,000 pages: the longest a request waited on the policy (its upkeep never pauses an
    # admission), and the state it keeps per page of the pool
    upkeep = {policy: policy_upkeep(policy) for policy in POLICIES}
    state = {policy: policy_upkeep(policy, traced=True)[0] for policy in POLICIES}
    for policy, (longest, p999) in upkeep.items():
        rows.append((f"eviction policy {policy}: longest wait on the policy, 20,000 pages", f"{longest * 1e3:.2f} ms",
                     f"{upkeep['lru'][0] * 1e3:.2f} ms (lru); p99.9 {p999 * 1e3:.2f} ms", None))
        rows.append((f"eviction policy {policy}: state per page of the pool", f"{state[policy]:.0f} B",
                     f"{state['lru']:.0f} B (lru)", None))

    # 5. metadata bytes per page: the index arrays plus the dict entry of an indexed page
    ix = PrefixCache(PagePool(4096, eviction=CORE_POLICY), fp).index
    arrays = sum(a.nbytes for a in (ix._name, ix._tokens, ix._media_lo, ix._media_hi, ix._parent, ix._salt,
                                    ix._depth, ix._tick, ix._key, ix._indexed, ix.pool._counts)) / 4096
    name, page = (1 << 63) + 12345, 4000
    per_entry = sys.getsizeof(name) + sys.getsizeof(page) + 8 * 3 * 1.5 + 8 * 1.5  # key, value, dict slot at 2/3 load
    rows.append((f"metadata per {P}-token page", f"{(arrays + per_entry) / 1024:.2f} KB",
                 f"arrays {arrays:.0f} B + index entry ~{per_entry:.0f} B", None))

    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  {'mmcache':>14}  {'baseline (same run)':<52} ratio")
    for name, ours, base, ratio in rows:
        print(f"{name:<{width}}  {ours:>14}  {base:<52} {'' if ratio is None else f'{ratio:,.1f}x'}")


if __name__ == "__main__":
    main()
