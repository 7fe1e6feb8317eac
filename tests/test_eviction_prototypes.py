"""Every registered eviction policy and every prototype of ``benchmarks/eviction_prototypes.py`` runs on the public
extension point alone: a short replay through a real pool under each keeps the cache's rules, and ``key`` agrees
with ``keys``. A change of the core that breaks a prototype fails here, not unnoticed in a benchmark."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.eviction_prototypes import PROTOTYPES, register
from mmcache import Fingerprint, PagePool, PrefixCache, eviction
from mmcache.eviction import POLICIES

# Factories, not names: registering here would change the registry every other test module reads at collection.
CANDIDATES = {**POLICIES, **PROTOTYPES}


def test_register_makes_every_prototype_a_name(monkeypatch):
    monkeypatch.setattr(eviction, "POLICIES", dict(POLICIES))
    assert register() == list(PROTOTYPES)
    assert [PagePool(8, eviction=name).policy.name for name in PROTOTYPES] == list(PROTOTYPES)
    assert set(POLICIES).isdisjoint(PROTOTYPES)


@pytest.mark.parametrize("name", sorted(CANDIDATES))
def test_a_policy_serves_sessions_that_outgrow_the_pool(name):
    pool = PagePool(48, eviction=CANDIDATES[name])
    cache = PrefixCache(pool, Fingerprint("prototypes", page_size=4), evict_batch_pages=1, page_seconds=1e-3)
    rng = np.random.default_rng(0)
    history = [rng.integers(1, 999, size=8).tolist() for _ in range(6)]
    for i in range(120):
        s = i % 6
        history[s] = history[s] + rng.integers(1, 999, size=4).tolist() if len(history[s]) < 60 else history[s][:8]
        tokens = history[s] + [0]
        cache.admit(i, tokens)
        cache.grow(i, len(tokens))
        cache.mark_computed(i, len(tokens))
        cache.finish(i)
        cache.check()
    assert pool.policy.name == name and cache.stats().listener_errors == 0
    names = np.arange(1, 30, dtype=np.uint64)
    floors = rng.integers(0, 400, size=names.size).astype(np.int64)
    assert pool.policy.keys(names, 300, floors, 1e-3).tolist() == [
        pool.policy.key(int(n), 300, int(f), 1e-3) for n, f in zip(names, floors)]
