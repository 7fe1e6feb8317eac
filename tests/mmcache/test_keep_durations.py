"""Keep durations learned per lookup-count class (``mmcache.keep_durations``), alone and inside the default policy."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache.eviction import DEFAULT_POLICY, make_policy
from mmcache.keep_durations import KeepDurations


class Clock:
    def __init__(self):
        self.now = 0

    def __call__(self) -> int:
        return self.now


def drive(durations: KeepDurations, clock: Clock, lookups) -> None:
    """Feed ``(tick, names)`` lookups, counting names as the policy's use-count table would."""
    counts: dict[int, int] = {}
    for tick, names in lookups:
        clock.now = tick
        durations.returned(names)
        for n in names:
            counts[n] = counts.get(n, 0) + 1
        durations.visited(names, np.array([counts[n] for n in names], dtype=np.int64))
    durations._solve()


def two_turn_chats(sessions: int, gap: int, pages: int = 4):
    """Each session's first turn at tick ``2 s``, its second (the same pages, then never again) ``gap`` ticks
    later."""
    turns = [(2 * s, [100 * s + j for j in range(pages)]) for s in range(sessions)]
    turns += [(2 * s + gap, [100 * s + j for j in range(pages)]) for s in range(sessions)]
    return sorted(turns)


def test_a_class_that_comes_back_is_kept_past_its_distance_and_one_that_does_not_is_not_kept():
    """Two-turn chats: every page seen once comes back ``gap`` ticks later, none seen twice comes back. With room,
    class 1 is kept at least ``gap`` ticks and class 2 not at all."""
    clock = Clock()
    durations = KeepDurations(num_pages=4096, classes=8, clock=clock)
    drive(durations, clock, two_turn_chats(400, gap=300))
    assert durations.ticks[1] >= 300
    assert durations.ticks[2] == 0
    assert durations.ticks[0] == durations.ticks[1]  # never looked up reads as looked up once


def test_a_short_pool_drops_one_off_prompts_and_keeps_what_was_seen_twice():
    """Mooncake's shape: most prompts are one-offs (a tenth come back, late), while a conversation's history, once
    sent twice, comes back at every turn. A pool too short to hold the one-offs until their return spends nothing on
    them and keeps the histories past their turn gap (they hold 80 pages; the one-offs would need 3,200)."""
    lookups, tick = [], 0
    conversations = [[10_000 * c + j for j in range(8)] for c in range(10)]
    for step in range(4000):
        tick += 1
        lookups.append((tick, [1_000_000 + 16 * step + j for j in range(16)]))  # a one-off prompt
        if step % 10 == 0 and step >= 200:  # one in ten returns, 200 steps later
            lookups.append((tick, [1_000_000 + 16 * (step - 200) + j for j in range(16)]))
        if step % 50 == 0:  # a conversation's turn every 50 steps, round-robin over 10: a gap of 500 ticks
            lookups.append((tick, conversations[(step // 50) % 10]))
    clock = Clock()
    durations = KeepDurations(num_pages=400, classes=8, clock=clock)
    drive(durations, clock, lookups)
    assert durations.ticks[1] == 0
    # class 2 holds the one-offs that came back (never again) beside the conversations' second turns: not worth it
    assert min(durations.ticks[3:8]) >= 500  # the eighth visit is each conversation's last


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 20), st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True)),
                min_size=1, max_size=60),
       st.integers(1, 64), st.integers(1, 64))
def test_more_pages_never_keep_a_class_shorter(steps, small, extra):
    """The durations of a bigger pool are at least those of a smaller one, class by class, on the same lookups
    (the knapsack over concave curves only extends each class as the budget grows)."""
    lookups = list(zip(itertools.accumulate(dt for dt, _ in steps), (names for _, names in steps)))
    short, long_ = Clock(), Clock()
    a, b = KeepDurations(small, 8, short), KeepDurations(small + extra, 8, long_)
    drive(a, short, lookups)
    drive(b, long_, lookups)
    assert np.all(b.ticks >= a.ticks - 1e-9)


def test_the_default_keeps_one_tick_per_name_its_count_table_holds():
    """State bounded by the pool: the durations keep a name's last tick only while the use-count table counts it
    (pruned when the table halves)."""
    clock = Clock()
    policy = make_policy(DEFAULT_POLICY, 64, clock)
    limit = policy.uses.limit
    for step in range(200):
        clock.now = step
        policy.looked_up([10 * step + j for j in range(10)])
        assert len(policy.durations._last) <= limit + 10
        assert set(policy.durations._last) <= set(policy.uses.counts)


def test_a_long_chain_read_by_runs_counts_what_reading_every_name_counts():
    """Lookups of more than 64 names are read by runs (binary searches: counts and last lookups never rise along a
    chain); the policy's statistics and keys come out as reading every name would give them."""
    runs, names_by_name = Clock(), Clock()
    by_runs = make_policy(DEFAULT_POLICY, 4096, runs)
    one_by_one = make_policy(DEFAULT_POLICY, 4096, names_by_name)
    chain = list(range(1, 401))
    for step, depth in enumerate([400, 120, 400, 65, 300, 400, 90, 400] * 4):
        runs.now = names_by_name.now = 3 * step
        by_runs.looked_up(chain[:depth])
        for start in range(0, depth, 50):  # the same lookup as pieces of at most 64 names: read name by name
            piece = chain[start:min(depth, start + 50)]
            one_by_one.durations.returned(piece)
        one_by_one.uses.add(chain[:depth])
        counts = np.array([one_by_one.uses.counts[n] for n in chain[:depth]], dtype=np.int64)
        one_by_one.durations.visited(chain[:depth], counts)
    a, b = by_runs.durations, one_by_one.durations
    assert a._last == b._last
    assert np.array_equal(a._visits, b._visits) and np.array_equal(a._returns, b._returns)
    names = np.array(chain, dtype=np.uint64)
    floors = np.zeros(len(chain), dtype=np.int64)
    assert np.array_equal(by_runs.keys(names, 100, floors, chain=True), by_runs.keys(names, 100, floors))


def test_more_classes_than_four_bits_keep_each_lookup_in_its_own_class():
    """A name's last lookup keeps its class in as many low bits as ``classes`` takes (the default's 8 take 4; a finer
    classing, as the prototypes of ``benchmarks/bench_eviction_variants.py`` use, more): every return is counted in
    the class its name was looked up in, and the tick comes back whole."""
    clock = Clock()
    durations = KeepDurations(num_pages=64, classes=64, clock=clock)
    for c in (1, 15, 16, 17, 40, 64):
        clock.now = 1000 + c
        durations.returned([c])
        durations.visited([c], np.array([c], dtype=np.int64))
        assert durations.last_lookup(c) == (1000 + c, c)
    clock.now = 5000
    durations.returned([1, 15, 16, 17, 40, 64])
    visits, back = durations.returns_by_class()
    assert np.array_equal(np.flatnonzero(back), [1, 15, 16, 17, 40, 64])
    assert np.array_equal(visits, back)  # every visit came back, once
    assert durations.last_lookup(99) == (-1, 0)
