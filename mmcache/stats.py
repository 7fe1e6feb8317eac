"""Typed statistics: one frozen snapshot per ``stats()`` call, read by attribute; ``to_dict()`` gives the flat dict
that JSON reports and Prometheus consume.

A snapshot is taken under its owner's lock, so its fields are mutually consistent; it never changes afterwards.

``COUNTERS`` is the one table of the counters that every tier (``TIERS``: the device pool, the host tier, the shared
store) keeps for each kind of entry (``KINDS``: KV pages, encoder outputs): each counter's name, what it counts and
the stats field each tier and kind keeps it in. ``counter_values`` reads them off a workload's ``cache_stats()``;
Prometheus exports each as ``mmcache_tier_<name>_total{tier, kind}`` and the HTML report lists them under the same
names (``workloads.harness.prometheus``, ``workloads.harness.report``).
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True, slots=True)
class _Snapshot:
    def to_dict(self) -> dict:
        """The fields as a plain dict, in declaration order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, slots=True)
class PrefixCacheStats(_Snapshot):
    """``PrefixCache.stats()``: index counters since creation, then the pool and the live table now.

    ``pages_live`` counts pages some live request holds (indexed or not); ``pages_cached`` the indexed pages.
    ``evicted_pages`` counts the pages evictions took out of this index, ``freed_pages`` those of them that went free
    (the others, descendants a live request holds, stay with it); ``eviction_batches``, ``shortfall_pages`` and
    ``stalls`` the shortfalls of the owner that asked for pages: the cache's requests (in M*, the node's arena, which
    takes every stream's pages: ``ReuseKVManager.stats``). ``listener_errors`` counts the calls to the pool's
    policy, the observer and the lower tier that raised and that the cache went on without (``mmcache.guard``).
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
    listener_errors: int = 0
    pages_free: int = 0
    pages_live: int = 0
    pages_cached: int = 0
    requests_live: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderCounters(_Snapshot):
    """One set of ``EncoderStore`` counters (all modalities, or one). ``bytes_stored`` is what is stored now; the
    rest only grow. ``hits``/``misses`` are the device store's; a device miss then asks the tiers, each counting a
    hit, a miss or a rejection (an entry that failed verification: a miss too), the shared store's MAC failures
    apart from its other rejections. ``evictions`` counts the entries evicted from the device, ``evicted_bytes``
    their bytes, ``evicted_pages`` their pages and ``freed_pages`` those of them that went free in the pool (an
    entry is evicted only when the store alone holds its pages: all of them, unless a page is pinned meanwhile).
    ``host_spilled`` counts evicted entries written to the host tier.
    ``time_saved_s`` sums the encoder time of the misses whose stored outputs later hits returned, tier hits
    included (the time the instance that computed the entry measured)."""

    queries: int = 0
    hits: int = 0
    misses: int = 0
    bytes_stored: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    evicted_pages: int = 0
    freed_pages: int = 0
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


class EncoderTally:
    """An ``EncoderStore``'s running counters (``EncoderCounters``' fields), in total and per modality."""

    __slots__ = ("totals", "by_modality")

    def __init__(self):
        self.totals = EncoderCounters().to_dict()
        self.by_modality: dict[str, dict] = {}

    def count(self, modality: str, **deltas) -> None:
        per = self.by_modality.get(modality)
        if per is None:
            per = self.by_modality[modality] = EncoderCounters().to_dict()
        for name, delta in deltas.items():
            self.totals[name] += delta
            per[name] += delta


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderStoreStats(_Snapshot):
    """``EncoderStore.stats()``: the counter ``totals``, ``entries`` and ``capacity_bytes`` now, the counters per
    modality, then the tiers' counters that are not per modality (``EncoderTiers.stats()``; an absent tier's stay at
    their defaults): which tiers there are (``host``, ``store``); the host tier's spills of entries it held already
    (``host_refreshed_entries``) or could not fit (``host_full_entries``), and the pages its eviction took out of it
    (``host_evicted_pages``) and freed (``host_freed_pages``), and the calls to its policy that raised
    (``host_listener_errors``); the shared store's puts of encoder entries, as
    ``TierStats`` counts them for KV pages: stored (``store_published_entries``), already held, refused for space,
    dropped, and entries removed to make room or because a reader refused them; ``listener_errors``, the calls to the
    pool's policy, the observer and the tiers that raised and that the store went on without (``mmcache.guard``).
    ``to_dict()`` flattens the totals and the tier counters into the top level (the shape reports read)."""

    totals: EncoderCounters = EncoderCounters()
    entries: int = 0
    capacity_bytes: int = 0
    by_modality: dict[str, EncoderCounters] = dataclasses.field(default_factory=dict)
    host: bool = False
    store: bool = False
    host_refreshed_entries: int = 0
    host_full_entries: int = 0
    host_evicted_pages: int = 0
    host_freed_pages: int = 0
    host_listener_errors: int = 0
    store_published_entries: int = 0
    store_publish_exists: int = 0
    store_publish_full: int = 0
    store_publish_dropped: int = 0
    store_room_removed: int = 0
    store_refused_removed: int = 0
    listener_errors: int = 0

    def to_dict(self) -> dict:
        tiers = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                 if f.name not in ("totals", "entries", "capacity_bytes", "by_modality")}
        return {**self.totals.to_dict(), "entries": self.entries, "capacity_bytes": self.capacity_bytes, **tiers,
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
    Host tier: ``host_written_pages`` copied in on eviction from the device, ``host_refreshed_pages`` found held
    already, ``host_full_pages`` skipped for want of room; ``host_evicted_pages`` taken out by its eviction,
    ``host_freed_pages`` of them gone free in the host pool; ``host_collisions``: lookups that found a page under its
    name whose ids differ.
    ``store_wait``: seconds each lookup that asked the store spent in it (its batched reads within the deadline, and
    verification); lookups that skipped a store marked down are in ``store_skipped``, not here. A ``StoreTier`` that
    an ``EncoderStore``'s tiers share counts their reads and its health for both kinds (``store_gets`` ...
    ``store_probes``, ``store_wait``); its puts and removals are per kind: the KV pages' here, the encoder
    entries' in ``EncoderStoreStats``.
    Publishing: ``store_published_pages`` were stored; ``store_publish_exists`` were already held (Mooncake's put
    never overwrites); ``store_publish_full`` were refused for space even after ``store_room_removed`` of the tier's
    own oldest entries were removed to make room; ``store_publish_dropped`` never reached the store (queue full, store
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
    host_full_pages: int = 0
    host_evicted_pages: int = 0
    host_freed_pages: int = 0
    host_hit_pages: int = 0
    host_collisions: int = 0
    host_listener_errors: int = 0
    store_up: bool = False
    store_published_pages: int = 0
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


# -------------------------------------------------------------------------------------- the counters per tier and kind
TIERS = ("device", "host", "store")
KINDS = ("kv", "encoder")
SECTIONS = {"prefix": "PrefixCacheStats", "tiers": "TierStats", "encoder": "EncoderStoreStats"}  # cache_stats() keys


@dataclasses.dataclass(frozen=True, slots=True)
class Cell:
    """Where one tier keeps a counter for one kind: ``where`` names the stats field (``Class.field``, or how it is
    derived), ``read`` takes it from a workload's ``cache_stats()`` (``SECTIONS``)."""

    tier: str
    kind: str
    where: str
    read: Callable[[dict], float]


@dataclasses.dataclass(frozen=True, slots=True)
class TierCounter:
    """One counter of ``COUNTERS``: its ``name`` (Prometheus: ``mmcache_tier_<name>_total{tier, kind}``; the HTML
    report: its row's name), what it counts (``meaning``), and the ``cells`` of the tiers and kinds that keep it."""

    name: str
    meaning: str
    cells: tuple[Cell, ...]


def _section(tier: str, kind: str) -> str:
    """The ``cache_stats()`` key of ``tier``'s counters for ``kind``: the device's KV pages in ``prefix``, their lower
    tiers in ``tiers``, encoder outputs in ``encoder`` (every tier)."""
    return "encoder" if kind == "encoder" else "prefix" if tier == "device" else "tiers"


def _field(tier: str, kind: str, field: str) -> Cell:
    """The cell of a plain stats field."""
    section = _section(tier, kind)
    return Cell(tier, kind, f"{SECTIONS[section]}.{field}", lambda stats: stats[section][field])


def _adopted(stats: dict, tier: str) -> int:
    """Prompt tokens of the verified pages lower tier ``tier`` gave requests (0 without it)."""
    tiers = stats.get("tiers")
    return tiers[f"{tier}_adopted_pages"] * tiers["page_size"] if tiers and tiers[tier] else 0


_KV_HITS = (  # hit tokens by tier: the device's share is the prefix cache's hits less the lower tiers'
    Cell("device", "kv", "PrefixCacheStats.hit_tokens less the host's and store's",
         lambda stats: stats["prefix"]["hit_tokens"] - _adopted(stats, "host") - _adopted(stats, "store")),
    *(Cell(t, "kv", f"TierStats.{t}_adopted_pages x page_size", lambda stats, t=t: _adopted(stats, t))
      for t in ("host", "store")))

COUNTERS = (
    TierCounter("evicted_pages", "Pages eviction took out of the tier's index (device KV: with their indexed "
                "descendants, which a live request may still hold; encoder: every page of each evicted output).",
                (_field("device", "kv", "evicted_pages"), _field("device", "encoder", "evicted_pages"),
                 _field("host", "kv", "host_evicted_pages"), _field("host", "encoder", "host_evicted_pages"))),
    TierCounter("freed_pages", "Of the evicted pages, those that went free in the tier's pool (a page another owner "
                "holds stays with it).",
                (_field("device", "kv", "freed_pages"), _field("device", "encoder", "freed_pages"),
                 _field("host", "kv", "host_freed_pages"), _field("host", "encoder", "host_freed_pages"))),
    TierCounter("hit_tokens", "Prompt tokens lookups got from the tier: verified KV pages given to requests (the "
                "three tiers add up to the prefix cache's hit tokens).", _KV_HITS),
    TierCounter("hits", "Encoder outputs lookups got from the tier, verified (a device miss asks the host tier, then "
                "the store).",
                (_field("device", "encoder", "hits"), _field("host", "encoder", "host_hits"),
                 _field("store", "encoder", "store_hits"))),
    TierCounter("put_stored", "Puts the tier stored, one per KV page or encoder output (host: written on eviction "
                "from the device; store: published).",
                (_field("host", "kv", "host_written_pages"), _field("host", "encoder", "host_spilled"),
                 _field("store", "kv", "store_published_pages"),
                 _field("store", "encoder", "store_published_entries"))),
    TierCounter("put_held", "Puts of an entry the tier held already, left as it was (host: marked used; store: "
                "Mooncake's put never overwrites).",
                (_field("host", "kv", "host_refreshed_pages"), _field("host", "encoder", "host_refreshed_entries"),
                 _field("store", "kv", "store_publish_exists"), _field("store", "encoder", "store_publish_exists"))),
    TierCounter("put_no_room", "Puts skipped for want of room once the tier had made what room it could (a skip, "
                "not an outage).",
                (_field("host", "kv", "host_full_pages"), _field("host", "encoder", "host_full_entries"),
                 _field("store", "kv", "store_publish_full"), _field("store", "encoder", "store_publish_full"))),
    TierCounter("put_dropped", "Puts that never reached the store: its queue was full, it was marked down, or the "
                "put failed.",
                (_field("store", "kv", "store_publish_dropped"), _field("store", "encoder", "store_publish_dropped"))),
    TierCounter("room_removed", "The tier's own oldest entries it removed from the store to make room for a put.",
                (_field("store", "kv", "store_room_removed"), _field("store", "encoder", "store_room_removed"))),
    TierCounter("rejected", "Entries a lookup read from the tier and refused: a verifying field differs "
                "(fingerprint, salt, layout, depth, tokens, media, lineage or checksum); a miss.",
                (_field("host", "kv", "host_collisions"), _field("host", "encoder", "host_rejected"),
                 _field("store", "kv", "store_rejected"), _field("store", "encoder", "store_rejected"))),
    TierCounter("mac_failures", "Store entries whose keyed MAC failed (forged, keyless or under another key): "
                "refused, a miss.",
                (_field("store", "kv", "store_mac_failures"), _field("store", "encoder", "store_mac_failures"))),
    TierCounter("refused_removed", "Refused entries removed from the store, so the next publish of the real bytes "
                "is stored and served.",
                (_field("store", "kv", "store_refused_removed"), _field("store", "encoder", "store_refused_removed"))),
)


def _has_cell(stats: dict, tier: str, kind: str) -> bool:
    """Whether a workload's ``cache_stats()`` holds ``tier``'s counters for ``kind``: the section is there and, for a
    lower tier, the cache has that tier."""
    section = stats.get(_section(tier, kind))
    return section is not None and (tier == "device" or bool(section[tier]))


def counter_values(stats: dict) -> dict[tuple[str, str, str], float]:
    """``{(name, tier, kind): value}`` of every cell of ``COUNTERS`` that a workload's ``cache_stats()`` (``prefix``,
    ``tiers``, ``encoder``, each optional) holds, in table order."""
    return {(c.name, cell.tier, cell.kind): cell.read(stats) for c in COUNTERS for cell in c.cells
            if _has_cell(stats, cell.tier, cell.kind)}
