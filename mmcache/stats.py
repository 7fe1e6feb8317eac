"""Typed statistics: one frozen snapshot per ``stats()`` call, read by attribute; ``to_dict()`` gives the flat dict
that JSON reports and Prometheus consume.

A snapshot is taken under its owner's lock, so its fields are mutually consistent; it never changes afterwards.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class _Snapshot:
    def to_dict(self) -> dict:
        """The fields as a plain dict, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCacheStats(_Snapshot):
    """``PrefixCache.stats()``: index counters since creation, then the pool and the live table now.

    ``pages_live`` counts pages some live request holds (indexed or not); ``pages_cached`` the indexed pages.
    ``evicted_pages`` counts the pages evictions took out of this index, ``freed_pages`` those of them that went free (the
    others, descendants a live request holds, stay with it); ``eviction_batches``, ``shortfall_pages`` and ``stalls``
    the shortfalls of the owner that asked for pages: the cache's requests (in M*, the node's arena, which takes every
    stream's pages: ``ReuseKVManager.stats``).
    """

    queries: int = 0
    hits: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    freed_pages: int = 0
    eviction_batches: int = 0
    shortfall_pages: int = 0
    stalls: int = 0
    collisions: int = 0
    pages_free: int = 0
    pages_live: int = 0
    pages_cached: int = 0
    requests_live: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderCounters(_Snapshot):
    """One set of ``EncoderStore`` counters (all modalities, or one). ``bytes_stored`` is what is stored now; the
    rest only grow. ``hits``/``misses`` are the device store's; a device miss then asks the tiers, each counting a
    hit, a miss or a rejection (an entry that failed verification: a miss too), the shared store's MAC failures
    apart from its other rejections. ``host_spilled`` counts evicted entries written to the host tier.
    ``time_saved_s`` sums the encoder time of the misses whose stored outputs later hits returned, tier hits
    included (the time the instance that computed the entry measured)."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    bypasses: int = 0
    joins: int = 0
    collisions: int = 0
    time_saved_s: float = 0.0
    host_spilled: int = 0
    host_hits: int = 0
    host_misses: int = 0
    host_rejected: int = 0
    store_hits: int = 0
    store_misses: int = 0
    store_rejected: int = 0
    store_mac_failures: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderStoreStats(_Snapshot):
    """``EncoderStore.stats()``: the counter ``totals``, ``entries`` and ``capacity_bytes`` now, and the counters
    per modality. ``to_dict()`` flattens the totals into the top level (the shape reports read)."""

    totals: EncoderCounters = EncoderCounters()
    entries: int = 0
    capacity_bytes: int = 0
    by_modality: dict[str, EncoderCounters] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**self.totals.to_dict(), "entries": self.entries, "capacity_bytes": self.capacity_bytes,
                "by_modality": {m: c.to_dict() for m, c in self.by_modality.items()}}


@dataclasses.dataclass(frozen=True, slots=True)
class ShadowStats(_Snapshot):
    """``ShadowIndex.stats()``: matched-page share and in-flight overlap over every request admitted so far."""

    requests: int = 0
    prompt_pages: int = 0
    matched_pages: int = 0
    matched_page_share: float = 0.0
    inflight_pages: int = 0
    misses_held_in_flight: int = 0
    table_pages: int = 0
    media_items: int = 0                # media marks admitted
    repeated_media: int = 0             # of them, digests (under their salt) seen before
    duplicate_media_rate: float = 0.0
    replicas: int = 0                   # distinct replicas given to admit
    repeated_prefixes: int = 0          # page names admitted at least twice
    replica_spread_mean: float = 0.0    # replicas per repeated prefix, mean over them
    replica_spread_max: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class HistogramStats(_Snapshot):
    """A ``WaitHistogram`` (``mmcache.histogram``) at one instant: ``counts[i]`` observations fell above
    ``bounds[i - 1]`` and at or below ``bounds[i]``; the last count (one more count than bounds) lies above every
    bound. ``sum`` adds every observation. Not cumulative: Prometheus's ``le`` buckets are running sums of these."""

    bounds: tuple[float, ...] = ()
    counts: tuple[int, ...] = (0,)
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclasses.dataclass(frozen=True, slots=True)
class TierStats(_Snapshot):
    """``TierStack.stats()``: which tiers there are, the KV pages each gave requests, the host tier's and the store's
    counters since creation, and their state now. An absent tier's fields stay at their defaults.

    ``*_adopted_pages``: pages of a tier's verified hits copied up and given to a request (the tier's own
    ``*_hit_pages`` less those dropped when the device had no room or the chain left the index meanwhile); with the
    device's share (``PrefixCacheStats.hit_tokens / page_size`` less both) they are the hits by tier.
    ``store_wait``: seconds each lookup that asked the store spent in it (its batched reads within the deadline, and
    verification); lookups that skipped a store marked down are in ``store_skipped``, not here. A ``StoreTier`` that
    an ``EncoderStore``'s tiers share counts their reads too (``store_published_entries``: encoder entries put; their
    wait is the batched read, verified after it).
    Publishing: ``store_published_*`` were stored; ``store_publish_exists`` were already held (Mooncake's put never
    overwrites); ``store_publish_full`` were refused for space even after ``store_room_removed`` of the tier's own
    oldest entries were removed to make room; ``store_publish_dropped`` never reached the store (queue full, store
    down, put failed). ``store_refused_removed``: entries a reader refused (MAC or verification), removed so the next
    publish of the real bytes is stored. ``store_marked_down``: times the store was marked down (a failure rate over
    its window, or a read stalled past its deadline); ``store_skipped_late_read``: lookups that skipped the store while
    a late read was still in flight.
    ``to_dict()`` is flat (``host_*`` and ``store_*`` keys), ``store_wait`` as its own dict.
    """

    page_size: int = 0
    host: bool = False
    store: bool = False
    host_adopted_pages: int = 0
    store_adopted_pages: int = 0
    host_pages_held: int = 0
    host_written_pages: int = 0
    host_refreshed_pages: int = 0
    host_dropped_pages: int = 0
    host_hit_pages: int = 0
    host_collisions: int = 0
    store_up: bool = False
    store_published_pages: int = 0
    store_published_entries: int = 0
    store_publish_dropped: int = 0
    store_hit_pages: int = 0
    store_gets: int = 0
    store_batches: int = 0
    store_misses: int = 0
    store_rejected: int = 0
    store_mac_failures: int = 0
    store_failures: int = 0
    store_late: int = 0
    store_read_errors: int = 0
    store_skipped: int = 0
    store_skipped_late_read: int = 0
    store_probes: int = 0
    store_marked_down: int = 0
    store_publish_full: int = 0
    store_publish_exists: int = 0
    store_room_removed: int = 0
    store_refused_removed: int = 0
    store_wait: HistogramStats = HistogramStats()

    def to_dict(self) -> dict:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "store_wait": self.store_wait.to_dict()}
