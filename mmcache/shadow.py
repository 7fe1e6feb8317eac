"""Phase 1, names without pages: measure the reuse a workload would get without changing what an engine does.

The table keeps, per page name, the verifying ids a real index would compare (parent name, salt, tokens, media), so
the measured matches are the ones PrefixCache would confirm with an unbounded pool.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from typing import Hashable, Sequence

import numpy as np

from mmcache.checks import as_names
from mmcache.errors import DuplicateRequest, InvalidRequest, UnknownRequest
from mmcache.names import Fingerprint, as_tokens, chain, chain_root, media_by_page, media_ids
from mmcache.stats import ShadowStats


@dataclasses.dataclass(frozen=True, slots=True)
class ShadowMatch:
    """One request's would-be reuse: ``matched_pages`` from finished requests, and past the first miss,
    ``inflight_pages`` more that a request still in flight was computing (reusable with in-flight sharing)."""

    rid: Hashable
    prompt_tokens: int
    matched_pages: int
    inflight_pages: int


@dataclasses.dataclass(slots=True, eq=False)
class _Live:
    tokens: np.ndarray
    media: dict[int, bytes]
    root: int
    salt_id: int
    names: list[int]


class ShadowIndex:
    """Names and verifying ids of every finished request's full pages, with no pages and no eviction.

    Invariant: an entry is added only at ``finish`` and never removed, so ``matched_pages`` is the ceiling an
    infinite pool would realize. Nothing here is visible to the engine being measured.
    """

    def __init__(self, fingerprint: Fingerprint):
        self.fingerprint = fingerprint
        self.page_size = fingerprint.page_size
        self.records: list[ShadowMatch] = []
        self._table: dict[int, tuple[int, int, bytes, bytes]] = {}
        self._salt_ids: dict[bytes, int] = {b"": 0}
        self._live: dict[Hashable, _Live] = {}
        self._inflight: Counter[int] = Counter()
        self._lock = threading.Lock()

    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None) -> ShadowMatch:
        P = self.page_size
        tokens = as_tokens(token_ids)
        if tokens.size == 0:
            raise InvalidRequest(f"request {rid!r}: a prompt needs at least one token")
        root = chain_root(self.fingerprint, salt)
        blobs = media_by_page(media, P, tokens.size)
        names = chain(root, tokens, P, 0, blobs) if names is None else as_names(names, tokens.size // P,
                                                                                 f"request {rid!r}")
        limit = (tokens.size - 1) // P
        mids = media_ids(blobs, range(limit))
        with self._lock:
            if rid in self._live:
                raise DuplicateRequest(f"request {rid!r} is already live")
            salt_id = self._salt_ids.setdefault(bytes(salt), len(self._salt_ids))
            k, parent = 0, None
            while k < limit and self._table.get(names[k]) == (parent, salt_id, tokens[k * P:(k + 1) * P].tobytes(),
                                                               mids[k].tobytes()):
                parent = names[k]
                k += 1
            inflight = 0
            while k + inflight < limit and self._inflight[names[k + inflight]]:
                inflight += 1
            self._live[rid] = _Live(tokens, blobs, root, salt_id, names)
            self._inflight.update(names[:limit])
            match = ShadowMatch(rid, int(tokens.size), k, inflight)
            self.records.append(match)
            return match

    def finish(self, rid: Hashable, output_ids=()) -> None:
        """Record the full pages of prompt + output under their names, as PrefixCache.finish would index them."""
        P = self.page_size
        with self._lock:
            live = self._pop(rid)
        out = as_tokens(output_ids)
        seq = np.concatenate((live.tokens, out)) if out.size else live.tokens
        m = seq.size // P
        names = live.names[:m]
        if m > len(names):
            names += chain(names[-1] if names else live.root, seq[len(names) * P:m * P], P, len(names), live.media)
        mids = media_ids(live.media, range(m))
        with self._lock:
            parent = None
            for j, name in enumerate(names):
                self._table.setdefault(name, (parent, live.salt_id, seq[j * P:(j + 1) * P].tobytes(),
                                              mids[j].tobytes()))
                parent = name

    def abort(self, rid: Hashable) -> None:
        with self._lock:
            self._pop(rid)

    def _pop(self, rid: Hashable) -> _Live:
        live = self._live.pop(rid, None)
        if live is None:
            raise UnknownRequest(f"request {rid!r} is not live in the shadow index")
        for name in live.names[:(live.tokens.size - 1) // self.page_size]:
            if self._inflight[name] > 1:
                self._inflight[name] -= 1
            else:
                del self._inflight[name]
        return live

    def stats(self) -> ShadowStats:
        """Matched-page share and in-flight overlap over every request admitted so far."""
        with self._lock:
            recs = self.records
            pages = sum(r.prompt_tokens // self.page_size for r in recs)
            matched = sum(r.matched_pages for r in recs)
            inflight = sum(r.inflight_pages for r in recs)
            return ShadowStats(len(recs), pages, matched, matched / pages if pages else 0.0, inflight,
                               sum(r.inflight_pages > 0 for r in recs), len(self._table))
