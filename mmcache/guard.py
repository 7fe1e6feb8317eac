"""Calls from a cache to its collaborators, kept so that one that raises never leaves the cache wrong.

Beside its own code a cache calls three collaborators: its pool's eviction policy (``mmcache.eviction``), an observer
(KV events for routers, ``mmcache.kv_events``) and a lower tier (``mmcache.tiers``). None of them decides whether a
hit is right, so none of their failures may change what a cache holds. The rule every cache keeps through
``Guard``:

- a notification (a policy hook, an observer's event, a tier's spill or publish) is made once the cache's own state
  is whole, and one that raises is dropped;
- a key the policy cannot give is the LRU key (the tick, never below the floor): the eviction order degrades,
  nothing else;
- a tier that raises is a miss.

So a public operation completes whatever its collaborators do. Each failure is counted (``listener_errors`` among the
cache's counters) and the first of each kind is logged with its traceback (logger ``mmcache``).
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("mmcache")


class Guard:
    """One cache's calls to its collaborators (see the module docstring); ``counters``: the cache's, which gains
    ``listener_errors``."""

    __slots__ = ("counters", "_logged")

    def __init__(self, counters: dict):
        self.counters = counters
        counters.setdefault("listener_errors", 0)
        self._logged: set[str] = set()

    def failed(self, what: str) -> None:
        """``what`` just raised (call inside the ``except``): counted, and logged the first time."""
        self.counters["listener_errors"] += 1
        if what not in self._logged:
            self._logged.add(what)
            log.exception("%s raised; the cache goes on without it (counted in listener_errors; logged once)", what)

    def call(self, what: str, fn: Callable, *args, default=None):
        """``fn(*args)``, or ``default`` when it raises."""
        try:
            return fn(*args)
        except Exception:
            self.failed(what)
            return default
