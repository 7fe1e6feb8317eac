"""Phase 1, names without pages: measure the reuse a workload would get without changing what an engine does.

The table keeps, per page name, the verifying ids a real index would compare (parent name, salt, tokens, media), so
the measured matches are the ones PrefixCache would confirm with an unbounded pool.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Hashable, Sequence

from mmcache.errors import DuplicateRequest, UnknownRequest
from mmcache.names import Fingerprint, NamedPrompt, as_tokens, digest_as_bytes
from mmcache.stats import ShadowStats


@dataclasses.dataclass(frozen=True, slots=True)
class ShadowMatch:
    """One request's would-be reuse: ``matched_pages`` from finished requests, and past the first miss,
    ``inflight_pages`` more that a request still in flight was computing (reusable with in-flight sharing)."""

    rid: Hashable
    prompt_tokens: int
    matched_pages: int
    inflight_pages: int


class ReplicaSpread:
    """How many replicas each repeated prefix lands on: per page name (a name stands for its whole prefix), the set
    of replicas whose requests held it, as a bit mask over replica numbers given in first-seen order.

    ``mean``/``max`` are over the names seen at least twice; 1.0 means every repeated prefix stayed on one replica,
    R that every one was spread over all R (one copy per replica)."""

    def __init__(self):
        self._replicas: dict[Hashable, int] = {}
        self._masks: dict[int, int] = {}
        self._seen: Counter[int] = Counter()

    def add(self, names: Sequence[int], replica: Hashable) -> None:
        bit = 1 << self._replicas.setdefault(replica, len(self._replicas))
        masks = self._masks
        for name in names:
            masks[name] = masks.get(name, 0) | bit
        self._seen.update(names)

    def summary(self) -> tuple[int, float, int]:
        """``(repeated prefixes, mean replicas per repeated prefix, most replicas of one)``."""
        spreads = [self._masks[n].bit_count() for n, c in self._seen.items() if c > 1]
        return len(spreads), (sum(spreads) / len(spreads) if spreads else 0.0), max(spreads, default=0)

    @property
    def replicas(self) -> int:
        return len(self._replicas)


@dataclasses.dataclass(slots=True, eq=False)
class _Live:
    prompt: NamedPrompt
    salt_id: int


class ShadowIndex:
    """Names and verifying ids of every finished request's full pages, with no pages and no eviction.

    Invariant: an entry is added only at ``finish`` and never removed, so ``matched_pages`` is the ceiling an
    infinite pool would realize. Nothing here is visible to the engine being measured. ``rows_left``: the prompt
    tokens a match leaves to compute, as the reuse it measures leaves them (``NamedPrompt.matchable``).

    Phase 1's side effects: every media digest admitted is counted (``duplicate_media_rate``: the share already seen
    before, i.e. the encoder runs a digest-keyed store would save), and ``admit(..., replica=r)`` records which
    data-parallel replica served the request (``ReplicaSpread``: how many replicas a repeated prefix lands on).
    """

    def __init__(self, fingerprint: Fingerprint, rows_left: int = 1):
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self.rows_left = rows_left
        self.records: list[ShadowMatch] = []
        self._table: dict[int, tuple[int, int, bytes, bytes]] = {}
        self._salt_ids: dict[bytes, int] = {b"": 0}
        self._live: dict[Hashable, _Live] = {}
        self._inflight: Counter[int] = Counter()
        self._media_seen: set[tuple[bytes, bytes]] = set()
        self._media_items = self._repeated_media = 0
        self.spread = ReplicaSpread()
        self._lock = threading.Lock()

    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None, replica: Hashable = 0) -> ShadowMatch:
        P = self.page_size
        prompt = NamedPrompt.build(self.fingerprint, token_ids, media, salt, names, what=f"request {rid!r}")
        tokens, names, limit = prompt.tokens, prompt.names, prompt.matchable(self.rows_left)
        mids = prompt.media_ids(limit)
        digests = [(bytes(salt), digest_as_bytes(d)) for _, d in media or ()]  # media_by_page has checked each mark
        with self._lock:
            if rid in self._live:
                raise DuplicateRequest(f"request {rid!r} is already live")
            for d in digests:
                self._repeated_media += d in self._media_seen
                self._media_seen.add(d)
            self._media_items += len(digests)
            self.spread.add(names[:limit], replica)
            salt_id = self._salt_ids.setdefault(bytes(salt), len(self._salt_ids))
            k, parent = 0, None
            while k < limit and self._table.get(names[k]) == (parent, salt_id, tokens[k * P:(k + 1) * P].tobytes(),
                                                               mids[k].tobytes()):
                parent = names[k]
                k += 1
            inflight = 0
            while k + inflight < limit and self._inflight[names[k + inflight]]:
                inflight += 1
            self._live[rid] = _Live(prompt, salt_id)
            self._inflight.update(names[:limit])
            match = ShadowMatch(rid, int(tokens.size), k, inflight)
            self.records.append(match)
            return match

    def finish(self, rid: Hashable, output_ids=()) -> None:
        """Record the full pages of prompt + output under their names, as PrefixCache.finish would index them."""
        with self._lock:
            live = self._pop(rid)
        out = as_tokens(output_ids)
        names, page_tokens, mids = live.prompt.written_pages(out, live.prompt.tokens.size + out.size)
        with self._lock:
            parent = None
            for name, tokens, mid in zip(names, page_tokens, mids):
                self._table.setdefault(name, (parent, live.salt_id, tokens.tobytes(), mid.tobytes()))
                parent = name

    def abort(self, rid: Hashable) -> None:
        with self._lock:
            self._pop(rid)

    def _pop(self, rid: Hashable) -> _Live:
        live = self._live.pop(rid, None)
        if live is None:
            raise UnknownRequest(f"request {rid!r} is not live in the shadow index")
        for name in live.prompt.names[:live.prompt.matchable(self.rows_left)]:
            if self._inflight[name] > 1:
                self._inflight[name] -= 1
            else:
                del self._inflight[name]
        return live

    def stats(self) -> ShadowStats:
        """Matched-page share, in-flight overlap, duplicate media and replica spread over every request so far."""
        with self._lock:
            recs = self.records
            pages = sum(r.prompt_tokens // self.page_size for r in recs)
            matched = sum(r.matched_pages for r in recs)
            inflight = sum(r.inflight_pages for r in recs)
            repeated, mean, most = self.spread.summary()
            return ShadowStats(requests=len(recs), prompt_pages=pages, matched_pages=matched,
                               matched_page_share=matched / pages if pages else 0.0, inflight_pages=inflight,
                               misses_held_in_flight=sum(r.inflight_pages > 0 for r in recs),
                               table_pages=len(self._table), media_items=self._media_items,
                               repeated_media=self._repeated_media,
                               duplicate_media_rate=self._repeated_media / self._media_items if self._media_items
                               else 0.0, replicas=self.spread.replicas, repeated_prefixes=repeated,
                               replica_spread_mean=mean, replica_spread_max=most)
