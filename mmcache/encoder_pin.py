"""What a caller of an ``EncoderStore`` (``mmcache.encoder_store``) holds: a ``Lookup`` (a private copy of a value and
where it came from) and an ``EncoderPin`` (one owner on a stored entry's pages), over the store's record of one stored
output (``StoredEntry``); and ``Lent``, the store's account of the owners it lent out."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any, Callable

import torch

from mmcache.encoder_key import EncoderKey
from mmcache.errors import PageOwnershipError
from mmcache.pool import PagePool


@dataclasses.dataclass(eq=False)
class StoredEntry:
    """One output the store holds: its key, its pages (one store owner each while indexed), where its tensors lie in
    them (``tree``, ``layout``: ``mmcache.encoder_layout``) and what the pool's policy orders it by."""

    key: EncoderKey
    pages: list[int]
    index: torch.Tensor  # ``pages`` as int64 on the pool's device, built once for index_select
    tree: Any
    layout: tuple  # (shape, dtype, byte offset) per tensor
    nbytes: int
    compute_s: float  # encoder time of the miss that stored it: what each hit saves
    tick: int = 0     # the pool clock at its last put, hit or pin
    rank: int = 0     # the pool policy's eviction key at that use (never lowered while stored)


@dataclasses.dataclass(frozen=True, slots=True)
class Lookup:
    """One ``get_or_compute`` (or one key of ``get_or_compute_many``): a private copy of the value, and where it came
    from: ``"store"`` (a hit), ``"host"`` or ``"shared"`` (a hit in the store's host tier or the store shared by
    instances, stored on the device again), ``"joined"`` (another caller's concurrent miss on the same key computed
    it) or ``"computed"`` (``fn`` ran for this caller)."""

    value: Any
    source: str
    pin: EncoderPin | None = None  # ``get_or_compute_many(..., pin=True)``: an owner on the entry, the caller's

    @property
    def hit(self) -> bool:
        """The encoder did not run for this caller (a stored value, or a joined concurrent miss)."""
        return self.source != "computed"


class EncoderPin:
    """One owner on one entry's pages: they are neither evicted nor reused until ``release`` (or the ``with`` ends).

    The pin holds the entry it found, so a later put or ``clear`` for its key leaves the pinned bytes intact.
    """

    def __init__(self, entry: StoredEntry, lock, read: Callable[[StoredEntry], Any],
                 give_back: Callable[[list[int]], None]):
        """``read``: a fresh copy of an entry's value (the store's gather; the pin's owner keeps its pages intact);
        ``give_back``: hands the pin's owner back to the store; ``lock``: the store's (its pool's ``cache_lock``)."""
        self._entry, self._lock, self._read, self._give_back, self._held = entry, lock, read, give_back, True

    @property
    def key(self) -> EncoderKey:
        return self._entry.key

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self._entry.pages)

    @property
    def value(self):
        """A fresh copy of the pinned value."""
        if not self._held:
            raise PageOwnershipError("read through a released pin")
        return self._read(self._entry)

    def release(self) -> None:
        """Drop the pin's owner; a second call does nothing."""
        with self._lock:
            held, self._held = self._held, False
            if held:
                self._give_back(self._entry.pages)

    def __enter__(self) -> EncoderPin:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class Lent:
    """The owners a store lends on its entries' pages, to hits copying out and to pins, counted per page until each is
    given back, so the store can say every owner it is answerable for (``EncoderStore.owners``). ``lock``: the store's
    (its pool's ``cache_lock``)."""

    def __init__(self, pool: PagePool, lock):
        self.pool, self.lock = pool, lock
        self.pages: Counter[int] = Counter()

    def lend(self, entry: StoredEntry) -> None:
        """One owner more on ``entry``'s pages (the caller holds the lock)."""
        self.pool.retain(entry.pages, distinct=True)  # an entry's pages never repeat
        self.pages.update(entry.pages)

    def give_back(self, pages: list[int]) -> None:
        """Drop owners ``lend`` took (one per page listed)."""
        with self.lock:
            lent = self.pages
            for p in pages:
                if lent[p] == 1:
                    del lent[p]
                else:
                    lent[p] -= 1
            self.pool.release(pages)

    def pin(self, entry: StoredEntry, read: Callable[[StoredEntry], Any]) -> EncoderPin:
        """A pin holding an owner ``lend`` took on ``entry``."""
        return EncoderPin(entry, self.lock, read, self.give_back)
