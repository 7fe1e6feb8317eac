"""EncoderStore under a hypothesis state machine: puts, gets, pins, clears and evictions against a model of the
stored values."""

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import STORE_PB as PB
from conftest import assert_same_value as assert_same
from conftest import store_all_free as all_free
from conftest import store_key as key
from mmcache.encoder_store import EncoderStore
from mmcache.errors import EncoderOutputError

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
        """The store's rules (``EncoderStore.check``: each entry's pages its own, bytes_stored its entries', the heap
        covers them) and the pool's; every owner on the pool is the store's, and those are its entries' and the pins
        this machine holds."""
        self.store.check()
        self.store.pool.check()
        expected = np.zeros(NUM_PAGES, dtype=np.int64)
        for p, *_ in self.pins:
            expected[list(p.pages)] += 1
        assert (self.store.pool.counts == self.store.owners()).all()
        assert (self.store.owners() >= expected).all()

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
