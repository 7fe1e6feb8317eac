"""Encoder entries in the tiers (in-process stores): an evicted entry spills to the host tier and comes back bit-equal,
a device miss goes down the tiers as one batch before the encoder runs (single flight kept), a corrupted or forged
store entry is a counted miss (with a key, even one whose plain checksum was recomputed), forced digest collisions
never return a wrong value, a slow store costs one deadline and never holds the pool's lock, and fingerprints without
a process-independent form are refused by a tiered store."""

import threading
import time

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import assert_same_value, store_key, wait_for
from mmcache import EncoderKey, EncoderStore, Fingerprint, PagePool, PrefixCache
from mmcache.encoder_key import stable_bytes
from mmcache.errors import InvalidRequest
from mmcache.pool import HostPagePool
from mmcache.tiers import EncoderHostTier, EncoderTiers, HostTier, MemoryStore, StoreTier, TierStack, encoder_entry
from mmcache.tiers.page_format import MAC_BYTES

PB = 256  # device page bytes
KEY = b"deployment-key-0123456789abcdef"
SLACK = 0.4  # a loaded, shared 2-core VM


def values():
    """Outputs of every shape the store takes: trees, dtypes, a 0-dim and an empty tensor, NaN bits."""
    g = torch.Generator().manual_seed(3)
    nan = torch.randn(6, generator=g)
    nan[2] = float("nan")
    return [torch.randn(20, generator=g),
            torch.randn(3, 5, generator=g).to(torch.bfloat16),
            (torch.arange(7), torch.tensor([True, False, True])),
            {"a": torch.randn(4, generator=g).half(), "b": [torch.arange(9, dtype=torch.uint8),
                                                           torch.randn(2, generator=g, dtype=torch.complex64)]},
            torch.tensor(2.5, dtype=torch.float64),
            torch.empty(0, 4),
            nan]


def tiered(pages=2, host_pages=64, shared=None, key=None, deadline_s=None, **kw):
    host = EncoderHostTier(HostPagePool(host_pages, (PB,), torch.uint8)) if host_pages else None
    store = StoreTier(shared, publish_async=False, deadline_s=deadline_s, key=key, **kw) if shared is not None else None
    return EncoderStore(pages * PB, PB, tiers=EncoderTiers(host=host, store=store)), host, store


def never(_indices):
    raise AssertionError("the encoder ran for a key a tier holds")


def lookup(store, key, value):
    got = store.get_or_compute_many([key], lambda idx: [value])[0]
    assert_same_value(got.value, value)
    return got.source


def test_an_evicted_entry_spills_to_the_host_and_comes_back_bit_equal():
    s, host, _ = tiered(pages=2)
    vals = values()
    for i, v in enumerate(vals):
        s.put(store_key(i), v)
    t = s.stats().totals
    assert t.evictions == len(vals) - len(s) and t.host_spilled == t.evictions == len(host)
    sources = []
    for _ in range(3):  # each read back up evicts others: entries go down and up again and again
        for i, v in enumerate(vals):
            got = s.get_or_compute_many([store_key(i)], never)[0]
            assert_same_value(got.value, v)
            sources.append(got.source)
    t = s.stats().totals
    assert set(sources) == {"store", "host"} and t.host_hits == sources.count("host") and t.host_rejected == 0
    # inclusive: an entry read back up keeps its host copy, so evicting it again copies nothing (the empty tensor
    # holds no page: it is never evicted)
    assert t.evictions > 2 * len(vals) and t.host_spilled == len(host) == len(vals) - 1
    assert s.get(store_key(99)) is None and s.stats().totals.host_misses == 1


def test_a_value_put_again_replaces_the_host_copy_of_the_older_one():
    """put, spill, put anew, spill: the host tier holds the newer value, not the one it held first (a spill finds a
    key held and only refreshes it, so the put must drop the older copy); a bypassed put drops it too."""
    s, host, _ = tiered(pages=2)
    old, new = torch.zeros(100), torch.ones(100)  # two pages each: one entry fills the pool
    s.put(store_key(0), old)
    s.put(store_key(1), torch.full((100,), 2.0))  # evicts key 0 to the host
    assert len(host) == 1
    s.put(store_key(0), new)  # evicts key 1; the host's copy of key 0 is the older value: dropped
    s.put(store_key(1), torch.full((100,), 2.0))  # evicts key 0 again: the newer value spills
    assert_same_value(s.get_or_compute_many([store_key(0)], never)[0].value, new)
    s.put(store_key(1), torch.full((100,), 3.0))  # drops key 1's older host copy; key 0 back down to the host
    assert len(host) == 1
    assert not s.put(store_key(0), torch.zeros(10_000))  # larger than the pool: bypassed, and the host's copy dropped
    assert len(host) == 0 and s.get(store_key(0)) is None


def test_misses_go_down_the_tiers_as_one_batch_then_one_sub_batch_is_computed():
    class Counting(MemoryStore):
        def __init__(self):
            super().__init__(64)
            self.reads = []

        def get_many(self, keys):
            self.reads.append(len(keys))
            return super().get_many(keys)

    shared = Counting()
    v = [torch.full((8,), float(i)) for i in range(6)]
    a, _, _ = tiered(pages=8, shared=shared)
    a.put(store_key(2), v[2])  # published: instance b finds it in the store
    b, host, _ = tiered(pages=1, shared=shared)
    b.put(store_key(1), v[1])
    b.put(store_key(0), v[0])  # evicts 1 to b's host tier
    shared.reads.clear()
    calls = []

    def compute(indices):
        calls.append(indices)
        return [v[[0, 1, 2, 3, 4, 0][i]] for i in indices]

    keys = [store_key(i) for i in (0, 1, 2, 3, 4, 0)]
    got = b.get_or_compute_many(keys, compute)
    assert [g.source for g in got] == ["store", "host", "shared", "computed", "computed", "store"]
    assert calls == [[3, 4]] and shared.reads == [3]  # one store read for what the host missed; one sub-batch
    for g, i in zip(got, (0, 1, 2, 3, 4, 0)):
        assert torch.equal(g.value, v[i])
    t = b.stats().totals
    assert (t.hits, t.misses, t.host_hits, t.host_misses, t.store_hits, t.store_misses) == (1, 4, 1, 3, 1, 2)
    pinned = b.get_or_compute_many([store_key(2)], never, pin=True)[0]  # a tier hit is pinned like any other
    assert pinned.source in ("store", "shared") and pinned.pin is not None
    pinned.pin.release()


def test_one_host_pool_holds_kv_pages_and_encoder_entries_and_evicts_the_coldest_of_both():
    P = 64  # KV pages of 64 float32: 256 bytes, the host pool's page
    hp = HostPagePool(8, (P,), torch.float32)
    fp = Fingerprint(model="shared-host", page_size=P)
    kv_pool = PagePool(3, (P,), torch.float32)
    kv_host = HostTier(hp, P)
    cache = PrefixCache(kv_pool, fp, evict_batch_pages=1, tiers=TierStack(fp, host=kv_host))
    enc_host = EncoderHostTier(hp)
    enc = EncoderStore(2 * PB, PB, tiers=EncoderTiers(host=enc_host))
    ones = [torch.full((60,), float(i)) for i in range(4)]  # 240 bytes: one device page, two host pages each
    for i, v in enumerate(ones):
        enc.put(store_key(i), v)  # each put evicts the one before the last to the host
    assert len(enc_host) == 2 and hp.num_free == 4

    def run(rid, ids):
        cache.admit(rid, ids)
        cache.grow(rid, len(ids))
        cache.mark_computed(rid, len(ids))
        cache.finish(rid)

    for rid in range(4):  # 2 full KV pages indexed each; each run evicts the one before's to the host
        run(rid, list(range(1 + 1000 * rid, 1000 * rid + 2 * P + 2)))
    # the third spill found the host pool full: the coldest host pages of either kind went, encoder entry 0's
    assert len(kv_host) == 6 and len(enc_host) == 1 and hp.num_free == 0
    assert enc.get(store_key(0)) is None and torch.equal(enc.get(store_key(1)), ones[1])
    assert int((hp.counts > 0).sum()) + hp.num_free == hp.num_pages


def test_one_store_tier_serves_kv_pages_and_encoder_entries_of_one_pool():
    P = 64
    fp = Fingerprint(model="one-node", page_size=P)
    shared = MemoryStore(64)

    def node():
        pool = PagePool(16, (P,), torch.float32)  # one pool per node: KV pages and encoder outputs on it
        tier = StoreTier(shared, publish_async=False, deadline_s=1.0)
        kv = PrefixCache(pool, fp, evict_batch_pages=1, tiers=TierStack(fp, store=tier))
        return kv, EncoderStore(pool=pool, tiers=EncoderTiers(store=tier)), tier

    kv, enc, tier = node()
    ids = list(range(1, 2 * P + 2))
    kv.admit("a", ids)
    kv.grow("a", len(ids))
    kv.mark_computed("a", len(ids))
    kv.finish("a")
    enc.put(store_key(1), torch.arange(100.0))
    assert (tier.counters["published_pages"], tier.counters["published_entries"]) == (2, 1)
    tier.close()
    kv, enc, tier = node()
    try:
        assert kv.admit("b", ids).matched_tokens == 2 * P
        assert enc.get_or_compute_many([store_key(1)], never)[0].source == "shared"
        assert (tier.counters["hit_pages"], tier.counters["batches"]) == (2, 2)  # one read each: the chain, the entry
    finally:
        tier.close()


def test_a_corrupted_store_entry_or_one_filed_under_another_key_is_a_counted_miss():
    shared = MemoryStore(64)
    a, _, _ = tiered(pages=8, shared=shared, host_pages=0)
    key = EncoderKey(b"d" * 16, ("vit", "split"), "image", b"t1", [1, 2, 3])
    value = values()[3]
    a.put(key, value)
    name = encoder_entry.entry_key(key)
    good = bytes(shared._data[name])

    def read(k=key, payload=None):
        if payload is not None:
            shared._data[encoder_entry.entry_key(k)] = payload
        b, _, _ = tiered(pages=8, shared=shared, host_pages=0)
        return b.get_or_compute_many([k], lambda idx: [values()[0]])[0].source, b.stats().totals

    assert read()[0] == "shared"
    bad = bytearray(good)
    bad[-3] ^= 0x10  # one bit of the data
    source, t = read(payload=bytes(bad))
    assert source == "computed" and (t.store_rejected, t.store_hits) == (1, 0)
    for other in (EncoderKey(b"e" * 16, ("vit", "split"), "image", b"t1", [1, 2, 3]),  # each field of the key
                  EncoderKey(b"d" * 16, ("vit", "other"), "image", b"t1", [1, 2, 3]),
                  EncoderKey(b"d" * 16, ("vit", "split"), "image", b"t2", [1, 2, 3]),
                  EncoderKey(b"d" * 16, ("vit", "split"), "audio", b"t1", [1, 2, 3]),
                  EncoderKey(b"d" * 16, ("vit", "split"), "image", b"t1", [1, 2, 4]),
                  EncoderKey(b"d" * 16, ("vit", "split"), "image", b"t1")):
        source, t = read(other, good)  # a's entry filed under another key's store name
        assert source == "computed" and t.store_rejected == 1, other
    for junk in (b"x", good[:40], good[:-1], good + b"\0"):
        assert read(payload=junk)[1].store_rejected == 1


def forge(payload: bytes, keyed: bool) -> bytes:
    """Change the entry's data and recompute the plain checksum, as a writer without the key can (an old MAC
    stays)."""
    tail = MAC_BYTES if keyed else 0
    body, mac = bytearray(payload[:len(payload) - tail]), payload[len(payload) - tail:]
    body[-4:] = b"\xff\xff\xff\x7f"
    at = encoder_entry._SUM_AT
    body[at:at + 8] = bytes(8)
    body[at:at + 8] = xxhash.xxh3_64_intdigest(bytes(body)).to_bytes(8, "little")
    return bytes(body) + mac


def test_a_forger_who_recomputes_the_checksum_is_refused_with_a_key_and_served_without_one():
    key = store_key(1)
    value = torch.arange(8, dtype=torch.int32)
    for mac_key in (None, KEY):
        shared = MemoryStore(64)
        a, _, _ = tiered(shared=shared, key=mac_key, host_pages=0)
        a.put(key, value)
        name = encoder_entry.entry_key(key)
        shared._data[name] = forge(bytes(shared._data[name]), keyed=mac_key is not None)
        b, _, _ = tiered(shared=shared, key=mac_key, host_pages=0)
        got = b.get_or_compute_many([key], lambda idx: [value])[0]
        if mac_key is None:  # the documented trust model: a keyless store trusts every writer
            assert got.source == "shared" and int(got.value[-1]) == 0x7fffffff
        else:
            assert got.source == "computed" and torch.equal(got.value, value)
            assert b.stats().totals.store_mac_failures == 1
    shared = MemoryStore(64)
    for writer_key, reader_key in ((None, KEY), (KEY, b"another-key-0123456789abcdef")):  # keyless, or the wrong key
        a, _, _ = tiered(shared=shared, key=writer_key, host_pages=0)
        a.put(key, value)
        b, _, _ = tiered(shared=shared, key=reader_key, host_pages=0)
        assert b.get(key) is None and b.stats().totals.store_mac_failures == 1  # refused, and removed: one store,
        assert encoder_entry.entry_key(key) not in shared._data                   # one key


@settings(max_examples=40)
@given(st.data())
def test_any_corruption_of_an_entry_is_a_miss_never_a_wrong_value(data):
    mac_key = data.draw(st.sampled_from([None, KEY]))
    shared = MemoryStore(8)
    a, _, _ = tiered(shared=shared, key=mac_key, host_pages=0)
    key, value = store_key(5, ids=[7, 8]), values()[data.draw(st.integers(0, len(values()) - 1))]
    a.put(key, value)
    name = encoder_entry.entry_key(key)
    payload = bytearray(shared._data[name])
    for at in data.draw(st.lists(st.integers(0, len(payload) - 1), min_size=1, max_size=3, unique=True)):
        payload[at] ^= data.draw(st.integers(1, 255))  # distinct places: the payload differs from the original
    shared._data[name] = bytes(payload)
    b, _, _ = tiered(shared=shared, key=mac_key, host_pages=0)
    assert b.get(key) is None
    t = b.stats().totals
    assert t.store_rejected + t.store_mac_failures == 1


def collide(ids: int) -> tuple[EncoderKey, torch.Tensor]:
    """One forced digest collision: every key has the same name, its ids and value (and shape) differ."""
    return store_key(9, ids=[ids]), torch.arange(ids + 1, dtype=torch.float32) * (ids + 1)


@settings(max_examples=40)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.sampled_from(["lookup", "get", "clear"])),
                min_size=1, max_size=24))
def test_under_forced_digest_collisions_no_tier_returns_a_wrong_value(ops):
    shared = MemoryStore(16)
    instances = [tiered(pages=2, host_pages=4, shared=shared)[0] for _ in range(2)]
    for n in range(4):  # filler entries: lookups evict and spill the colliding ones
        instances[n % 2].put(store_key(20 + n), torch.ones(40))
    for which, ids, op in ops:
        s = instances[which]
        key, want = collide(ids)
        if op == "clear":
            s.clear()
        elif op == "get":
            got = s.get(key)
            assert got is None or torch.equal(got, want)
        else:
            assert torch.equal(s.get_or_compute_many([key], lambda idx: [want])[0].value, want)
        s.put(store_key(20 + ids), torch.ones(40))  # churn the device store
    for s in instances:
        t = s.stats().totals
        assert t.host_hits + t.store_hits <= t.misses


class SlowStore(MemoryStore):
    """An in-process store whose reads block while ``stall`` is set, counting its calls."""

    def __init__(self):
        super().__init__(64)
        self.stall, self.reading = threading.Event(), threading.Event()

    def get_many(self, keys):
        self.reading.set()
        while self.stall.is_set():
            time.sleep(0.005)
        return super().get_many(keys)


def test_a_slow_store_read_waits_outside_the_lock_keeps_single_flight_and_costs_one_deadline():
    shared = SlowStore()
    writer, _, _ = tiered(pages=8, shared=shared, host_pages=0)
    v = torch.arange(16, dtype=torch.float32)
    writer.put(store_key(1), v)
    s, _, store = tiered(pages=8, shared=shared, host_pages=0, deadline_s=2.0, probe_s=0.2)
    try:
        shared.stall.set()
        out, calls = {}, []

        def ask(who):
            out[who] = s.get_or_compute_many([store_key(1)], lambda idx: calls.append(idx) or [v])[0]

        leader = threading.Thread(target=ask, args=("leader",))
        leader.start()
        wait_for(shared.reading.is_set)
        joiner = threading.Thread(target=ask, args=("joiner",))
        joiner.start()
        t = time.perf_counter()
        s.put(store_key(2), torch.ones(4))  # the pool's lock is free while the leader waits on the store
        assert torch.equal(s.get(store_key(2)), torch.ones(4)) and time.perf_counter() - t < SLACK
        assert leader.is_alive()
        shared.stall.clear()
        leader.join(5)
        joiner.join(5)
        assert (out["leader"].source, out["joiner"].source, calls) == ("shared", "joined", [])
        assert torch.equal(out["joiner"].value, v)

        s.clear()
        shared.reading.clear()
        shared.stall.set()
        store.deadline_s = 0.2
        t = time.perf_counter()
        got = s.get_or_compute_many([store_key(1)], lambda idx: [v])[0]
        took = time.perf_counter() - t
        assert got.source == "computed" and 0.2 <= took < 0.2 + SLACK and store.up  # one deadline: a miss, not down
        s.clear()
        t = time.perf_counter()
        assert s.get_or_compute_many([store_key(1)], lambda idx: [v])[0].source == "computed"
        assert time.perf_counter() - t < 0.1 and store.counters["skipped_late_read"] == 1  # not queued behind it
        assert s.stats().totals.store_misses == 2
        shared.stall.clear()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the late read ends (if it stalled past stall_s: the prober)
            s.clear()
            if s.get_or_compute_many([store_key(1)], lambda idx: [v])[0].source == "shared":
                break
            time.sleep(0.05)
        s.clear()
        assert s.get_or_compute_many([store_key(1)], never)[0].source == "shared"
    finally:
        shared.stall.clear()
        store.close()


def test_an_entry_unlike_expect_is_rejected_and_computed():
    shared = MemoryStore(8)
    a, _, _ = tiered(shared=shared, host_pages=0)
    a.put(store_key(1), torch.ones(6))
    store = StoreTier(shared, publish_async=False, deadline_s=None)
    b = EncoderStore(2 * PB, PB, expect=((4,), torch.float32), tiers=EncoderTiers(store=store))
    got = b.get_or_compute_many([store_key(1)], lambda idx: [torch.zeros(4)])[0]
    assert got.source == "computed" and b.stats().totals.store_rejected == 1


def test_fingerprints_without_a_stable_form_are_refused_by_a_tiered_store_before_anything_changes():
    odd = EncoderKey(b"d" * 16, object(), "image")
    s, host, _ = tiered(shared=MemoryStore(8))
    before = s.stats()
    for call in (lambda: s.put(odd, torch.ones(2)), lambda: s.get(odd), lambda: s.get_pinned(odd),
                 lambda: s.get_or_compute_many([store_key(1), odd], lambda idx: [torch.ones(2)] * len(idx))):
        with pytest.raises(InvalidRequest):
            call()
    assert s.stats() == before and len(s) == 0 and store_key(1) not in s
    from encoders.vision import CachedVisionEncoder
    with pytest.raises(InvalidRequest):  # a wrapper knows its fingerprint: refused at its construction
        CachedVisionEncoder(torch.nn.Linear(2, 2), None, s, fingerprint=object())
    untiered = EncoderStore(2 * PB, PB)  # without tiers any hashable still names an output in this process
    assert untiered.put(odd, torch.ones(2)) and untiered.get(odd) is not None
    forms = [stable_bytes(v) for v in ("1", b"1", 1, True, 1.0, None, ("1",), ("a", "b"), ("ab",), (("a",), "b"))]
    assert None not in forms and len(set(forms)) == len(forms)
    assert stable_bytes(("vit", np.int64(1))) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_store_spills_to_pinned_host_pages_and_serves_tier_hits_on_its_device():
    host = EncoderHostTier(HostPagePool(64, (PB,), torch.uint8, pin_memory=True))
    shared = MemoryStore(16)
    tiers = EncoderTiers(host=host, store=StoreTier(shared, publish_async=False, deadline_s=None))
    s = EncoderStore(2 * PB, PB, device="cuda", tiers=tiers)
    vals = [v.cuda() for v in values() if isinstance(v, torch.Tensor)]
    for i, v in enumerate(vals):
        s.put(store_key(i), v)
    for i, v in enumerate(vals):
        got = s.get_or_compute_many([store_key(i)], never)[0]
        assert got.value.device.type == "cuda"
        assert_same_value(got.value, v)
    b = EncoderStore(2 * PB, PB, device="cuda", tiers=EncoderTiers(store=StoreTier(shared, publish_async=False,
                                                                                   deadline_s=None)))
    got = b.get_or_compute_many([store_key(0)], never)[0]
    assert got.source == "shared" and got.value.device.type == "cuda" and torch.equal(got.value, vals[0])
