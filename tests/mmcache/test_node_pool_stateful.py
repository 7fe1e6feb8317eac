"""One pool per node under a hypothesis state machine: requests (admit/grow/compute/finish/abort) through a
PrefixCache and encoder outputs (put/get/pin/unpin) through an EncoderStore, interleaved on ONE PagePool.

Invariants: each page's count equals its owners (live requests + index + store entries + pins); the free list is
exactly the pages of count 0; a live request's written pages and a pinned output's bytes never change (never
evicted); every KV hit holds the bytes stored for that prefix and every encoder hit returns the value last put;
a grow or a put fails only when live pages and pins alone leave too little."""

import zlib

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from conftest import assert_same_value, store_key
from mmcache import Fingerprint
from mmcache.encoder_store import EncoderStore
from mmcache.errors import OutOfPages
from mmcache.pool import PagePool
from mmcache.prefix_cache import PrefixCache
from policy_machines import per_policy

P, NUM_PAGES = 2, 10
PAGE = (2, P, 2)                                 # float32: 32 bytes per page
KEYS = [store_key(i) for i in range(5)]
NEL = [1, 8, 9, 24, 40]                          # a key's output shape is fixed: floats per key
PROMPTS = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9, 9], [1, 2, 7], [5, 6, 7, 8, 1, 2, 3], [1, 2, 3, 4, 5, 6]]


def gen(seq: list[int]) -> int:
    return (sum(seq) * 7 + len(seq)) % 13 + 20


def page_value(seq) -> float:
    """What a page holding ``seq[-P:]`` after ``seq[:-P]`` stores: a function of the whole prefix, exact in float32."""
    return float(zlib.crc32(np.asarray(seq, dtype=np.int64).tobytes()) % (1 << 24))


class NodeMachine(RuleBasedStateMachine):
    eviction = None  # the pool's eviction policy (None: the default); every invariant holds under each

    def __init__(self):
        super().__init__()
        self.pool = PagePool(NUM_PAGES, PAGE, torch.float32, eviction=self.eviction)
        self.cache, self.store = self.build(self.pool)
        self.live = {}        # rid -> token sequence (prompt + generated so far)
        self.prompt_len = {}
        self.values = {}      # key -> last value put (None once a put was bypassed)
        self.pins = []        # (pin, value)
        self.n = 0

    def build(self, pool: PagePool) -> tuple[PrefixCache, EncoderStore]:
        """The prefix cache and the encoder store under test, on the one ``pool``."""
        return PrefixCache(pool, Fingerprint(model="tiny", page_size=P), evict_batch_pages=1), EncoderStore(pool=pool)

    def _reclaimable(self) -> int:
        return self.pool.num_free + sum(len(c.eviction_candidates()[0]) for c in self.pool.evictables)

    # -- requests ------------------------------------------------------------------------------------------------------
    @rule(prompt=st.sampled_from(PROMPTS))
    def admit(self, prompt):
        rid, self.n = self.n, self.n + 1
        state = self.cache.admit(rid, prompt)
        for j, page in enumerate(state.page_indices):   # every KV hit holds what was stored for that prefix
            assert (self.pool.data[page] == page_value(prompt[:(j + 1) * P])).all()
        self.live[rid], self.prompt_len[rid] = list(prompt), len(prompt)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 5))
    def grow_and_compute(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        state, seq = self.cache.state(rid), self.live[rid]
        total = max(len(seq), state.seq_len) + extra
        need = -(-total // P) - len(state.page_indices)
        before = self._reclaimable()
        try:
            state = self.cache.grow(rid, total)
        except OutOfPages:
            assert need > before   # only live pages and pins alone can make a grow fail
            return
        while len(seq) < total:
            seq.append(gen(seq))
        for j in range(state.matched_tokens // P, -(-total // P)):  # write own pages only, never shared ones
            self.pool.data[state.page_indices[j]] = page_value(seq[:min((j + 1) * P, total)])
        self.cache.mark_computed(rid, total)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def end(self, data, finish):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        seq, n = self.live.pop(rid), self.prompt_len.pop(rid)
        if finish:
            self.cache.finish(rid, output_ids=seq[n:])
        else:
            self.cache.abort(rid)

    # -- encoder outputs -----------------------------------------------------------------------------------------------
    @rule(i=st.integers(0, len(KEYS) - 1), seed=st.integers(0, 9))
    def put(self, i, seed):
        k, nel = KEYS[i], NEL[i]
        value = torch.randn(nel, generator=torch.Generator().manual_seed(seed))
        need = -(-nel * 4 // self.store.page_bytes)
        old = self.values.get(k) is not None and k in self.store and self.store._entries[k.name]
        freed_by_replace = len(old.pages) if old and (self.pool.counts[old.pages] == 1).all() else 0
        before = self._reclaimable()
        ok = self.store.put(k, value)
        assert ok or need > before + freed_by_replace  # bypassed only when live pages and pins leave too little
        self.values[k] = value if ok else None

    @rule(k=st.sampled_from(KEYS))
    def get(self, k):
        got = self.store.get(k)
        if got is not None:
            assert_same_value(got, self.values[k])

    @rule(k=st.sampled_from(KEYS))
    def pin(self, k):
        pin = self.store.pin(k)
        if pin is not None:
            self.pins.append((pin, self.values[k]))

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 10))
    def unpin(self, i):
        pin, value = self.pins.pop(i % len(self.pins))
        assert_same_value(pin.value, value)
        pin.release()

    # -- invariants ----------------------------------------------------------------------------------------------------
    @invariant()
    def counts_are_owners(self):
        """Every owner on the one pool is a live request's, the index's, or the store's (its entries' and the pins
        this machine holds), exactly: ``PrefixCache.check`` with the store's ``owners()``; and the store's own rules."""
        self.cache.check()
        self.store.check()

    @invariant()
    def live_and_pinned_bytes_intact(self):
        for rid, seq in self.live.items():
            state = self.cache.state(rid)
            for j in range(state.computed_tokens // P):
                assert (self.pool.data[state.page_indices[j]] == page_value(seq[:(j + 1) * P])).all()
        for pin, value in self.pins:
            assert_same_value(pin.value, value)

    @invariant()
    def each_cache_names_the_coldest_candidates_a_pass_over_it_finds(self):
        """What lets an eviction on the shared pool skip the passes: the index's ``coldest(n)`` is the ``n`` lowest
        keys of its candidates; the store's is the pages of its coldest whole entries until they reach ``n`` (an
        entry's pages share its key). Each run on a copy of its heap, so the check never helps the sequence."""
        for cache in (self.cache.index, self.store):
            pages, keys = cache.eviction_candidates()
            pairs = sorted(zip(keys.tolist(), pages.tolist()))
            saved = list(cache._cold)
            try:
                for n in (1, 3, NUM_PAGES):
                    got_pages, got_keys = cache.coldest(n)
                    got = sorted((int(k), int(p)) for k, p in zip(got_keys, got_pages))
                    if cache is self.store:  # whole entries until they reach n: every page keyed below the
                        # last key taken, and pages of entries at that key (entries may tie under a frequency policy)
                        last = pairs[min(n, len(pairs)) - 1][0] if pairs else None
                        below = {kp for kp in pairs if kp[0] < last} if pairs else set()
                        upto = {kp for kp in pairs if kp[0] <= last} if pairs else set()
                        assert below <= set(got) <= upto and len(got) >= min(n, len(pairs))
                    else:
                        assert got == pairs[:n]
            finally:
                cache._cold = saved

    def teardown(self):
        for pin, _ in self.pins:
            pin.release()
        for rid in list(self.live):
            self.cache.abort(rid)
        self.store.clear()
        self.cache.clear()
        assert self.pool.num_free == NUM_PAGES


per_policy(NodeMachine, globals(), "TestNodePool")
NodeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)  # TestNodePool's
