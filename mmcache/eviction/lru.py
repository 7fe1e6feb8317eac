"""``lru``: the tick of the last use. The RFC's rule and every peer's; the yardstick the default is held to."""

from __future__ import annotations

import numpy as np

from mmcache.eviction.base import EvictionPolicy


class LRU(EvictionPolicy):
    """The tick of the last use; among equal ticks the caches evict deeper pages first, so cold tails leave from
    their ends."""

    name = "lru"

    def rank(self, name: int, tick: int, cost: float | None) -> int:
        return tick

    def ranks(self, names: np.ndarray, ticks, cost: float | None, chain: bool) -> np.ndarray:
        return np.broadcast_to(np.asarray(ticks, dtype=np.int64), names.shape)
