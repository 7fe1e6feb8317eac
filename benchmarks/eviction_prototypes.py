"""Prototypes beside the default eviction policy, each built on the public extension point (``mmcache.eviction``: an
``EvictionPolicy`` subclass, known by name once ``register()`` ran), so a change of the core that breaks one breaks a
test (``tests/test_eviction_prototypes.py`` runs every registered policy and every prototype).

- ``dip:victims``, ``dip:misses``, ``dip:newcomers``: the default following one insertion rule whatever its duel
  says: what each rule is worth alone, and what the duel gains or costs against the best of them;
- ``dip:gated``: ``victims``, a request counting as one only when the lost page's last use lies at least half a
  turnover back, so a prompt re-sent soon after (a burst) is never demoted again. Tried to guard bursts, dropped: the
  default holds to lru through the generated burst without it, and it gives up much of the gain on session loops.
"""

from __future__ import annotations

from mmcache.eviction import DIP, register_policy
from mmcache.eviction.memory import NameWindow


def following(rule: str) -> type[DIP]:
    """The default, following ``rule`` whatever its duel says."""
    return type(f"DIP_{rule}", (DIP,), {"name": f"dip:{rule}", "fixed_rule": rule})


class Gated(DIP):
    """``victims`` for requests that lost a page last used at least half a turnover before they came back."""

    name = "dip:gated"
    fixed_rule = "victims"

    def __init__(self, num_pages, clock):
        super().__init__(num_pages, clock)
        self._last_use = NameWindow(2 * self.num_pages)  # evicted names -> the tick of their last use

    def evicted(self, names, keys, ticks) -> None:
        super().evicted(names, keys, ticks)
        self._last_use.add(names, ticks)

    def lost(self, name: int) -> bool:
        last = self._last_use.get(name)
        return last is not None and 2 * (self.clock() - last) >= self.turnover.ticks


PROTOTYPES = {cls.name: cls for cls in (following("victims"), following("misses"), following("newcomers"), Gated)}


def register() -> list[str]:
    """Register every prototype under its name (``mmcache.eviction.register_policy``); their names."""
    for name, cls in PROTOTYPES.items():
        register_policy(name, cls)
    return list(PROTOTYPES)
