"""``NameWindow`` and ``UseCounts`` keep exactly what an ``OrderedDict`` window keeps (the latest ``limit`` names, a
re-added name the latest), under any sequence of adds and discards, with few names per shard and with many."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from mmcache.eviction import memory
from mmcache.eviction.memory import NameWindow, UseCounts


class Reference:
    def __init__(self, limit: int):
        self.limit, self.names = max(1, limit), OrderedDict()

    def add(self, names, values):
        for name, value in zip(names, values):
            self.names[name] = value
            self.names.move_to_end(name)
        while len(self.names) > self.limit:
            self.names.popitem(last=False)

    def discard(self, names):
        for name in names:
            self.names.pop(name, None)


calls = st.lists(st.tuples(st.sampled_from(["add", "discard"]), st.lists(st.integers(0, 40), max_size=12)),
                 max_size=150)


@settings(max_examples=300, deadline=None)
@given(limit=st.integers(1, 20), calls=calls, shard_names=st.sampled_from([1, 4, memory.SHARD_NAMES]))
def test_a_window_keeps_what_an_ordered_dict_keeps(limit, calls, shard_names):
    saved, memory.SHARD_NAMES = memory.SHARD_NAMES, shard_names
    try:
        window, reference = NameWindow(limit), Reference(limit)
    finally:
        memory.SHARD_NAMES = saved
    for step, (call, names) in enumerate(calls):
        if call == "add":
            window.add(names, [step] * len(names))
            reference.add(names, [step] * len(names))
        else:
            window.discard(names)
            reference.discard(names)
        assert len(window) == len(reference.names)
        assert [n for n in range(41) if n in window] == sorted(reference.names)
        assert all(window.get(n) == reference.names.get(n) for n in range(41))
    oldest_first, name = [], window._first
    while name is not None:
        oldest_first.append(name)
        name = window._next[name & window._mask][name]
    assert oldest_first == list(reference.names)


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(1, 20), calls=calls)
def test_use_counts_count_every_lookup_of_the_names_they_keep(limit, calls):
    counts, reference = UseCounts(limit), Reference(limit)
    for call, names in calls:
        if call == "add":
            counts.add(names)
            for name in names:  # a name twice in one call counts twice; the oldest go after the call
                reference.names[name] = reference.names.get(name, 0) + 1
                reference.names.move_to_end(name)
            reference.add([], [])
        else:
            counts.discard(names)
            reference.discard(names)
        assert len(counts) == len(reference.names)
        assert all(counts.get(n) == reference.names.get(n, 0) for n in range(41))
