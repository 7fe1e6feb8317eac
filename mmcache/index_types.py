"""The types of ``PrefixIndex``'s API (``mmcache.prefix_index``): the runs of chain positions it indexes
(``ChainRun``), what it did with each (``Inserted``), the observer it tells of every page it adopts and drops
(``IndexObserver``), and the read-only view a tier reads pages' verifying ids through (``TierView``)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol, Sequence

import numpy as np


class IndexObserver(Protocol):
    """Hears what the index stores and drops (``mmcache.kv_events.KVEventPublisher``: events for external routers).
    Called under the pool's ``cache_lock`` on a request's path: it must only queue what it hears, never block."""

    def stored(self, names: list[int], parent: int | None, tokens: np.ndarray, media: list[bytes], salt: bytes,
               depth: int) -> None:
        """Pages named ``names`` (a run of chain positions from ``depth``, each the child of the one before, the first
        a child of ``parent``; None at depth 0) were indexed: their token ids ``tokens`` [len(names), page_size],
        each page's media blob (offset ‖ digest of the media whose first placeholder it holds; b"" for none) and the
        chain's salt."""

    def removed(self, names: list[int]) -> None:
        """Pages named ``names`` left the index (evicted or discarded)."""

    def cleared(self) -> None:
        """Every page left the index."""


class ChainRun(NamedTuple):
    """Chain positions ``depth, depth+1, ...`` of one request to index (``PrefixIndex.insert_runs``): ``pages[j]``
    named ``names[j]``, its verifying ids ``rows[j]`` (token ids) and ``mids[j]`` (128-bit media id), under the
    indexed page ``parent`` (-1 at depth 0), the chain's salt id, and its media blobs by position for the observer."""

    pages: Sequence[int]
    names: Sequence[int]
    rows: np.ndarray
    mids: np.ndarray
    salt_id: int
    depth: int = 0
    parent: int = -1
    media: dict[int, bytes] | None = None


class Inserted(NamedTuple):
    """What ``insert_runs`` did with one run: the positions adopted, the chain pages walked, whether it may go on."""

    new: list[int]
    chain: list[int]
    ok: bool


@dataclasses.dataclass(frozen=True)
class TierView:
    """The arrays a tier reads when pages leave the index, by page id: ``name``, ``tokens``, ``parent`` (page id, -1
    at depth 0), ``salt`` (salt id; ``salt_bytes`` maps it back), ``depth``, and ``media_lo``/``media_hi`` (the 128-bit
    media id's halves; ``media`` gives pairs). Views of the index's own arrays: valid where a page is indexed."""

    name: np.ndarray
    tokens: np.ndarray
    parent: np.ndarray
    salt: np.ndarray
    depth: np.ndarray
    media_lo: np.ndarray
    media_hi: np.ndarray
    salts: list[bytes]  # salt id -> salt

    def media(self, pages) -> np.ndarray:
        return np.stack((self.media_lo[pages], self.media_hi[pages]), axis=-1)

    def salt_bytes(self, salt_id: int) -> bytes:
        return self.salts[salt_id]
