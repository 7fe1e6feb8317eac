"""EncoderStore on real pools and real tensors: bytes, ownership, eviction, single flight, validation, counters."""

import contextlib
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from digests import Digest
from mmcache.encoder_key import EncoderKey
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidRequest, PageOwnershipError
from mmcache.pool import PagePool

PB = 64  # page bytes in most tests: 16 float32 per page


def key(i=0, fp="vit@abc/bf16/cpu", modality="image", salt=b"", ids=None):
    return EncoderKey(bytes([i]) * 16, fp, modality, salt, ids)


def floats(n, seed=0, dtype=torch.float32):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_same(a, b):
    """Bit-exact equality of two values (tensors or containers of tensors), dtypes and container types included."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
        assert torch.equal(a, b) or (a.is_floating_point() or a.is_complex()) and a.isnan().any()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the other threads"
        time.sleep(0.001)


def all_free(store):
    return store.pool.num_free == store.pool.num_pages and not store.pool.counts.any()


# -- bytes in, same bytes out ----------------------------------------------------------------------------------------

VALUES = {
    "float32": floats(37),
    "bfloat16": floats(100, 1, torch.bfloat16).view(4, 25),
    "float16": floats(16, 2, torch.float16),  # exactly half a page
    "float64_page_multiple": floats(16, 3, torch.float64),  # exactly two pages
    "int64": torch.arange(-50, 50, dtype=torch.int64).view(10, 10),
    "int8": torch.arange(-128, 127, dtype=torch.int8),
    "bool": torch.rand(3, 7, generator=torch.Generator().manual_seed(4)) > 0.5,
    "0-d": torch.tensor(2.5),
    "0-d int": torch.tensor(-7, dtype=torch.int64),
    "empty": torch.zeros(0, 8),
    "non-contiguous": floats(60, 5).view(6, 10).t()[::2],
    "expanded": torch.arange(3.0).expand(4, 3),
    "complex64": torch.complex(floats(9, 6), floats(9, 7)),
    "nan/inf/-0": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0]),
    "tuple": (floats(20, 8, torch.bfloat16).view(4, 5), torch.ones(4, dtype=torch.int64)),
    "dict": {"prompt_embeds": floats(30, 9).view(1, 6, 5), "attention_mask": torch.tensor([[1, 1, 1, 0, 0, 0]]),
             "extra": [torch.tensor(True), (floats(3, 10, torch.float16),)]},
}


@pytest.mark.parametrize("name", list(VALUES))
def test_roundtrip_bit_exact(name):
    store = EncoderStore(4096, page_bytes=PB)
    value = VALUES[name]
    assert store.put(key(), value)
    got = store.get(key())
    assert_same(got, value)
    assert_same(store.get_or_compute(key(), lambda: pytest.fail("hit must not compute")).value, value)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 7), max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                              torch.bool, torch.float64]),
       page_bytes=st.sampled_from([1, 3, 16, 64, 100]), seed=st.integers(0, 2**16))
def test_roundtrip_any_shape_dtype_page_size(shape, dtype, page_bytes, seed):
    value = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    value = value.view(-1)[: value.numel() // dtype.itemsize * dtype.itemsize].view(dtype) if shape else value
    value = value.bool() if dtype == torch.bool else value
    store = EncoderStore(64 * 1024, page_bytes=page_bytes)
    assert store.put(key(), value)
    assert_same(store.get(key()), value)
    assert len(store.pool.counts.nonzero()[0]) == -(-value.numel() * value.element_size() // page_bytes)


def test_values_come_back_as_fresh_copies():
    store = EncoderStore(4096, page_bytes=PB)
    value = floats(40)
    original = value.clone()
    store.put(key(), value)
    value.mul_(0)  # the encoder reusing its output buffer
    first = store.get(key())
    assert_same(first, original)
    first.add_(1)  # request 1 scribbles over what it got
    second = store.get(key())
    assert_same(second, original)
    assert second.data_ptr() != first.data_ptr()
    for page in range(store.pool.num_pages):  # a returned tensor never aliases the pool
        assert not (store.pool.data[page].data_ptr() <= second.data_ptr() < store.pool.data[page].data_ptr() + PB)

    computed = store.get_or_compute(key(1), lambda: floats(40, 1)).value
    computed.zero_()  # the miss's caller mutates its value
    assert_same(store.get(key(1)), floats(40, 1))
    with store.pin(key(1)) as pin:
        pin.value.zero_()
        assert_same(pin.value, floats(40, 1))

    nested = {"e": floats(5, 2), "m": [torch.ones(3, dtype=torch.int64)]}
    store.put(key(2), nested)
    got = store.get(key(2))
    got["e"].zero_(), got["m"][0].zero_(), got["m"].append("junk")
    assert_same(store.get(key(2)), {"e": floats(5, 2), "m": [torch.ones(3, dtype=torch.int64)]})


# -- eviction, pins, bypass ------------------------------------------------------------------------------------------

def test_lru_eviction_order_and_counts():
    store = EncoderStore(4 * PB, page_bytes=PB)
    for i in range(4):
        assert store.put(key(i), floats(16, i))  # one page each: the pool is full
    assert store.pool.num_free == 0
    assert store.get(key(0)) is not None  # 0 becomes the most recent: order 1, 2, 3, 0
    assert store.put(key(4), floats(32, 4))  # needs two pages: evicts 1 and 2 as one batch
    assert [k in store for k in map(key, range(5))] == [True, False, False, True, True]
    s = store.stats().to_dict()
    assert (s["evictions"], s["evicted_bytes"], s["entries"], s["bytes_stored"]) == (2, 2 * PB, 3, 4 * PB)
    assert store.pin(key(3)) is not None  # pinning touches too: order 0, 4, 3
    assert store.put(key(5), floats(16, 5))
    assert key(0) not in store and key(3) in store


def test_pinned_entries_are_never_evicted_and_full_pins_bypass():
    store = EncoderStore(4 * PB, page_bytes=PB)
    for i in range(4):
        store.put(key(i), floats(16, i))
    pins = [store.pin(key(i)) for i in (0, 1, 2)]
    assert [int(c) for c in store.pool.counts] == [2, 2, 2, 1]
    assert store.put(key(9), floats(16, 9))  # only entry 3 is evictable
    assert key(3) not in store and all(key(i) in store for i in (0, 1, 2))
    assert not store.put(key(12), floats(32))  # two pages wanted, one evictable: bypassed, nothing evicted
    assert key(9) in store
    pins.append(store.pin(key(9)))
    before = store.pool.counts.copy()
    assert not store.put(key(10), floats(16, 10))  # no room: bypassed, nothing evicted, nothing raised
    assert_same(store.get_or_compute(key(11), lambda: floats(16, 11)).value, floats(16, 11))
    assert (store.pool.counts == before).all()
    s = store.stats().to_dict()
    assert (s["bypasses"], s["evictions"], s["entries"]) == (3, 1, 4)
    pins[0].release()
    pins[0].release()  # idempotent: never a second release of the pages
    with pytest.raises(PageOwnershipError):
        pins[0].value
    assert store.put(key(10), floats(16, 10)) and key(0) not in store
    for p in pins[1:]:
        p.release()
    store.clear()
    assert all_free(store)


def test_a_pin_outlives_replacement_and_clear():
    store = EncoderStore(8 * PB, page_bytes=PB)
    store.put(key(), floats(20, 1))
    with store.pin(key()) as pin:
        pages = pin.pages
        store.put(key(), floats(20, 2))  # replaced: the pinned bytes stay put
        store.clear()
        assert len(store) == 0 and store.stats().totals.bytes_stored == 0
        assert_same(pin.value, floats(20, 1))
        assert all(store.pool.counts[p] == 1 for p in pages)
    assert all_free(store)
    assert store.pin(key()) is None


def test_too_large_output_is_bypassed_with_one_warning(caplog):
    store = EncoderStore(4 * PB, page_bytes=PB)
    big = floats(65)  # 260 bytes > 256
    store.put(key(modality="audio", ids=[1]), floats(4))
    with caplog.at_level(logging.WARNING, logger="mmcache.encoder_store"):
        assert store.put(key(modality="audio", ids=[2]), big) is False
        assert_same(store.get_or_compute(key(1, modality="audio"), lambda: big).value, big)
    assert len(caplog.records) == 2
    assert all("audio" in r.getMessage() and "260" in r.getMessage() for r in caplog.records)
    s = store.stats().to_dict()
    assert (s["bypasses"], s["by_modality"]["audio"]["bypasses"], s["entries"]) == (2, 2, 0)
    assert key(modality="audio", ids=[1]) not in store  # the put replaced the colliding entry: no stale answer
    assert all_free(store)


# -- single flight ---------------------------------------------------------------------------------------------------

def run_together(n, call):
    """``call()`` on ``n`` threads released at once; returns results or exceptions in thread order."""
    barrier = threading.Barrier(n)

    def worker(_):
        barrier.wait()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(worker, range(n)))


def test_concurrent_misses_compute_once_and_get_private_copies():
    store, n, calls = EncoderStore(1 << 16, page_bytes=256), 8, []

    def encode():
        calls.append(threading.get_ident())
        wait_for(lambda: store.stats().totals.joins == n - 1)  # every other caller is waiting on this computation
        time.sleep(0.01)
        return {"emb": floats(300, 7), "mask": torch.ones(300, dtype=torch.bool)}

    results = run_together(n, lambda: store.get_or_compute(key(modality="text"), encode).value)
    assert len(calls) == 1
    expected = {"emb": floats(300, 7), "mask": torch.ones(300, dtype=torch.bool)}
    for r in results:
        assert_same(r, expected)
    assert len({r["emb"].data_ptr() for r in results}) == n
    results[0]["emb"].zero_()
    results[1]["emb"].fill_(3)
    assert_same(results[2], expected)
    assert_same(store.get(key(modality="text")), expected)
    s = store.stats().to_dict()
    assert (s["queries"], s["misses"], s["hits"], s["joins"]) == (n + 1, n, 1, n - 1)
    assert s["time_saved_s"] >= 0.01 and not store._flights


def test_failing_compute_reaches_every_waiter_and_stores_nothing():
    store, n, calls = EncoderStore(1 << 16, page_bytes=256), 6, []

    def broken():
        calls.append(1)
        wait_for(lambda: store.stats().totals.joins == n - 1)
        raise RuntimeError("CUDA out of memory (simulated)")

    errors = run_together(n, lambda: store.get_or_compute(key(), broken).value)
    assert len(calls) == 1
    assert all(e is errors[0] for e in errors) and isinstance(errors[0], RuntimeError)
    assert len(store) == 0 and all_free(store) and not store._flights
    assert_same(store.get_or_compute(key(), lambda: floats(10)).value, floats(10))  # a later call retries
    assert key() in store

    with pytest.raises(EncoderOutputError):  # a refused output is a failure too: raised, nothing stored
        store.get_or_compute(key(1), lambda: "not a tensor").value
    assert key(1) not in store and not store._flights


def test_in_flight_name_with_other_ids_is_not_joined():
    store, started, go = EncoderStore(1 << 16, page_bytes=256), threading.Event(), threading.Event()
    a, b = key(ids=[1, 2, 3]), key(ids=[1, 2, 4])

    def slow_a():
        started.set()
        assert go.wait(10)
        return floats(8, 1)

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(store.get_or_compute, a, slow_a)
        assert started.wait(10)
        assert_same(store.get_or_compute(b, lambda: floats(8, 2)).value, floats(8, 2))  # never a's value
        go.set()
        assert_same(fut.result().value, floats(8, 1))
    assert store.stats().totals.collisions == 1 and store.stats().totals.joins == 0
    assert_same(store.get(a), floats(8, 1))


def test_threads_hammering_a_small_pool_keep_values_and_counts_exact():
    store, keys = EncoderStore(8 * PB, page_bytes=PB), [key(i) for i in range(12)]

    def value(i):
        return floats(16 * (1 + i % 3), i)

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300):
            i, op = rng.randrange(len(keys)), rng.random()
            if op < 0.6:
                assert_same(store.get_or_compute(keys[i], lambda: value(i)).value, value(i))
            elif op < 0.8:
                got = store.get(keys[i])
                assert got is None or torch.equal(got, value(i))
            elif op < 0.95:
                with (store.pin(keys[i]) or contextlib.nullcontext()) as pin:
                    assert pin is None or torch.equal(pin.value, value(i))
            else:
                store.put(keys[i], value(i))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    expected = np.zeros(store.pool.num_pages, dtype=np.int64)
    for entry in store._entries.values():
        expected[entry.pages] += 1
    assert (store.pool.counts == expected).all() and not store._flights
    s = store.stats().to_dict()
    assert s["queries"] == s["hits"] + s["misses"] and s["evictions"] > 0
    store.clear()
    assert all_free(store)


# -- keys and validation ---------------------------------------------------------------------------------------------

def test_verifying_ids_mismatch_is_a_miss_and_a_collision():
    store = EncoderStore(4096, page_bytes=PB)
    prompt = key(modality="text", ids=[5, 6, 7])
    store.put(prompt, floats(12))
    assert store.get(key(modality="text", ids=[5, 6, 8])) is None
    assert store.get(key(modality="text")) is None  # no ids is not the same ids
    assert key(modality="text", ids=[5, 6, 8]) not in store
    assert store.pin(key(modality="text", ids=[5, 6])) is None
    assert_same(store.get(key(modality="text", ids=torch.tensor([5, 6, 7]))), floats(12))
    s = store.stats().to_dict()["by_modality"]["text"]
    assert (s["queries"], s["hits"], s["misses"], s["collisions"]) == (3, 1, 2, 3)
    other = key(modality="text", ids=np.array([9], dtype=np.int32))
    assert_same(store.get_or_compute(other, lambda: floats(3, 1)).value, floats(3, 1))  # replaces the colliding entry
    assert store.get(prompt) is None and store.get(other) is not None


def test_salt_fingerprint_and_modality_isolate():
    store = EncoderStore(4096, page_bytes=PB)
    store.put(key(), floats(4))
    for other in (key(salt=b"tenant-b"), key(fp="vit@def/bf16/cpu"), key(modality="audio"), key(1)):
        assert store.get(other) is None and other not in store
    assert store.stats().totals.collisions == 0


def test_key_normalisation_and_validation():
    assert EncoderKey(Digest("xxh3_128", b"\x01" * 16), "fp", "image") == key(1, fp="fp")
    assert key(ids=[1, 2]) == key(ids=torch.tensor([1, 2])) == key(ids=np.array([1, 2], dtype=np.uint8))
    for bad in (dict(digest=5), dict(digest=b""), dict(digest="abc"), dict(salt="s"), dict(modality=""),
                dict(fingerprint=["unhashable"]), dict(verify_ids=[0.5])):
        with pytest.raises(InvalidRequest):
            EncoderKey(**{"digest": b"d", "fingerprint": "fp", "modality": "image", **bad})


def test_changed_shape_or_dtype_is_refused_and_the_entry_kept():
    store = EncoderStore(4096, page_bytes=PB)
    store.put(key(), floats(12).view(3, 4))
    for wrong in (floats(12).view(4, 3), floats(12, dtype=torch.float16).view(3, 4), (floats(12).view(3, 4),)):
        with pytest.raises(EncoderOutputError, match="differs from the one stored"):
            store.put(key(), wrong)
    assert_same(store.get(key()), floats(12).view(3, 4))
    assert store.put(key(ids=[1]), floats(5))  # other ids: another input that collided, replaced not refused
    for junk in ("text", None, [torch.ones(2), 3], torch.ones(2).to_sparse(), torch.empty(2, device="meta")):
        with pytest.raises(EncoderOutputError):
            store.put(key(2), junk)
    assert key(2) not in store and store.stats().entries == 1


def test_expected_output_spec():
    store = EncoderStore(8192, page_bytes=PB, expect=((None, 8), torch.bfloat16))
    assert store.put(key(), floats(24, dtype=torch.bfloat16).view(3, 8))
    for wrong in (floats(24).view(3, 8), floats(24, dtype=torch.bfloat16).view(8, 3),
                  floats(24, dtype=torch.bfloat16), (floats(24, dtype=torch.bfloat16).view(3, 8),) * 2):
        with pytest.raises(EncoderOutputError, match="does not match the expected"):
            store.put(key(), wrong)
        with pytest.raises(EncoderOutputError):
            store.get_or_compute(key(1), lambda: wrong).value
    assert_same(store.get(key()), floats(24, dtype=torch.bfloat16).view(3, 8)) and key(1) not in store

    by_len = EncoderStore(8192, page_bytes=PB, expect=(
        lambda k: [(1, len(k.verify_ids) // 8, 4), (1, len(k.verify_ids) // 8)], [torch.float32, torch.int64]))
    t5 = key(modality="text", ids=[3, 4, 5])
    assert by_len.put(t5, (floats(12).view(1, 3, 4), torch.ones(1, 3, dtype=torch.int64)))
    with pytest.raises(EncoderOutputError):
        by_len.put(t5, (floats(16).view(1, 4, 4), torch.ones(1, 4, dtype=torch.int64)))


def test_constructor_and_shared_pool():
    pool = PagePool(8, (PB,), torch.uint8)
    held = pool.alloc(6)  # another owner of the same pool
    store = EncoderStore(pool=pool)
    assert store.capacity_bytes == 8 * PB and store.page_bytes == PB
    assert store.put(key(0), floats(16)) and store.put(key(1), floats(16))
    assert store.put(key(2), floats(16)) and key(0) not in store  # only its own entries are ever evicted
    assert not store.put(key(3), floats(40))  # three pages: the other owner's six are not the store's to take
    pool.release(held)
    store.clear()
    assert pool.num_free == 8
    for bad in (dict(capacity_bytes=PB - 1, page_bytes=PB), dict(capacity_bytes=PB, page_bytes=0),
                dict(capacity_bytes=None), dict(pool=PagePool(4, (PB,), torch.float32)), dict(pool=PagePool(4)),
                dict(pool=PagePool(4, (2, 32), torch.uint8)), dict(capacity_bytes=4096, pool=pool)):
        with pytest.raises(ValueError):
            EncoderStore(**bad)


def test_counters_by_modality_and_time_saved():
    store = EncoderStore(1 << 14, page_bytes=PB)

    def slow(v):
        time.sleep(0.02)
        return v

    store.get_or_compute(key(0, modality="image"), lambda: slow(floats(16))).value
    for _ in range(3):
        store.get_or_compute(key(0, modality="image"), lambda: pytest.fail("hit")).value
    store.get_or_compute(key(0, modality="speaker"), lambda: floats(4)).value
    assert store.get(key(5, modality="speaker")) is None
    s = store.stats().to_dict()
    img, spk = s["by_modality"]["image"], s["by_modality"]["speaker"]
    assert (img["queries"], img["hits"], img["misses"], img["bytes_stored"]) == (4, 3, 1, 64)
    assert 3 * 0.02 <= img["time_saved_s"] < 3 * 1.0
    assert (spk["queries"], spk["hits"], spk["misses"], spk["bytes_stored"], spk["time_saved_s"]) == (2, 0, 2, 16, 0)
    assert (s["queries"], s["bytes_stored"], s["entries"], len(store)) == (6, 80, 2, 2)
    store.clear()
    s = store.stats().to_dict()
    assert s["bytes_stored"] == 0 == s["by_modality"]["image"]["bytes_stored"] and s["queries"] == 6


def to(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to(v, device) for k, v in value.items()}
    return type(value)(to(v, device) for v in value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_pool_roundtrip_and_eviction(device="cuda"):
    store = EncoderStore(4 * 4096, page_bytes=4096, device=device)
    for i, value in enumerate(VALUES.values()):
        assert store.put(key(i), value if i % 2 else to(value, device))  # from host and from device memory
        assert_same(store.get(key(i)), to(value, device))
    store = EncoderStore(4 * 4096, page_bytes=4096, device=device)
    big = torch.randn(2048, device=device)  # two pages
    for i in range(3):
        store.put(key(i), big + i)
    assert key(0) not in store and torch.equal(store.get(key(2)), big + 2)
    assert store.stats().totals.evictions == 1 and store.pool.data.device.type == device


# -- the whole state machine -----------------------------------------------------------------------------------------

NUM_PAGES = 16
KEYS = [key(i, modality=m) for i, m in enumerate(["image", "image", "text", "audio", "speaker"])] + [
    key(9, modality="text", ids=[1, 2]), key(9, modality="text", ids=[1, 3])]  # one name, two inputs: collisions
DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]


def make_value(nel, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-1000, 1000, (nel,), generator=g).to(dtype) if dtype != torch.float32 \
        else torch.randn(nel, generator=g)


class StoreMachine(RuleBasedStateMachine):
    """Puts, gets, computes, pins, pressure and clears against a model: the last value put per key."""

    def __init__(self):
        super().__init__()
        self.store = EncoderStore(NUM_PAGES * PB, page_bytes=PB)
        self.last = {}  # key -> the value last put, or None when it cannot be stored any more
        self.version = {}  # key -> bumps at every put or clear; a pin made at the current version must still hit
        self.pins = []  # (pin, key, value, version)
        self.fresh = 0

    def _put(self, k, value):
        ok = self.store.put(k, value)
        self.last[k] = value if ok else None
        self._bump(k)
        return ok

    def _bump(self, k):
        for other in [k, *self.version]:  # a put replaces whatever entry has the key's name
            if other.name == k.name:
                self.version[other] = self.version.get(other, 0) + 1

    @rule(k=st.sampled_from(KEYS), nel=st.sampled_from([0, 1, 15, 16, 17, 64, 200, 300]),
          dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
    def put(self, k, nel, dtype, seed):
        value = make_value(nel, seed, dtype)
        stored = self.last.get(k)
        if k in self.store and (stored.shape, stored.dtype) != (value.shape, value.dtype):
            counts = self.store.pool.counts.copy()
            with pytest.raises(EncoderOutputError):
                self.store.put(k, value)
            assert (self.store.pool.counts == counts).all()
        else:
            ok = self._put(k, value)
            assert not ok or nel * value.element_size() <= NUM_PAGES * PB

    @rule(k=st.sampled_from(KEYS))
    def get(self, k):
        got = self.store.get(k)
        if got is None:
            assert k not in self.store
            self.last[k] = None
        else:
            assert_same(got, self.last[k])

    @rule(k=st.sampled_from(KEYS), nel=st.sampled_from([1, 16, 100]), seed=st.integers(0, 99))
    def get_or_compute(self, k, nel, seed):
        value = make_value(nel, seed, torch.float32)
        was = self.last.get(k) if k in self.store else None
        got = self.store.get_or_compute(k, lambda: value).value
        assert_same(got, value if was is None else was)
        if was is None:
            self.last[k] = value if k in self.store else None
            self._bump(k)

    @rule(k=st.sampled_from(KEYS))
    def pin(self, k):
        p = self.store.pin(k)
        assert (p is None) == (k not in self.store)
        if p is not None:
            self.pins.append((p, k, self.last[k], self.version[k]))

    @precondition(lambda self: len(self.store))
    @rule(i=st.integers(0, 100))
    def pin_stored(self, i):
        entries = list(self.store._entries.values())
        self.pin(entries[i % len(entries)].key)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 100))
    def unpin(self, i):
        p, *_ = self.pins.pop(i % len(self.pins))
        p.release()

    @rule(pages=st.integers(1, NUM_PAGES))
    def pressure(self, pages):
        self.fresh += 1
        self._put(key(100 + self.fresh % 100, modality="video"), make_value(pages * PB // 4, self.fresh,
                                                                             torch.float32))

    @rule()
    def clear(self):
        self.store.clear()
        self.last = {k: None for k in self.last}
        self.version = {k: v + 1 for k, v in self.version.items()}
        assert len(self.store) == 0 and self.store.stats().totals.bytes_stored == 0
        if not self.pins:
            assert all_free(self.store)

    @invariant()
    def owner_counts_match_entries_and_pins(self):
        pool, expected = self.store.pool, np.zeros(NUM_PAGES, dtype=np.int64)
        for entry in self.store._entries.values():
            expected[entry.pages] += 1
        for p, *_ in self.pins:
            expected[list(p.pages)] += 1
        assert (pool.counts == expected).all()
        assert pool.num_free + int((pool.counts > 0).sum()) == pool.num_pages
        assert sorted(pool._free) == sorted(np.flatnonzero(pool.counts == 0).tolist())  # no page freed twice
        assert self.store.stats().totals.bytes_stored == sum(e.nbytes for e in self.store._entries.values())

    @invariant()
    def pinned_entries_stay(self):
        for p, k, value, version in self.pins:
            assert_same(p.value, value)
            if self.version[k] == version:  # no put or clear since the pin: never evicted
                assert k in self.store

    def teardown(self):
        for p, *_ in self.pins:
            p.release()
        self.store.clear()
        assert all_free(self.store)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
