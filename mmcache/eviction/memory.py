"""What a policy remembers about names, bounded: a window of the latest names (``NameWindow``) and their use counts
(``UseCounts``). Each keeps at most ``limit`` names and forgets the oldest one at a time as new ones come, so its
upkeep is a constant per name and never a pause of the pool's lock."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class NameWindow:
    """The latest ``limit`` names added, each with a value if given (a tick, say): adding a name already in it makes
    it the latest, with the new value."""

    __slots__ = ("limit", "_names")

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self._names: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: int) -> bool:
        return name in self._names

    def get(self, name: int, default=None):
        return self._names.get(name, default)

    def add(self, names: Iterable[int], values: Iterable | None = None) -> None:
        kept = self._names
        for name, value in zip(names, values) if values is not None else ((n, None) for n in names):
            kept[name] = value
            kept.move_to_end(name)
        self._forget_oldest()

    def _forget_oldest(self) -> None:
        while len(self._names) > self.limit:
            self._names.popitem(last=False)

    def discard(self, names: Iterable[int]) -> None:
        pop = self._names.pop
        for name in names:
            pop(name, None)


class UseCounts(NameWindow):
    """Lookups per name of the latest ``limit`` names looked up (a ghost history: kept after an entry left)."""

    __slots__ = ()

    def get(self, name: int, default: int = 0) -> int:
        return self._names.get(name, default)

    def add(self, names: Iterable[int]) -> None:
        counts = self._names
        for name in names:
            counts[name] = counts.get(name, 0) + 1
            counts.move_to_end(name)
        self._forget_oldest()
