"""The shared store never stalls a request (real Mooncake master on 127.0.0.1): under steady traffic whose every
admission misses on the device and asks the store, the master is killed mid-run; every admission stays within the
store's deadline plus scheduling slack, the store is marked down and probed in the background, and after a restart
lookups hit again. Plus the deadline and the batching on an in-process store whose reads block."""

import threading
import time

import numpy as np
import pytest
import torch

from mmcache import Fingerprint, HostPagePool, PagePool, PrefixCache
from mmcache.errors import InvalidRequest
from mmcache.tiers import EncoderTiers, HostTier, MemoryStore, StoreTier, TierStack, mooncake, stack
from mooncake_master import MooncakeMaster
from tier_traffic import complete

P = 4
WHY = mooncake.available()
needs_mooncake = pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}")
DEADLINE = 0.1
SLACK = 0.4  # a loaded, shared 2-core VM: scheduling, the device work of an admission, GIL hand-offs


def prompts(n, pages=6):
    rng = np.random.default_rng(7)
    return [rng.integers(1, 1000, pages * P + 1).tolist() for _ in range(n)]


def serve_once(cache, rid, tokens, commit=True):
    """One request: admit (timed), compute and commit what missed (publishing it), finish; or abort."""
    t = time.perf_counter()
    state = cache.admit(rid, tokens)
    took = time.perf_counter() - t
    if not commit:
        cache.abort(rid)
        return took, state.matched_tokens
    complete(cache, rid, tokens, state)
    return took, state.matched_tokens


@pytest.mark.slow
@needs_mooncake
def test_a_master_killed_under_traffic_never_stalls_an_admission_and_a_restart_hits_again():
    with MooncakeMaster() as master:
        client = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 64 << 20, 32 << 20)
        store = StoreTier(client, deadline_s=DEADLINE, probe_s=0.3)
        fp = Fingerprint(model="faults", page_size=P)
        cache = PrefixCache(PagePool(64, (P,), torch.float32), fp, evict_batch_pages=1,
                            tiers=TierStack(fp, store=store))
        try:
            work = prompts(8)
            for i, tokens in enumerate(work):
                serve_once(cache, f"warm{i}", tokens)
            assert store.flush(30) and store.counters["published_pages"] == 8 * 6
            phases = {"up": [], "dead": [], "restarted": []}
            hits_after_restart = 0
            start, i = time.monotonic(), 0
            while True:
                now = time.monotonic() - start
                if now > 1.0 and master.proc is not None and not phases["dead"]:
                    master.stop()  # killed mid-run
                    killed = now
                phase = "up" if not phases["dead"] and master.proc is not None else (
                    "dead" if master.proc is None else "restarted")
                if phase == "dead" and now > killed + 7.0:  # past Mooncake's ~4.4 s stalls, twice
                    master.start()
                    restarted = now
                    continue
                cache.clear()  # the device forgets: every admission asks the store
                # nothing published while dead: no failed put marks the store down first, only a late read can
                took, matched = serve_once(cache, f"r{i}", work[i % len(work)], commit=phase != "dead")
                phases[phase].append(took)
                i += 1
                if phase == "restarted":
                    hits_after_restart += matched > 0
                    if hits_after_restart >= 3 or now > restarted + 25:
                        break
                time.sleep(0.01)
            worst = {k: max(v) for k, v in phases.items()}
            assert all(v < DEADLINE + SLACK for v in worst.values()), (worst, store.counters)
            assert len(phases["dead"]) > 50 and store.counters["late"] >= 1, store.counters
            assert store.counters["marked_down"] >= 1 and store.counters["skipped_late_read"] > 0, store.counters
            assert store.counters["skipped"] > 0 and store.counters["probes"] > 0
            assert hits_after_restart >= 3, store.counters
        finally:
            store.close()
            client.close()


class SlowStore(MemoryStore):
    """An in-process store whose reads block while ``stall`` is set, counting its calls."""

    def __init__(self):
        super().__init__(1024)
        self.stall, self.calls = threading.Event(), []

    def get_many(self, keys):
        self.calls.append(len(keys))
        while self.stall.is_set():
            time.sleep(0.01)
        return super().get_many(keys)


def test_a_blocking_store_costs_one_deadline_then_nothing_and_reads_come_in_batches():
    """A read that blocks costs its lookup the deadline; later lookups skip the store at once while it is still in
    flight, and once it has been stuck ``stall_s`` the store is marked down, then up again by the prober."""
    shared = SlowStore()
    fp = Fingerprint(model="slow", page_size=P)

    def cache(store):
        return PrefixCache(PagePool(64, (P,), torch.float32), fp, evict_batch_pages=1,
                           tiers=TierStack(fp, store=store))

    writer = StoreTier(shared, publish_async=False, deadline_s=None)
    a = cache(writer)
    tokens = prompts(1, pages=10)[0]
    serve_once(a, "a", tokens)
    reader = StoreTier(shared, deadline_s=0.2, batch_pages=4, probe_s=0.2, stall_s=0.5)
    b = cache(reader)
    shared.calls.clear()  # a's own lookup read once
    try:
        took, matched = serve_once(b, "b", tokens)
        assert matched == 10 * P and shared.calls == [4, 4, 2]  # the chain read in batches of 4
        shared.stall.set()
        b.clear()
        took, matched = serve_once(b, "late", tokens)
        assert matched == 0 and 0.2 <= took < 0.2 + SLACK and reader.counters["late"] == 1
        assert reader.up  # one late read is not an outage
        b.clear()
        took, matched = serve_once(b, "behind", tokens)
        assert matched == 0 and took < 0.1 and reader.counters["skipped_late_read"] == 1  # not queued behind it
        deadline = time.monotonic() + 10
        while reader.up and time.monotonic() < deadline:  # still in flight past stall_s: marked down
            b.clear()
            serve_once(b, "stalled", tokens)
            time.sleep(0.05)
        assert not reader.up and reader.counters["marked_down"] == 1 and reader.counters["late"] == 1
        b.clear()
        took, matched = serve_once(b, "down", tokens)
        assert matched == 0 and took < 0.1 and reader.counters["skipped"] >= 1  # marked down: not asked
        shared.stall.clear()
        deadline = time.monotonic() + 10
        while not reader.up and time.monotonic() < deadline:  # the background prober marks it up
            time.sleep(0.05)
        b.clear()
        assert reader.up and serve_once(b, "again", tokens)[1] == 10 * P
    finally:
        shared.stall.clear()  # a read still blocked would hold close() up
        reader.close()


def test_store_tier_arguments_are_checked():
    with pytest.raises(InvalidRequest):
        StoreTier(MemoryStore(1), deadline_s=0, publish_async=False)
    with pytest.raises(InvalidRequest):
        StoreTier(MemoryStore(1), batch_pages=0, publish_async=False)
    with pytest.raises(InvalidRequest):
        StoreTier(MemoryStore(1), key=b"short", publish_async=False)


class RacingStore(MemoryStore):
    """While a lookup reads it (outside the cache's lock), another request commits the same prefix."""

    def __init__(self):
        super().__init__(1024)
        self.during_read = None

    def get_many(self, keys):
        if self.during_read is not None:
            hook, self.during_read = self.during_read, None
            hook()
        return super().get_many(keys)


def test_a_prefix_committed_while_the_store_is_read_keeps_the_index_closed_under_parents():
    shared = RacingStore()
    fp = Fingerprint(model="race", page_size=P)
    tokens = prompts(1, pages=6)[0]
    serve_once(PrefixCache(PagePool(32, (P,), torch.float32), fp,
                           tiers=TierStack(fp, store=StoreTier(shared, publish_async=False, deadline_s=None))),
               "a", tokens)
    store = StoreTier(shared, deadline_s=1.0, publish_async=False)
    b = PrefixCache(PagePool(32, (P,), torch.float32), fp, tiers=TierStack(fp, store=store))
    try:
        def commit_meanwhile():  # on the reader thread, while "b" waits outside the lock; "x" computes its own
            store._down = True   # pages (its lookup skips the store: the one reader is busy reading for "b")
            serve_once(b, "x", tokens)
            store._down = False
        shared.during_read = commit_meanwhile
        state = b.admit("b", tokens)
        assert state.matched_tokens == 6 * P
        index = b.index
        assert all(index.indexed[p] for p in state.page_indices)  # it holds the pages "x" indexed, not copies
        longer = tokens + prompts(1, pages=3)[0][:2 * P]
        b.abort("b")
        serve_once(b, "c", longer)
        v = index.tier_view()
        for page in np.flatnonzero(index.indexed):
            assert v.parent[page] == -1 or index.indexed[v.parent[page]]
        assert len(index) == 8
    finally:
        store.close()


class PendingCopy:
    """Stands in for the CUDA event of an asynchronous host-to-device copy (``stack.copy_up`` on CUDA): the copy is
    made at once, and the event says it landed only once waited on."""

    def __init__(self):
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.landed = True


def test_pages_a_hit_gives_up_are_freed_only_after_its_copy_up_lands(monkeypatch):
    def copy_up(src, src_pages, dst, dst_pages):
        stack.copy_pages(src, src_pages, dst, dst_pages)
        return PendingCopy()

    monkeypatch.setattr(stack, "copy_up", copy_up)
    shared, fp = RacingStore(), Fingerprint(model="race-host", page_size=P)
    base = prompts(1, pages=6)[0]
    writer = PrefixCache(PagePool(32, (P,), torch.float32), fp,
                         tiers=TierStack(fp, store=StoreTier(shared, publish_async=False, deadline_s=None)))
    serve_once(writer, "w", base)                                 # the store holds base's 6 pages
    pool = PagePool(16, (P,), torch.float32)
    store = StoreTier(shared, deadline_s=1.0, publish_async=False)
    b = PrefixCache(pool, fp, evict_batch_pages=1,
                    tiers=TierStack(fp, host=HostTier(HostPagePool.like(pool, 8), P), store=store))
    try:
        serve_once(b, "a", base[:4 * P + 1])                      # 4 pages on b's device...
        serve_once(b, "o", prompts(1, pages=15)[0][1:])           # ...evicted to b's host tier by an unrelated one

        def commit_meanwhile():  # while "b" reads pages 4-5 from the store, "x" takes the same prefix (from the host)
            store._down = True
            serve_once(b, "x", base)
            store._down = False
        shared.during_read = commit_meanwhile
        state = b.admit("b", base)
        assert state.matched_tokens == 6 * P and state.fetch is not None and not state.fetch.ready
        assert all(b.index.indexed[p] for p in state.page_indices)  # b holds x's indexed pages, not its own copies
        fresh, free = state.fetch.host_pages + state.fetch.store_pages, pool.num_free
        assert fresh >= 2 and state.fetch.host_pages >= 1
        state.fetch.wait()
        assert pool.num_free == free + fresh                      # b's fresh pages, freed once the copy landed
        b.finish("b")
    finally:
        store.close()


def test_a_store_marked_down_drops_and_counts_what_either_kind_would_publish_reading_none_of_it():
    """``StoreTier.publishing``: while the store is down a KV page batch and an encoder entry are dropped and counted
    before anything of them is read (here they are None), and so is a put reaching the publisher."""
    store = StoreTier(MemoryStore(8), publish_async=False, deadline_s=None, probe_s=3600)
    try:
        store._mark_down()  # the prober would try it in an hour
        TierStack(Fingerprint(model="down", page_size=P), store=store).publish(None, [1, 2, 3], [0, 1, 2], None,
                                                                                None, None, b"")
        EncoderTiers(store=store).publish(None)
        store.publish([("mmcache/k", b"v")])
        assert store.counters["publish_dropped"] == 3 + 1 + 1 and not store.client.get("mmcache/k")
        assert (store.kinds["kv"]["publish_dropped"], store.kinds["encoder"]["publish_dropped"]) == (3 + 1, 1)
    finally:
        store.close()
