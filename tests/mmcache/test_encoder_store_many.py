"""``EncoderStore.get_or_compute_many``: the batch form of single flight, on the store's one in-flight table. A batch
of mixed hits and misses computes its misses in one call; concurrent callers of the single and the batch form on
overlapping keys run each key's encoder once; failures reach every waiter and leave nothing behind."""

import random
import threading
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import STORE_PB as PB
from conftest import assert_same_value as assert_same
from conftest import store_all_free as all_free
from conftest import store_floats as floats
from conftest import store_key as key
from conftest import wait_for
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError, InvalidRequest


def value(i):
    return {"emb": floats(20, i), "n": torch.tensor([i])}


def counting(calls):
    """A ``compute_missing`` over ``keys`` that records each key index it computes."""
    def compute(keys):
        def run(indices):
            calls.extend(keys[i].digest[0] for i in indices)
            return [value(keys[i].digest[0]) for i in indices]
        return run
    return compute


def test_mixed_batch_computes_its_misses_in_one_call_with_private_copies():
    store = EncoderStore(1 << 16, page_bytes=PB)
    store.put(key(1), value(1))
    keys = [key(1), key(2), key(3), key(2), key(1)]
    batches = []
    got = store.get_or_compute_many(keys, lambda idx: batches.append(list(idx)) or [value(keys[i].digest[0])
                                                                                    for i in idx])
    assert batches == [[1, 2]]  # the first use of each miss, one call
    assert [g.source for g in got] == ["store", "computed", "computed", "joined", "store"]
    for k, g in zip(keys, got):
        assert_same(g.value, value(k.digest[0]))
    assert len({g.value["emb"].data_ptr() for g in got}) == len(keys)
    s = store.stats().totals
    assert (s.queries, s.hits, s.misses, s.joins) == (3, 1, 2, 1) and not store._flights
    assert [g.pin for g in got] == [None] * 5 and store.pool.counts[store.pool.counts > 0].max() == 1


def test_pins_one_per_use_until_released():
    store = EncoderStore(1 << 16, page_bytes=PB)
    store.put(key(1), value(1))
    got = store.get_or_compute_many([key(1), key(2), key(1)], lambda idx: [value(2)], pin=True)
    assert all(g.pin is not None for g in got)
    assert store.pool.counts[list(got[0].pin.pages)].tolist() == [3, 3]  # the store + two uses of key(1)
    for g in got:
        g.pin.release()
    assert set(store.pool.counts[store.pool.counts > 0].tolist()) == {1}
    store.clear()
    assert all_free(store)


def test_bad_input_refused_before_any_state_changes():
    store = EncoderStore(1 << 16, page_bytes=PB)
    with pytest.raises(InvalidRequest):
        store.get_or_compute_many([key(1), "not a key"], lambda idx: pytest.fail("must not compute"))
    assert store.stats().totals.queries == 0 and not store._flights
    with pytest.raises(EncoderOutputError):  # one value for two misses
        store.get_or_compute_many([key(1), key(2)], lambda idx: [value(1)])
    assert len(store) == 0 and not store._flights and all_free(store)


def test_failure_reaches_single_form_joiners_and_releases_the_hits():
    store, started = EncoderStore(1 << 16, page_bytes=PB), threading.Event()
    store.put(key(9), value(9))

    def broken(idx):
        started.set()
        wait_for(lambda: store.stats().totals.joins == 1)
        raise RuntimeError("encoder failed")

    errors = []
    t = threading.Thread(target=lambda: errors.append(_raises(lambda: store.get_or_compute_many(
        [key(9), key(1), key(2)], broken, pin=True))))
    t.start()
    started.wait()
    joined = _raises(lambda: store.get_or_compute(key(2), lambda: pytest.fail("must join")))
    t.join()
    assert isinstance(errors[0], RuntimeError) and joined is errors[0]
    assert len(store) == 1 and not store._flights
    assert set(store.pool.counts[store.pool.counts > 0].tolist()) == {1}  # the hit's lookup owner was dropped
    assert store.get_or_compute_many([key(1)], lambda idx: [value(1)])[0].source == "computed"  # retried


def _raises(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None


@pytest.mark.parametrize("seed", range(4))
def test_concurrent_single_and_batch_callers_run_each_key_once(seed):
    """8 threads, each a random mix of single and batch lookups over 6 keys, released together while the first
    computations are slow: every key's encoder runs exactly once and every caller gets its key's value."""
    rng = random.Random(seed)
    store, calls, lock = EncoderStore(1 << 16, page_bytes=PB), Counter(), threading.Lock()
    barrier = threading.Barrier(8)

    def compute(i):
        with lock:
            calls[i] += 1
        threading.Event().wait(0.005)  # long enough for the other threads to arrive on the same keys
        return value(i)

    plans = [[rng.sample(range(6), rng.randint(1, 4)) for _ in range(3)] for _ in range(8)]
    forms = [[rng.random() < 0.5 for _ in range(3)] for _ in range(8)]
    failures = []

    def worker(n):
        barrier.wait()
        for ids, single in zip(plans[n], forms[n]):
            keys = [key(i) for i in ids]
            if single:
                got = [store.get_or_compute(k, lambda k=k: compute(k.digest[0])) for k in keys]
            else:
                got = store.get_or_compute_many(keys, lambda idx, keys=keys: [compute(keys[i].digest[0])
                                                                              for i in idx])
            for i, g in zip(ids, got):
                if not torch.equal(g.value["emb"], value(i)["emb"]):
                    failures.append((n, i))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    assert calls == Counter({i: 1 for i in {i for p in plans for ids in p for i in ids}})
    assert not store._flights and set(store.pool.counts[store.pool.counts > 0].tolist()) == {1}


@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=6), min_size=1, max_size=6))
def test_sequential_batches_compute_each_key_once_and_count_one_query_per_distinct_key(batches):
    store, calls = EncoderStore(1 << 16, page_bytes=PB), []
    seen = set()
    for ids in batches:
        keys = [key(i) for i in ids]
        got = store.get_or_compute_many(keys, counting(calls)(keys))
        for i, g in zip(ids, got):
            assert_same(g.value, value(i))
        firsts = {}
        for i in ids:
            firsts.setdefault(i, "store" if i in seen else "computed")
        assert [g.source for g in got][:1] == [firsts[ids[0]]]
        seen |= set(ids)
    assert sorted(calls) == sorted(seen)
    s = store.stats().totals
    assert s.queries == sum(len(set(ids)) for ids in batches) and s.misses == len(seen)
