"""What an ``EncoderStore`` (``mmcache.encoder_store``) calls out to: the storage under its pool
(``EncoderLowerTier``, which answers a fetch with a ``TierRead`` per key) and the observer told of what it holds
(``EncoderObserver``)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_layout import StoredBytes


@dataclasses.dataclass(frozen=True, eq=False)
class TierRead:
    """What ``EncoderLowerTier.fetch`` found for one key: a verified ``entry`` and the tier it came from
    (``source``: ``"host"`` or ``"shared"``), or neither; ``counts``: the tier counters it advanced (names of
    ``mmcache.stats.EncoderCounters`` fields: ``host_hits``, ``store_rejected``, ...)."""

    entry: StoredBytes | None = None
    source: str | None = None
    counts: dict = dataclasses.field(default_factory=dict)


class EncoderObserver(Protocol):
    """Hears which outputs the store holds (``mmcache.kv_events.KVEventPublisher``: events for external routers).
    Called under the pool's ``cache_lock``: it must only queue what it hears, never block."""

    def encoder_stored(self, key: EncoderKey, nbytes: int) -> None:
        """An output of ``nbytes`` bytes was stored under ``key`` (a put, or a tier's copy stored again)."""

    def encoder_removed(self, keys: list[EncoderKey]) -> None:
        """The outputs stored under ``keys`` left the store (evicted, replaced or cleared)."""


class EncoderLowerTier(Protocol):
    """Storage below an ``EncoderStore``'s pool (``mmcache.tiers.EncoderTiers``). A tier's failure is a miss:
    nothing raises into a lookup, and nothing blocks past the tier's own deadline."""

    def spill(self, entries: list[StoredBytes]) -> list[bool]:
        """The store is evicting ``entries`` (called under the pool's ``cache_lock``): keep what the tier keeps;
        whether each was written."""

    def publish(self, entry: StoredBytes) -> None:
        """``entry`` was just stored (no lock held): share it (queued, off the request's path)."""

    def replaced(self, key: EncoderKey) -> None:
        """A computed value is being put under ``key`` (called under the pool's ``cache_lock``): drop what this
        process's tiers hold of an older value, so a get never returns anything but the last value put."""

    def fetch(self, keys: list[EncoderKey], accept: Callable[[EncoderKey, tuple], bool]) -> list[TierRead]:
        """A ``TierRead`` per key (no lock held, one bounded wait for the whole call): an entry verified against its
        key in full and by ``accept(key, layout)`` before it is returned."""

    def stats(self) -> dict:
        """The tiers' counters that are not per modality (``mmcache.stats.EncoderStoreStats`` fields: ``host``,
        ``store``, ``host_*``, ``store_*``)."""
