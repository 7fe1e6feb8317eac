"""The one in-flight table of an ``EncoderStore`` (``mmcache.encoder_store``): concurrent misses on one key (name and
verifying ids) compute once. The first caller leads and computes; later callers join, wait, and take private copies
of the leader's value, or its exception. A miss on a name in flight with other verifying ids computes on its own."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_layout import flatten, unflatten


@dataclasses.dataclass(eq=False)
class Flight:
    verify_ids: bytes | None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    joiners: int = 0
    error: BaseException | None = None
    tree: Any = None
    leaves: list | None = None  # a private copy of the leader's value; each joiner clones it again

    def land(self, value: Any = None, got: bool = False) -> None:
        """The leader is done: with its value (``got``), copied before its caller can mutate it when anyone joined,
        or with ``error`` set. Joiners wake."""
        if self.joiners and got:
            self.tree = flatten(value, leaves := [])
            self.leaves = [t.detach().clone() for t in leaves]
        self.done.set()

    def result(self) -> Any:
        """Wait for the leader; a private copy of its value, or its exception raised."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return unflatten(self.tree, (t.clone() for t in self.leaves))


class Flights:
    """Misses in flight by name (callers hold the store's lock)."""

    def __init__(self):
        self._by_name: dict[tuple, Flight] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def take(self, key: EncoderKey) -> tuple[Flight | None, bool]:
        """A miss on ``key``: ``(flight, True)`` to lead a new one, ``(flight, False)`` to join one, ``(None, True)``
        to compute uncoordinated (another input with this name is in flight: a collision)."""
        flight = self._by_name.get(key.name)
        if flight is None:
            return self._by_name.setdefault(key.name, Flight(key.verify_ids)), True
        if flight.verify_ids == key.verify_ids:
            flight.joiners += 1
            return flight, False
        return None, True

    def close(self, key: EncoderKey, flight: Flight) -> None:
        """No more joiners for ``flight``: after this its count is final."""
        if self._by_name.get(key.name) is flight:
            del self._by_name[key.name]
