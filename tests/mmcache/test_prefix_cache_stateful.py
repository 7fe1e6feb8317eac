"""Stateful property test of PrefixCache over a real data-carrying pool.

Each written KV slot holds a value that depends on the salt and every token up to its position, so a page that is
reused under the wrong prefix shows up as wrong data: cached-on equals cached-off at the byte level.
"""

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache import Fingerprint, OutOfPages, PagePool, PrefixCache
from mmcache.errors import InvalidRequest
from policy_machines import per_policy

P, PAGES = 4, 12
SALTS = [b"", b"tenant"]


def kv_values(salt: bytes, seq: list[int]) -> np.ndarray:
    """The 'KV' of each position: a rolling hash of the salt and the whole prefix up to it."""
    h, out = hash(salt) & 0xFFFF, []
    for tok in seq:
        h = (h * 1_000_003 + tok + 1) % (1 << 61)
        out.append(h)
    return np.array(out, dtype=np.int64)


# Prompts share prefixes: one of three stems, cut anywhere, plus a short random tail.
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1, 0, 0], [1] * 12]
PROMPTS = st.builds(lambda stem, cut, tail: stem[:cut] + tail or [0], st.sampled_from(STEMS), st.integers(0, 12),
                    st.lists(st.integers(0, 2), max_size=5))


def generated(t: int) -> int:
    return (t * 7) % 3  # the tokens a request "generates" at position t; a small alphabet keeps prefixes shared


class CacheMachine(RuleBasedStateMachine):
    collide = False  # when True every page of every request has the same name: only verification keeps it exact
    page_local = False  # when True a page's name depends on its own tokens only: equal pages under different
    # prefixes collide, the sequence the reused-parent wrong hit needed (test_prefix_cache.py)
    eviction = None  # the pool's eviction policy (None: the default); every invariant holds under each

    def __init__(self):
        super().__init__()
        self.cache = self.build(PagePool(PAGES, (P,), torch.int64, eviction=self.eviction))
        self.live: dict[int, dict] = {}
        self.next_id = 0

    def build(self, pool: PagePool) -> PrefixCache:
        """The cache under test on ``pool``."""
        return PrefixCache(pool, Fingerprint("m", page_size=P), evict_batch_pages=2)

    # ---- helpers
    def seq(self, r, upto):
        return r["prompt"] + [generated(t) for t in range(len(r["prompt"]), upto)]

    def held_by_live(self) -> set[int]:
        return {p for rid in self.live for p in self.cache.state(rid).page_indices}

    def check_matched_data(self, r, st_):
        n = st_.matched_tokens
        if n:
            got = self.cache.pool.data[list(st_.page_indices[: n // P])].reshape(-1)
            assert torch.equal(got, torch.from_numpy(kv_values(r["salt"], r["prompt"][:n])))

    def expect_refusal_is_justified(self, need):
        assert need > PAGES - len(self.held_by_live()), "a live request was refused because of cached data"

    # ---- rules
    @precondition(lambda self: len(self.live) < 4)
    @rule(prompt=PROMPTS, salt=st.sampled_from(SALTS))
    def admit(self, prompt, salt):
        self.start(prompt, salt)

    def start(self, prompt, salt) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        k = len(prompt) // P
        if self.collide:
            names = [7] * k
        elif self.page_local:
            names = [hash(tuple(prompt[j * P:(j + 1) * P])) & 0xFFFF for j in range(k)]
        else:
            names = None
        st_ = self.cache.admit(rid, prompt, salt=salt, names=names)
        r = self.live[rid] = {"prompt": prompt, "salt": salt, "suspended": False}
        assert st_.matched_tokens <= (len(prompt) - 1) // P * P
        self.check_matched_data(r, st_)
        return rid

    @rule(prompt=PROMPTS, salt=st.sampled_from(SALTS), decode=st.integers(0, 6))
    def serve(self, prompt, salt, decode):
        """A whole request in one step, so that the index fills and later admits hit and evict."""
        rid = self.start(prompt, salt) if len(self.live) < 4 else None
        if rid is None:
            return
        r, total = self.live[rid], len(prompt) + decode
        try:
            self.cache.grow(rid, total)
        except OutOfPages:
            self.expect_refusal_is_justified(-(-total // P) - len(self.cache.state(rid).page_indices))
            self.cache.abort(rid)
            del self.live[rid]
            return
        self.write_upto(rid, total)
        self.cache.finish(rid, self.seq(r, total)[len(prompt):])
        del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(0, 12))
    def grow(self, data, extra):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.live[rid]["suspended"]:
            return
        st_ = self.cache.state(rid)
        total = max(st_.seq_len + extra, len(self.live[rid]["prompt"]) if extra else 0)
        need = -(-total // P) - len(st_.page_indices)
        try:
            self.cache.grow(rid, total)
        except OutOfPages:
            self.expect_refusal_is_justified(need)
            assert self.cache.state(rid) == st_

    @precondition(lambda self: self.live)
    @rule(data=st.data(), k=st.integers(1, 9))
    def write(self, data, k):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        if r["suspended"]:
            return
        st_ = self.cache.state(rid)
        self.write_upto(rid, min(st_.seq_len, st_.computed_tokens + k))

    def write_upto(self, rid, new):
        r, st_ = self.live[rid], self.cache.state(rid)
        values = kv_values(r["salt"], self.seq(r, new))
        keep = -(-(st_.protected_tokens or 0) // P)
        for t in range(st_.computed_tokens, new):
            j = t // P - st_.position_id_start // P
            page = st_.page_indices[j if j < keep else j - st_.released_tokens // P]
            assert self.cache.pool.counts[page] == 1, "a request writes only into pages it owns alone"
            self.cache.pool.data[page, t % P] = int(values[t])
        self.cache.mark_computed(rid, new)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), how=st.sampled_from(["finish", "abort", "suspend", "resume"]))
    def end_or_move(self, data, how):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        if how == "finish" and not r["suspended"]:
            st_ = self.cache.state(rid)
            self.cache.finish(rid, self.seq(r, st_.seq_len)[len(r["prompt"]):])
            del self.live[rid]
        elif how == "abort":
            self.cache.abort(rid)
            del self.live[rid]
        elif how == "suspend" and not r["suspended"] and not r.get("windowed"):
            own = self.cache.suspend(rid)
            # the kept run starts at a page the request alone holds; a later one may also be the index's (committed
            # after the request's own copy of an equal page, which is why only the leading shared run is released)
            assert not own or self.cache.pool.counts[own[0]] == 1
            assert all(self.cache.pool.counts[p] >= 1 for p in own)
            r["suspended"] = True
        elif how == "resume" and r["suspended"]:
            rec = self.cache._live[rid]
            need = rec.first_page + rec.offloaded  # the released prefix and offloaded pages, at most
            try:
                st_ = self.cache.resume(rid)
            except OutOfPages:
                self.expect_refusal_is_justified(need)
                return
            r["suspended"] = False
            self.check_matched_data(r, st_)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), protect=st.integers(0, 8), release=st.integers(0, 3))
    def slide_window(self, data, protect, release):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        if r["suspended"]:
            return
        try:
            self.cache.protect_prefix(rid, protect)
            self.cache.release_oldest(rid, release)
        except InvalidRequest:
            pass
        r["windowed"] = True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def offload(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.live[rid]["suspended"]:
            self.cache.release_suspended(rid)

    @rule()
    def clear_index(self):
        self.cache.clear()

    @rule(pages=st.integers(1, PAGES))
    def hog(self, pages):
        """A request no ids describe takes up to ``pages`` pages and lets them go: cached pages are evicted and their
        ids handed out again, which is when a stale child could meet a reused parent."""
        rid, self.next_id = self.next_id, self.next_id + 1
        self.cache.admit_unnamed(rid)
        try:
            self.cache.grow(rid, pages * P)
        except OutOfPages:
            self.expect_refusal_is_justified(pages)
        self.cache.abort(rid)

    # ---- invariants
    @invariant()
    def the_cache_keeps_its_rules(self):
        """Owner counts equal their holders (the index and the live requests), the free list is exactly the unowned
        pages, the index is closed under parents (what keeps a page id evicted and handed out again from standing for
        its old chain's parent), ticks and keys never rise from a page to its child (what makes eviction take chains
        from their tails under every policy), the heap covers the index: ``PrefixCache.check``."""
        self.cache.check()

    @invariant()
    def the_heap_names_the_coldest_candidates_a_pass_over_the_pool_finds(self):
        """What lets an eviction skip the pass over the pool: ``coldest(n)`` off the heap is the ``n`` lowest keys of
        ``eviction_candidates``, lowest page first among equal keys. Run on a copy of the heap, so the refreshes it
        makes never help the evictions of the sequence under test."""
        index = self.cache.index
        pages, keys = index.eviction_candidates()
        want = sorted(zip(keys.tolist(), pages.tolist()))
        saved = list(index._cold)
        try:
            for n in (1, 2, 5, PAGES):
                got_pages, got_keys = index.coldest(n)
                assert [(int(k), int(p)) for k, p in zip(got_keys, got_pages)] == want[:n]
        finally:
            index._cold = saved

    def teardown(self):
        for rid in list(self.live):
            self.cache.abort(rid)
        self.cache.clear()
        assert self.cache.pool.num_free == PAGES, "pages leaked"


class CollidingNamesMachine(CacheMachine):
    collide = True


class PageLocalNamesMachine(CacheMachine):
    """Names that commit to a page's own tokens only, with windows, evictions and page reuse: equal pages under
    different prefixes collide, and only the parent check (the index closed under parents) keeps hits exact."""
    page_local = True


class LruCollidingNamesMachine(CacheMachine):
    collide, eviction = True, "lru"


per_policy(CacheMachine, globals(), "TestPrefixCacheStateful")
TestPrefixCacheForcedCollisionsLru = LruCollidingNamesMachine.TestCase
TestPrefixCacheForcedCollisions = CollidingNamesMachine.TestCase
TestPrefixCachePageLocalNames = PageLocalNamesMachine.TestCase
