"""A shared tier that stays up (real Mooncake master on 127.0.0.1, default master settings): a put the full store
refuses makes room by removing the tier's own oldest entries, or is skipped and counted, never an outage; a forged
or corrupt entry is removed once a reader refuses it, so the next publish of the real page stores it and it is
served, and a put counts as published only when it was stored; one slow read is a miss, not an outage; store calls
that keep failing do mark the store down."""

import threading
import time

import pytest
import torch

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.names import page_names
from mmcache.tiers import MemoryStore, StoreTier, TierStack, mooncake
from mmcache.tiers.page_format import page_key
from mooncake_master import MooncakeMaster
from tier_traffic import complete

P = 4
WHY = mooncake.available()
needs_mooncake = pytest.mark.skipif(WHY is not None, reason=f"Mooncake Store cannot run here: {WHY}")
SLACK = 0.4  # a loaded, shared 2-core VM: scheduling, GIL hand-offs


@pytest.fixture
def client():
    """A Mooncake client mounting 16 MiB (the least Mooncake mounts), the whole store, on a master with its default
    settings."""
    with MooncakeMaster() as master:
        c = mooncake.MooncakeClient(master.rpc_address, master.metadata_url, 16 << 20, 16 << 20)
        yield c
        c.close()


def entry(i: int, size: int = 512 << 10) -> tuple[str, bytes]:
    key = f"mmcache/health/{i:04d}"
    return key, key.encode().ljust(size, b"\x01")


@pytest.mark.slow
@needs_mooncake
def test_a_put_the_full_store_refuses_makes_room_or_is_a_counted_skip_never_an_outage(client):
    store, other = StoreTier(client), StoreTier(client)
    try:
        n = 96  # 48 MiB of 512 KiB entries into a 16 MiB store, as fast as the publisher goes
        store.publish([entry(i) for i in range(n)], kind="encoder")
        assert store.flush(60)
        c = store.counters
        assert store.up and c["publish_dropped"] == 0, c
        assert c["room_removed"] > 0 and c["published_entries"] + c["publish_full"] == n, c  # its oldest made room
        assert c["marked_down"] == 0, c
        got = store.fetch([entry(i)[0] for i in range(n)])  # every entry read holds a lease: the master keeps it
        assert all(g in (b"", entry(i)[1]) for i, g in enumerate(got)) and got[-1] == entry(n - 1)[1]
        other.publish([entry(n, 15 << 20)], kind="encoder")  # no room, and none of its own to free
        assert other.flush(60)
        o = other.counters
        assert other.up and o["publish_dropped"] == 0, o
        assert (o["publish_full"], o["published_entries"], o["marked_down"]) == (1, 0, 0), o
        deadline = time.monotonic() + 20
        i, fresh = n + 1, 0
        while fresh < 5 and time.monotonic() < deadline:  # room again: fresh entries are stored and read back
            store.publish([entry(i)], kind="encoder")
            assert store.flush(30)
            fresh += store.fetch([entry(i)[0]])[0] == entry(i)[1]
            i += 1
        assert fresh == 5 and store.up and store.counters["marked_down"] == 0, store.counters
    finally:
        store.close()
        other.close()


def caches(client, model: str):
    fp = Fingerprint(model=model, page_size=P)

    def cache():
        return PrefixCache(PagePool(8, (P,), torch.float32), fp, evict_batch_pages=1,
                           tiers=TierStack(fp, store=StoreTier(client)))
    return fp, cache


@pytest.mark.slow
@needs_mooncake
def test_a_refused_entry_is_removed_and_the_next_publish_of_the_real_page_is_stored_and_served(client):
    tokens = list(range(1, 2 * P + 2))  # two full pages
    fp, cache = caches(client, "forged")
    assert client.put(page_key(page_names(fp, tokens)[1]), b"corrupt" * 64) in ("stored", True)  # page 1, first
    writer, reader = cache(), cache()
    try:
        complete(writer, "w", tokens, writer.admit("w", tokens))  # its lookup misses page 0 and never reads page 1
        w = writer.tiers.store
        assert w.flush(30) and w.counters["published_pages"] == 1, w.counters  # page 1's put stored nothing
        assert w.counters["publish_exists"] == 1
        state = reader.admit("r", tokens)
        assert state.matched_tokens == P  # page 0 served, page 1 refused
        r = reader.tiers.store
        assert r.flush(30) and r.counters["rejected"] == 1 and r.counters["refused_removed"] == 1, r.counters
        reader.abort("r")
        writer.clear()
        complete(writer, "w2", tokens, writer.admit("w2", tokens))  # the real page 1 published again: stored
        assert w.flush(30) and w.counters["published_pages"] == 2, w.counters
        reader.clear()
        state = reader.admit("r2", tokens)
        assert state.matched_tokens == 2 * P and float(reader.pool.data[state.page_indices[1]][0]) == 1.0
        assert r.counters["rejected"] == 1 and r.up and w.up
    finally:
        writer.tiers.store.close()
        reader.tiers.store.close()


class SlowOnce:
    """The tier's client with one read held back ``delay`` seconds when ``slow`` is set (a loaded machine's slow
    call); everything else goes straight to Mooncake."""

    def __init__(self, client, delay: float):
        self.client, self.delay, self.slow = client, delay, threading.Event()

    def get_many(self, keys):
        if self.slow.is_set():
            self.slow.clear()
            time.sleep(self.delay)
        return self.client.get_many(keys)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.mark.slow
@needs_mooncake
def test_one_slow_read_is_a_miss_not_an_outage(client):
    tokens = list(range(1, 3 * P + 2))
    fp, cache = caches(client, "slow")
    writer = cache()
    complete(writer, "w", tokens, writer.admit("w", tokens))
    assert writer.tiers.store.flush(30)
    slow = SlowOnce(client, 0.0)
    store = StoreTier(slow, stall_s=30.0)  # only the failure rate may mark it down here
    reader = PrefixCache(PagePool(8, (P,), torch.float32), fp, evict_batch_pages=1, tiers=TierStack(fp, store=store))
    try:
        t = time.perf_counter()
        assert reader.admit("base", tokens).matched_tokens == 3 * P
        baseline = time.perf_counter() - t
        reader.abort("base")
        store.deadline_s = max(0.1, 10 * baseline)  # well above what a read takes here now
        slow.delay = 3 * store.deadline_s
        slow.slow.set()
        reader.clear()
        t = time.perf_counter()
        assert reader.admit("slow", tokens).matched_tokens == 0
        took = time.perf_counter() - t
        assert store.deadline_s <= took < store.deadline_s + SLACK and store.counters["late"] == 1
        assert store.up
        hit, deadline = 0, time.monotonic() + 20
        while not hit and time.monotonic() < deadline:  # the slow read ends; lookups hit again, never marked down
            reader.clear()
            state = reader.admit("after", tokens)
            hit = state.matched_tokens
            reader.abort("after")
            time.sleep(0.02)
        assert hit == 3 * P and store.up and store.counters["marked_down"] == 0, store.counters
    finally:
        store.close()
        writer.tiers.store.close()


class FailingStore(MemoryStore):
    """An in-process store whose every read fails at once."""

    def get_many(self, keys):
        raise OSError("the store answers with errors")


def test_reads_that_keep_failing_mark_the_store_down_one_does_not():
    store = StoreTier(FailingStore(8), probe_s=3600, down_failures=3, publish_async=False)
    try:
        for failed in range(1, 4):
            assert store.fetch(["mmcache/x"]) == [b""]
            assert store.counters["read_errors"] == failed and store.up == (failed < 3)
        assert store.counters["marked_down"] == 1 and store.fetch(["mmcache/x"]) == [b""]
        assert store.counters["skipped"] == 1 and store.counters["read_errors"] == 3  # down: not asked
    finally:
        store.close()


def test_failures_are_a_rate_over_the_window_not_a_count_since_start():
    now = [0.0]
    store = StoreTier(FailingStore(8), probe_s=3600, down_failures=2, down_rate=0.5, window_s=10.0,
                      publish_async=False, clock=lambda: now[0])
    try:
        store.fetch(["mmcache/x"])  # one failure...
        now[0] = 11.0  # ...out of the window before the next
        store.fetch(["mmcache/x"])
        assert store.up and store.counters["read_errors"] == 2
        now[0] = 12.0
        store.fetch(["mmcache/x"])
        assert not store.up
    finally:
        store.close()
