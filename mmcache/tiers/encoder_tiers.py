"""EncoderTiers: the host tier and the shared store under one ``EncoderStore``, as the ``EncoderLowerTier`` the store
declares (``EncoderStore(..., tiers=EncoderTiers(host=..., store=...))``).

- ``spill`` (from the store's eviction, under its pool's ``cache_lock``): evicted entries are encoded keyless and
  written to the ``EncoderHostTier`` (write-back on eviction; an entry already held there is only refreshed).
- ``replaced`` (every put of a computed value, under the pool's ``cache_lock``): the host tier drops its copy of the
  key, which a later spill would otherwise find held and keep.
- ``publish`` (after every put of a computed value): the entry, sealed with the store's key, is queued on the
  ``StoreTier``'s publisher thread (write-through, so another instance can use it while it is hot here). The
  ``StoreTier`` is the same one a KV ``TierStack`` may use: one publisher, one deadline, one key, one down/probe
  state for both kinds of entries.
- ``fetch`` (a device miss, no device lock held): the host tier under its own pool's lock, then the shared store for
  what is still missing, in batches within one deadline for the whole call (``StoreTier.fetch``); every payload is
  verified in full (``encoder_entry.decode``) and by the store's ``accept`` before it is returned. A shared entry
  that fails ``decode`` (forged, corrupt, under another key) is removed from the store (``StoreTier.discard``), so the
  next publish of the real entry is stored and served.

Nothing here raises into a lookup: a tier that is down, late or holds a bad entry gives a miss, counted.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_layout import StoredBytes
from mmcache.encoder_protocols import TierRead
from mmcache.tiers import encoder_entry
from mmcache.tiers.encoder_host import EncoderHostTier
from mmcache.tiers.store import PUBLISHED, StoreTier

KIND = "encoder"  # the kind of entry these tiers put in a ``StoreTier`` (``KINDS``)


@dataclasses.dataclass
class EncoderTiers:
    """An ``EncoderHostTier`` and/or a ``StoreTier`` under one encoder store (either may be None)."""

    host: EncoderHostTier | None = None
    store: StoreTier | None = None

    def spill(self, entries: list[StoredBytes]) -> list[bool]:
        """Write each evicted entry to the host tier (keyless: host memory is this process's); whether it was
        written (False without a host tier, for an entry held already, or one that cannot fit)."""
        if self.host is None:
            return [False] * len(entries)
        out = []
        for entry in entries:
            key = encoder_entry.entry_key(entry.key)
            if self.host.holds(key, entry.key.verify_ids):
                out.append(False)
                continue
            payload = encoder_entry.encode(entry)
            out.append(payload is not None and self.host.put(key, payload, entry.key.verify_ids))
        return out

    def publish(self, entry: StoredBytes) -> None:
        """Queue ``entry`` for the shared store (while it is down: dropped, counted as the publisher counts it); its
        bytes are read before this returns."""
        if self.store is None or not self.store.publishing(1, KIND):
            return
        payload = encoder_entry.encode(entry, self.store.key)
        if payload is not None:
            self.store.publish([(encoder_entry.entry_key(entry.key), payload)], KIND)

    def replaced(self, key: EncoderKey) -> None:
        """Drop the host tier's copy of ``key`` (an older value: a spill finds it held and would keep it). The shared
        store is written through by the next ``publish``."""
        if self.host is not None:
            self.host.discard(encoder_entry.entry_key(key))

    def stats(self) -> dict:
        """The tiers' counters that are not per modality, as ``mmcache.stats.EncoderStoreStats`` fields: which tiers
        there are, the host tier's ``host_*`` counters and the shared store's puts and removals of encoder entries
        (``store_*``: this kind's alone, where the store also holds KV pages)."""
        out = {"host": self.host is not None, "store": self.store is not None}
        if self.host is not None:
            out.update({f"host_{k}": v for k, v in self.host.counters.items()})
        if self.store is not None:
            out.update({f"store_{PUBLISHED[KIND] if k == 'published' else k}": v
                        for k, v in self.store.kinds[KIND].items()})
        return out

    def fetch(self, keys: list[EncoderKey], accept: Callable[[EncoderKey, tuple], bool]) -> list[TierRead]:
        """A ``TierRead`` per key: the host tier first, the shared store for the rest (one deadline), each entry
        verified in full and by ``accept(key, layout)``."""
        names = [encoder_entry.entry_key(k) for k in keys]
        found: list[StoredBytes | None] = [None] * len(keys)
        source: list[str | None] = [None] * len(keys)
        counts = [dict() for _ in keys]
        if self.host is not None:
            for i, (key, name) in enumerate(zip(keys, names)):
                payload = self.host.get(name)
                found[i] = self._verified(payload, key, None, accept, counts[i], "host")
                source[i] = "host" if found[i] is not None else None
        todo = [i for i in range(len(keys)) if found[i] is None]
        if self.store is not None and todo:
            for i, payload in zip(todo, self.store.fetch([names[i] for i in todo])):
                found[i] = self._verified(payload or None, keys[i], self.store.key, accept, counts[i], "store",
                                          lambda name=names[i]: self.store.discard(name, KIND))
                source[i] = "shared" if found[i] is not None else None
        return [TierRead(e, s, c) for e, s, c in zip(found, source, counts)]

    @staticmethod
    def _verified(payload, key: EncoderKey, mac_key: bytes | None, accept, counts: dict, tier: str,
                  refused: Callable[[], None] | None = None) -> StoredBytes | None:
        """The entry of ``payload`` if it verifies as ``key``'s and ``accept`` takes it; counts ``<tier>_hits``,
        ``_misses`` (absent), ``_rejected`` or ``_mac_failures``. ``refused()`` is called for an entry that fails
        ``decode`` (not one ``accept`` declines: its layout is only not what this store expects)."""
        if payload is None:
            counts[f"{tier}_misses"] = 1
            return None
        entry = encoder_entry.decode(payload, key, mac_key)
        if isinstance(entry, str):
            counts[f"{tier}_mac_failures" if entry == "mac" else f"{tier}_rejected"] = 1
            if refused is not None:
                refused()
            return None
        if not accept(key, entry.layout):
            counts[f"{tier}_rejected"] = 1
            return None
        counts[f"{tier}_hits"] = 1
        return entry
