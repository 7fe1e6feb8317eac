"""EncoderStore on real pools and real tensors: bytes, ownership, eviction, single flight, validation, counters."""

import logging
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import STORE_PB as PB
from conftest import assert_same_value as assert_same
from conftest import store_all_free as all_free
from conftest import store_floats as floats
from conftest import store_key as key
from digests import Digest
from mmcache.encoder_key import EncoderKey
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidRequest, PageOwnershipError
from mmcache.pool import PagePool

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


def test_get_pinned_reads_and_pins_in_one_counted_lookup():
    store = EncoderStore(8 * PB, page_bytes=PB)
    assert store.get_pinned(key()) is None
    store.put(key(), floats(20, 1))
    value, pin = store.get_pinned(key())
    assert_same(value, floats(20, 1)) and all(store.pool.counts[p] == 2 for p in pin.pages)
    assert (store.stats().totals.queries, store.stats().totals.hits) == (2, 1)
    store.clear()
    assert_same(pin.value, floats(20, 1))
    pin.release()
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
                dict(capacity_bytes=None), dict(pool=PagePool(4)), dict(capacity_bytes=4096, pool=pool),
                dict(pool=PagePool(4), page_data=torch.zeros(3, 5, 8), page_dim=1),
                dict(pool=PagePool(4), page_data=torch.zeros(3, 4, 8).transpose(0, 2), page_dim=1)):
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
