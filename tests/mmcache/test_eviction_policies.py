"""Eviction policies (mmcache.eviction): the offline optimum equals an exhaustive search on small cases, no online
policy beats it, every policy keeps the caches' invariants, and the replay exposes them by name."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache import Fingerprint, PagePool, PrefixCache
from mmcache.errors import InvalidConfig
from mmcache.eviction import DEFAULT_POLICY, POLICIES, LookupRecorder, OfflineOptimal, make_policy

P = 2  # tokens per page
FP = Fingerprint(model="eviction-test", page_size=P)


def prompt(chain: tuple[int, ...]) -> np.ndarray:
    """Full pages of token ``c`` for each ``c`` of the chain, then one token, so every full page is matchable."""
    return np.array([c for c in chain for _ in range(P)] + [0], dtype=np.int32)


def replay(chains, pages: int, policy) -> int:
    """Serve ``chains`` one at a time through a real PrefixCache on a pool of ``pages``; pages matched in all."""
    cache = PrefixCache(PagePool(pages, eviction=policy), FP, evict_batch_pages=1)
    hits = 0
    for i, chain in enumerate(chains):
        tokens = prompt(chain)
        hits += cache.admit(i, tokens).matched_tokens // P
        cache.grow(i, tokens.size)
        cache.mark_computed(i, tokens.size)
        cache.finish(i)
    return hits


def exhaustive(chains, pages: int) -> int:
    """The most pages any eviction choice matches on ``chains``: a search over every set of cached chain prefixes a
    shortfall may evict, in the same model as ``replay`` (one request at a time, its pages live while it runs)."""
    def walk(cached: frozenset, i: int) -> int:
        if i == len(chains):
            return 0
        prefixes = [tuple(chains[i][:d + 1]) for d in range(len(chains[i]))]
        m = 0
        while m < len(prefixes) and prefixes[m] in cached:
            m += 1
        held = set(prefixes[:m])
        need = len(prefixes) + 1 - m  # fresh pages: the rest of the chain and the last token's page
        short = len(cached) + need - pages
        after = lambda kept: kept | frozenset(prefixes)  # noqa: E731
        if short <= 0:
            return m + walk(after(cached), i + 1)
        best = -1
        for gone in itertools.combinations(sorted(cached - held), short):
            kept = cached - set(gone)
            if all(p[:-1] in kept or len(p) == 1 for p in kept):  # prefix-closed, as the index keeps itself
                best = max(best, walk(after(kept), i + 1))
        return -1 if best < 0 else m + best
    return walk(frozenset(), 0)


def optimal(chains, pages: int) -> int:
    recorder = LookupRecorder()
    replay(chains, 64, recorder)
    return replay(chains, pages, OfflineOptimal(recorder.lookups))


chains_st = st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(chains_st, st.integers(4, 7))
def test_optimal_equals_exhaustive_search_and_no_online_policy_beats_it(chains, pages):
    best = exhaustive(chains, pages)
    assert optimal(chains, pages) == best
    for name in POLICIES:
        assert replay(chains, pages, name) <= best


def test_optimal_keeps_some_sessions_whole_where_lru_thrashes():
    """Three sessions of three pages looked up in turn on a pool that holds two of them beside a live request: LRU
    evicts each just before it returns (no hits); the optimum keeps what returns first."""
    chains = [(s, s, s) for _ in range(4) for s in (1, 2, 3)]
    assert replay(chains, 7, "lru") == 0
    assert optimal(chains, 7) >= 9


def test_unknown_policy_is_a_clear_error_before_anything_changes():
    with pytest.raises(InvalidConfig, match="unknown eviction policy 'mru'"):
        PagePool(8, eviction="mru")
    with pytest.raises(InvalidConfig):
        make_policy("", 8, lambda: 0)


def test_sessions_that_outgrow_the_pool_keep_more_under_frequency_and_adaptive_follows():
    """Twelve sessions in turn, each re-sending its history three pages longer: on a pool that holds a third of
    them LRU evicts each just before it returns; frequency keeps the oldest histories, and the adaptive policy,
    dueling the two on a sample of the names, takes frequency's keys. On a pool that holds them all no policy loses
    anything."""
    chains = [tuple([s] * (3 * r + 3)) for r in range(8) for s in range(1, 13)]
    lru, lfu, adaptive, default = (replay(chains, 150, name) for name in ("lru", "lfu", "adaptive", DEFAULT_POLICY))
    assert lru < adaptive <= optimal(chains, 150) and lru < lfu and lru < default
    assert adaptive > (lru + lfu) / 2
    assert {replay(chains, 350, name) for name in POLICIES} == {optimal(chains, 350)}


def finished_sessions(waves: int, per_wave: int, pages: int = 3) -> list[tuple[int, ...]]:
    """Waves of two-turn sessions (MT-Bench's shape): each session's first turn, then its second, re-sending the
    first and adding as much again; a session never returns after its second turn."""
    chains, first = [], 1
    for _ in range(waves):
        sessions = range(first, first + per_wave)
        first += per_wave
        chains += [tuple([s] * pages) for s in sessions]
        chains += [tuple([s] * pages + [s + 1000] * pages) for s in sessions]
    return chains


def test_the_default_learns_that_finished_sessions_do_not_return():
    """Pages looked up twice are a finished session's here and never come back: frequency keeps them over the first
    turns still waiting for their second (below LRU); the default learns, per lookup count, how often a name comes
    back, gives those pages nothing and keeps the waiting first turns (above LRU)."""
    chains = finished_sessions(6, 6)
    lru, lfu, default = (replay(chains, 24, name) for name in ("lru", "lfu", DEFAULT_POLICY))
    assert lfu < lru < default <= optimal(chains, 24)
    policy = make_policy(DEFAULT_POLICY, 24, lambda: 0)
    for chain in chains:
        policy.looked_up([hash((page, depth)) for depth, page in enumerate(chain)])  # a name per position
    assert policy.returns.of(2) < 0.05 < policy.returns.of(1)  # twice: gone; once: comes back


def test_a_class_only_a_shared_prefix_reached_reads_as_the_pool_of_classes():
    """A system prompt's few pages, under every session, reach lookup counts no session page has reached yet: each
    request is one observation of those counts, not a page's worth. The default reads such a class near the rate of
    all classes (here: no session page comes back), not as the 9 further lookups its own pages alone say (p = 0.9),
    which the keys session pages take from it would then keep (keys never fall while an entry stays). The prompt
    itself, looked up at every request, stays in the top class, kept longest."""
    policy = make_policy(DEFAULT_POLICY, 4096, lambda: 0)
    for session in range(32):  # a 4-page system prompt, then a session's 60 pages, looked up once
        policy.looked_up(list(range(4)) + [1000 * (session + 1) + j for j in range(60)])
    assert all(policy.returns.of(c) < 0.2 for c in range(1, 8))  # unshrunk: 9.0 for classes 2-7
    assert policy.returns.of(8) > 9


def test_replay_eviction_option(capsys):
    """``--eviction`` sweeps each policy with the optimum's column; a name it does not know, or a replay it does not
    apply to, is one clear line and exit 2, before anything is replayed."""
    from workloads.cli import main
    assert main(["replay", "--limit", "60", "--pool-tokens", "256k,inf", "--eviction", "lru,adaptive",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "eviction lru:" in out and "eviction adaptive:" in out and out.count("of optimal %") == 2
    with pytest.raises(SystemExit) as e:
        main(["replay", "--eviction", "mru"])
    assert e.value.code == 2 and "unknown eviction policy mru" in capsys.readouterr().err
    assert main(["replay", "--limit", "30", "--replicas", "2", "--eviction", "lru"]) == 2
    assert "--eviction: only for the pool-size sweep" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_host_pool_made_like_a_device_pool_evicts_by_the_same_policy(name):
    from mmcache.pool import HostPagePool
    device = PagePool(8, (4,), eviction=name)
    host = HostPagePool.like(device, 4)
    assert host.policy.name == name and host.policy is not device.policy  # its own clock, its own counts
    best = OfflineOptimal([[1, 2], [1]])  # a replay's yardstick, not an online policy: the host pool takes the default
    assert HostPagePool.like(PagePool(8, (4,), eviction=best), 4).policy.name == DEFAULT_POLICY


def test_ctrl_c_during_a_sizes_optimum_keeps_the_size(monkeypatch):
    """A pool size whose replay finished keeps its row when Ctrl-C stops the optimum's replay of it."""
    from workloads import registry
    from workloads.sizing import sweep

    real = sweep.replay_trace

    def interrupt_the_optimum(*a, **k):
        if k["eviction"] == "optimal":
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(sweep, "replay_trace", interrupt_the_optimum)
    trace = registry.load("mooncake", registry.resolve(None, None, "auto")[1], limit=50)
    done = sweep.run_sweep(trace, page_size=512, pool_sizes=[1 << 18, 1 << 20])
    assert done.interrupted and [r.pool_tokens for r in done.runs] == [1 << 18]
    assert done.of_optimal(0) is None and "of optimal %" in sweep.format_table(done)


def test_a_sweep_with_tiers_replays_no_optimum():
    """Belady's rule is the optimum of one pool; with a host tier under it a policy could beat it, so none is shown."""
    from workloads import registry
    from workloads.sizing.sweep import format_table, run_sweep
    from workloads.sizing.tiers import TierModel

    trace = registry.load("mooncake", registry.resolve(None)[1], limit=50)
    done = run_sweep(trace, page_size=512, pool_sizes=[1 << 18], tiers=TierModel(host_tokens=1 << 20))
    assert done.optimal == [None] and done.of_optimal(0) is None and format_table(done)
