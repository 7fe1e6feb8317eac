"""No collaborator that raises leaves a cache wrong: the prefix cache's stateful machine (``CacheMachine``: real data
in every page, so a page reused under the wrong prefix shows up as wrong bytes) run with a pool policy, an observer
and a lower tier (a real host tier) that each raise at random points, before or after doing their work.

Every operation must complete or leave the cache as it was (``mmcache.guard``: a notification that raises is
dropped, a key the policy cannot give is the LRU key, a tier that raises is a miss), so after every step the cache
keeps every rule (``PrefixCache.check``) and every admission's matched pages hold exactly its own prefix's bytes.
The collaborators fail about one call in eight; the run counts them, and each policy must see some.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_node_pool_stateful import NodeMachine
from test_node_pool_stateful import P as NODE_P
from test_prefix_cache_stateful import CacheMachine, P

from mmcache import EncoderStore, Fingerprint, HostPagePool, PagePool, PrefixCache
from mmcache.eviction import EvictionPolicy, make_policy
from mmcache.tiers import HostTier, TierStack
from policy_machines import per_policy

RATE = 1 / 8


class InjectedFault(RuntimeError):
    pass


class Faults:
    """Whether the next call of a collaborator raises, from a generator hypothesis seeds (none before it does)."""

    def __init__(self):
        self.rng: random.Random | None = None
        self.raised = 0

    def maybe(self, what: str) -> None:
        if self.rng is not None and self.rng.random() < RATE:
            self.raised += 1
            raise InjectedFault(what)

    def around(self, what: str, call, *args):
        """``call(*args)`` with a fault before it, or after it (its work done), at random."""
        if self.rng is not None and self.rng.random() < 0.5:
            self.maybe(what)
            return call(*args)
        out = call(*args)
        self.maybe(what)
        return out


class FaultyPolicy(EvictionPolicy):
    """A pool policy that raises at random from every hook and every key, around the real one."""

    def __init__(self, inner: EvictionPolicy, faults: Faults):
        super().__init__(inner.num_pages, inner.clock)
        self.inner, self.faults = inner, faults
        self.name, self.monotone = inner.name, inner.monotone

    def looked_up(self, names, hits, held=False):
        self.faults.around("looked_up", self.inner.looked_up, names, hits, held)

    def released(self, names):
        self.faults.around("released", self.inner.released, names)

    def evicted(self, names, keys, ticks):
        self.faults.around("evicted", self.inner.evicted, names, keys, ticks)

    def rank(self, name, tick, cost):
        return self.faults.around("rank", self.inner.rank, name, tick, cost)

    def ranks(self, names, ticks, cost, chain):
        return self.faults.around("ranks", self.inner.ranks, names, ticks, cost, chain)


class FaultyObserver:
    """An ``IndexObserver`` and an ``EncoderObserver`` (KV events) that raises at random."""

    def __init__(self, faults: Faults):
        self.faults = faults

    def stored(self, names, parent, tokens, media, salt, depth):
        self.faults.maybe("stored")

    def removed(self, names):
        self.faults.maybe("removed")

    def cleared(self):
        self.faults.maybe("cleared")

    def encoder_stored(self, key, nbytes):
        self.faults.maybe("encoder_stored")

    def encoder_removed(self, keys):
        self.faults.maybe("encoder_removed")


class FaultyTier:
    """A ``LowerTier`` (a real ``TierStack`` with a host tier) that raises at random: a lookup fails before it asks
    (a tier that failed holds nothing for the request), a spill or a publish before or after its work."""

    def __init__(self, inner: TierStack, faults: Faults):
        self.inner, self.faults = inner, faults

    def nominates(self, name):
        self.faults.maybe("nominates")
        return self.inner.nominates(name)

    def extend(self, *args):
        self.faults.maybe("extend")
        return self.inner.extend(*args)

    def spill(self, index, pages):
        self.faults.around("spill", self.inner.spill, index, pages)

    def publish(self, *args):
        self.faults.around("publish", self.inner.publish, *args)


class FaultsMachine(CacheMachine):
    def build(self, pool: PagePool) -> PrefixCache:
        self.faults = Faults()
        pool.policy = FaultyPolicy(make_policy(self.eviction, pool.num_pages, lambda: pool.clock.now), self.faults)
        fp = Fingerprint("m", page_size=P)
        tiers = TierStack(fp, host=HostTier(HostPagePool.like(pool, 6), P))
        return PrefixCache(pool, fp, evict_batch_pages=2, observer=FaultyObserver(self.faults),
                           tiers=FaultyTier(tiers, self.faults))

    @initialize(rng=st.randoms(use_true_random=False))
    def arm(self, rng):
        self.faults.rng = rng

    def teardown(self):
        super().teardown()
        assert self.cache.stats().listener_errors <= self.faults.raised


class FaultsNodeMachine(NodeMachine):
    """KV pages and encoder outputs on one pool, with the pool's policy and both observers raising at random. (No
    encoder tier here: this machine replaces values under one key, and a host tier keeps what an older put spilled;
    the tiers' faults are the prefix machine's.)"""

    def build(self, pool: PagePool):
        self.faults = Faults()
        pool.policy = FaultyPolicy(make_policy(self.eviction, pool.num_pages, lambda: pool.clock.now), self.faults)
        observer = FaultyObserver(self.faults)
        cache = PrefixCache(pool, Fingerprint(model="tiny", page_size=NODE_P), evict_batch_pages=1, observer=observer)
        return cache, EncoderStore(pool=pool, observer=observer)

    @initialize(rng=st.randoms(use_true_random=False))
    def arm(self, rng):
        self.faults.rng = rng


HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.large_base_example]
STEPS = settings(max_examples=150, stateful_step_count=100, deadline=None,  # about 11,000 operations a policy
                 suppress_health_check=HEALTH)
per_policy(FaultsMachine, globals(), "TestFaultsStateful", STEPS)
per_policy(FaultsNodeMachine, globals(), "TestFaultsNodePool",
           settings(max_examples=60, stateful_step_count=100, deadline=None,
                    suppress_health_check=HEALTH))


def test_the_collaborators_fail_and_the_cache_counts_it():
    """The injection is real: one sequence, and the cache counted what its collaborators raised."""
    machine = FaultsMachine()
    machine.faults.rng = random.Random(3)
    rng = np.random.default_rng(0)
    for i in range(40):
        machine.serve(rng.integers(0, 3, size=int(rng.integers(1, 14))).tolist(), b"", int(rng.integers(0, 6)))
        machine.the_cache_keeps_its_rules()
    assert machine.faults.raised > 0 and machine.cache.stats().listener_errors > 0
    machine.teardown()
