"""EncoderStore under threads: concurrent misses compute once, failures reach every waiter, a hammered pool stays
exact."""

import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from conftest import STORE_PB as PB
from conftest import assert_same_value as assert_same
from conftest import store_all_free as all_free
from conftest import store_floats as floats
from conftest import store_key as key
from conftest import wait_for
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError


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
