"""``dip`` (the default): LRU whose insertion adapts to the traffic, guarded by set dueling against LRU itself; and
``dip-costs``, the same with a bounded weight for what an entry saves.

Keys are ticks of the last use, as ``lru``'s, with bounded shifts:

- **insertion**: the pages a request computed are keyed a turnover back (toward the eviction frontier) when the rule
  the pool follows says so (``mmcache.eviction.dueling``: ``victims`` demotes a request that lost pages it had held,
  a session whose history a loop larger than the pool evicted between its calls; ``misses`` demotes every
  request's; ``lru`` none). A page found by a later request is keyed at its use again. Which rule: the one whose
  sampled pool, serving a sample of the same chains as the real pool does (requests holding pages from lookup to
  release), hit the most lately, and ``lru`` unless another beats it by 5%. So where keeping some sessions
  whole beats losing them all, the pool keeps some whole, and where it does not, the pool is ``lru``;
- **cost** (``dip-costs`` only): an entry that saves more per page than the pool's typical entry (an encoder output
  beside KV pages) is keyed up to ``cost_turnovers`` of a turnover later, one that saves less as much earlier
  (``CostWeight``: bounded, and 0 for every entry of a pool whose entries all save alike). Not in the default: on a
  pool shared with encoder outputs it trades KV hits for encoder hits, which saves time overall but leaves KV hits
  below ``lru``'s while the encoder traffic lasts (``docs/eviction.md``), and the duel does not guard it.

Neither shift outlives a bounded number of turnovers: what a policy keeps for a reason that has passed (a finished
session, encoder traffic that stopped) leaves within one or two turnovers of when ``lru`` would drop it.

State: the names of pages evicted lately (``GHOSTS`` per page) and of pages demoted (``2`` per page), each a bounded
window; a sampled pool of about ``SAMPLED_PAGES`` pages per insertion rule.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmcache.eviction.base import Clock, EvictionPolicy
from mmcache.eviction.costs import CostWeight
from mmcache.eviction.dueling import GHOSTS, InsertionDuel, Lottery, demotes
from mmcache.eviction.memory import NameWindow
from mmcache.eviction.turnover import Turnover


class DIP(EvictionPolicy):
    name = "dip"
    tier_policy = "lru"  # a host tier's entries are evicted device pages, with no requests to duel on
    fixed_rule: str | None = None  # a prototype's: follow this rule whatever the duel says (RULES)
    cost_turnovers = 0.0  # the most a cost moves a key, as a share of a turnover each way (0: costs move no key)

    def __init__(self, num_pages: int, clock: Clock):
        super().__init__(num_pages, clock)
        self.turnover = Turnover(num_pages, clock)
        self.costs = CostWeight()
        self.duel = InsertionDuel(num_pages, clock, self.turnover)
        self.ghosts = NameWindow(GHOSTS * self.num_pages)
        self.demoted = NameWindow(2 * self.num_pages)
        self._lottery = Lottery()

    @property
    def rule(self) -> str:
        """The insertion rule the pool follows now."""
        return self.duel.rule

    def looked_up(self, names: Sequence[int], hits: int, held: bool = False) -> None:
        computed = len(names) - hits
        self.turnover.inserted(computed)
        self.costs.refresh()
        if hits and len(self.demoted):
            self.demoted.discard(names[:hits])  # found again: keyed at its use from now on
        if not held:
            return
        self.duel.admitted(names)
        rule = self.duel.rule if self.fixed_rule is None else self.fixed_rule
        if computed > 0 and demotes(rule, self.lost(names[hits]), self._lottery):
            ghosts = self.ghosts
            self.demoted.add([n for n in names[hits:] if n not in ghosts] if rule == "newcomers" else names[hits:])

    def lost(self, name: int) -> bool:
        """Whether a request whose first page not found is ``name`` lost it: the page was cached and evicted lately
        (a ghost). What makes the request a victim under the ``victims`` rule."""
        return name in self.ghosts

    def released(self, names: Sequence[int]) -> None:
        self.duel.released(names)

    def evicted(self, names: Sequence[int], keys, ticks) -> None:
        self.ghosts.add(names)
        if len(self.demoted):
            self.demoted.discard(names)

    def _shift(self, cost: float | None, pages: int = 1) -> int:
        if not self.cost_turnovers:
            return 0
        octaves = self.costs.octaves(cost, pages)
        return int(self.cost_turnovers * octaves * self.turnover.ticks) if octaves else 0

    def rank(self, name: int, tick: int, cost: float | None) -> int:
        k = tick + self._shift(cost)
        return k - self.turnover.ticks if name in self.demoted else k

    def ranks(self, names: np.ndarray, ticks, cost: float | None, chain: bool) -> np.ndarray:
        k = np.asarray(ticks, dtype=np.int64) + self._shift(cost, len(names))
        if not len(self.demoted):
            return np.broadcast_to(k, names.shape)
        down = np.fromiter(map(self.demoted.__contains__, names.tolist()), dtype=bool, count=len(names))
        return k - down * self.turnover.ticks


class CostedDIP(DIP):
    """``dip-costs``: ``dip`` with an entry's key moved by what it saves, up to half a turnover each way."""

    name = "dip-costs"
    cost_turnovers = 0.5
