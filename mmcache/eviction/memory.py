"""What a policy remembers about names, bounded: a window of the latest names (``NameWindow``) and their use counts
(``UseCounts``). Each keeps at most ``limit`` names and forgets the oldest one at a time as new ones come, and no
call does work that grows with ``limit``: the upkeep is a constant per name, never a pause of the pool's lock.

Why not one ``OrderedDict``: a window adding and forgetting names all the time makes the table underneath rebuild
every few thousand names, and an ``OrderedDict`` rebuilds its node table with it: milliseconds at 40,000 names, under
the pool's lock, and more where the rebuilt table lands on memory the process never touched (the policy-upkeep rows
of ``benchmarks/bench_core.py``). Here a window is a list linked through its names, oldest first, kept in dicts of
about ``SHARD_NAMES`` names each (a name's dict: ``name & mask``), so a rebuild is of one small dict.
"""

from __future__ import annotations

from typing import Iterable

SHARD_NAMES = 512  # names per dict, about


class NameWindow:
    """The latest ``limit`` names added, each with a value if given (a tick, say): adding a name already in it makes
    it the latest, with the new value. The names form a list from ``_first`` (the oldest) to ``_last``: ``_prev`` and
    ``_next`` of a name are its neighbours (None past either end), ``_values`` its value, each in the name's shard."""

    __slots__ = ("limit", "_mask", "_values", "_prev", "_next", "_first", "_last", "_size")

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        shards = 1 << (self.limit // SHARD_NAMES).bit_length()
        self._mask = shards - 1
        self._values: list[dict[int, object]] = [{} for _ in range(shards)]
        self._prev: list[dict[int, int | None]] = [{} for _ in range(shards)]
        self._next: list[dict[int, int | None]] = [{} for _ in range(shards)]
        self._first: int | None = None
        self._last: int | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, name: int) -> bool:
        return name in self._values[name & self._mask]

    def get(self, name: int, default=None):
        return self._values[name & self._mask].get(name, default)

    def add(self, names: Iterable[int], values: Iterable | None = None) -> None:
        shards, prevs, nexts, mask = self._values, self._prev, self._next, self._mask
        size, last = self._size, self._last
        try:
            for name, value in zip(names, values) if values is not None else ((n, None) for n in names):
                i = name & mask
                shard = shards[i]
                if name in shard:
                    if name == last:
                        shard[name] = value
                        continue
                    self._last = last
                    self._unlink(name, i)
                else:
                    size += 1
                shard[name] = value
                prevs[i][name], nexts[i][name] = last, None
                if last is None:
                    self._first = name
                else:
                    nexts[last & mask][last] = name
                last = name
        finally:  # a name that is not an int stops the loop: what it added stays whole
            self._size, self._last = size, last
        while size > self.limit:  # forget the oldest: the first of the list
            oldest = self._first
            i = oldest & mask
            after = nexts[i].pop(oldest)
            del prevs[i][oldest], shards[i][oldest]
            self._first = after
            if after is None:
                last = None
            else:
                prevs[after & mask][after] = None
            size -= 1
        self._size, self._last = size, last

    def discard(self, names: Iterable[int]) -> None:
        shards, mask = self._values, self._mask
        for name in names:
            i = name & mask
            if name in shards[i]:
                self._unlink(name, i)
                del shards[i][name], self._prev[i][name], self._next[i][name]
                self._size -= 1

    def _unlink(self, name: int, i: int) -> None:
        """Join ``name``'s neighbours to each other (its own links are left for the caller to overwrite or drop)."""
        mask = self._mask
        before, after = self._prev[i][name], self._next[i][name]
        if before is None:
            self._first = after
        else:
            self._next[before & mask][before] = after
        if after is None:
            self._last = before
        else:
            self._prev[after & mask][after] = before


class UseCounts(NameWindow):
    """Lookups per name of the latest ``limit`` names looked up (a ghost history: kept after an entry left)."""

    __slots__ = ()

    def get(self, name: int, default: int = 0) -> int:
        return self._values[name & self._mask].get(name, default)

    def add(self, names: Iterable[int]) -> None:
        names = list(names)
        super().add(names, (self.get(name) + 1 for name in names))  # read as each is added: a repeat counts twice
