"""``lfu``: recency plus frequency, GreedyDual-Size-Frequency in the pool's ticks (SGLang ships an LFU).

An entry's key is its last use plus half a turnover per lookup of its name beyond the first (``UseCounts``, a ghost
history kept after the entry left), its lookups capped at ``MAX_USES``, all scaled by its cost weight: so no bonus
outlives ``MAX_USES / 2`` turnovers of the pool (a finished session's much-read pages age out), and an entry that
saves twice the typical counts as looked up twice as often. Frequency alone keeps finished sessions' pages, which
were looked up most, over running sessions' history: it loses to ``lru`` on session traffic (``docs/eviction.md``).
"""

from __future__ import annotations

import numpy as np

from mmcache.eviction.base import Clock, EvictionPolicy
from mmcache.eviction.costs import CostWeight
from mmcache.eviction.memory import UseCounts
from mmcache.eviction.turnover import Turnover

MAX_USES = 8          # lookups past this many add nothing
TURNOVERS_PER_USE = 0.5
COUNT_TABLE_PAGES = 4  # names whose lookups are counted, per page of the pool


class LFU(EvictionPolicy):
    name = "lfu"

    def __init__(self, num_pages: int, clock: Clock):
        super().__init__(num_pages, clock)
        self.uses = UseCounts(COUNT_TABLE_PAGES * self.num_pages)
        self.turnover = Turnover(num_pages, clock)
        self.costs = CostWeight()

    def looked_up(self, names, hits: int, held: bool = False) -> None:
        self.turnover.inserted(len(names) - hits)
        self.costs.refresh()
        self.uses.add(names)

    def _bonus(self, uses, octaves: float):
        return (np.minimum(np.maximum(uses, 1), MAX_USES) * 2.0 ** octaves - 1) * (TURNOVERS_PER_USE
                                                                                  * self.turnover.ticks)

    def rank(self, name: int, tick: int, cost: float | None) -> int:
        return tick + int(self._bonus(self.uses.get(name), self.costs.octaves(cost)))

    def ranks(self, names: np.ndarray, ticks, cost: float | None, chain: bool) -> np.ndarray:
        uses = np.fromiter(map(self.uses.get, names.tolist()), dtype=np.int64, count=len(names))
        return np.asarray(ticks, dtype=np.int64) + self._bonus(uses, self.costs.octaves(cost, len(names))).astype(
            np.int64)
