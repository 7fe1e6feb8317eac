"""Stateful property: a device pool with a host tier under it never serves a wrong page, even when every page name
is forced to collide. Every page's bytes are a digest of the whole token prefix it ends, written when the request
computes it; every admission checks the bytes of every matched page (device or host) against its own prefix."""

import numpy as np
import torch
import xxhash
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.pool import HostPagePool
from mmcache.tiers import HostTier, TierStack
from policy_machines import per_policy

P = 2


def prefix_value(ids, end) -> float:
    """Exactly representable in float32: a 20-bit digest of ``ids[:end]``."""
    return float(xxhash.xxh64_intdigest(np.asarray(ids[:end], dtype=np.int32).tobytes()) & 0xFFFFF)


class DeviceAndHost(RuleBasedStateMachine):
    eviction = None  # the pool's eviction policy (None: the default); every invariant holds under each

    def __init__(self):
        super().__init__()
        self.pool = PagePool(5, (P,), torch.float32, eviction=self.eviction)
        fp = Fingerprint(model="collide", page_size=P)
        self.host = HostTier(HostPagePool.like(self.pool, 5), P)
        self.cache = PrefixCache(self.pool, fp, evict_batch_pages=1, tiers=TierStack(fp, host=self.host))
        self.live = {}
        self.n = 0

    @precondition(lambda self: len(self.live) < 2)
    @rule(ids=st.lists(st.integers(0, 1), min_size=3, max_size=8), names=st.sampled_from(["chain", "first", "one"]),
          salt=st.sampled_from([b"", b"t"]))
    def admit(self, ids, names, salt):
        rid, self.n = self.n, self.n + 1
        forced = {"chain": None, "first": [ids[j * P] for j in range(len(ids) // P)],
                  "one": [7] * (len(ids) // P)}[names]
        s = self.cache.admit(rid, ids, names=forced, salt=salt)
        if s.fetch is not None:
            assert s.fetch.ready
        for j in range(s.matched_tokens // P):  # the check: every matched page holds its own prefix's bytes
            assert self.pool.data[s.page_indices[j]][0].item() == prefix_value([len(salt)] + ids, j * P + P + 1)
        self.live[rid] = (ids, salt, s.matched_tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def compute_and_end(self, data, finish):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        ids, salt, matched = self.live.pop(rid)
        try:
            s = self.cache.grow(rid, len(ids))
        except Exception:  # the other live request holds the pool: this one ends without computing
            self.cache.abort(rid)
            return
        for j in range(matched // P, len(s.page_indices)):
            self.pool.data[s.page_indices[j]] = prefix_value([len(salt)] + ids, min(len(ids), j * P + P) + 1)
        self.cache.mark_computed(rid, len(ids))
        (self.cache.finish if finish else self.cache.abort)(rid)

    @invariant()
    def owner_counts_agree(self):
        held = self.host.pool.counts
        assert (held <= 1).all()  # no pin outlives a lookup on the CPU
        assert self.host.pool.num_free + len(self.host) == self.host.pool.num_pages


per_policy(DeviceAndHost, globals(), "TestDeviceAndHost")
