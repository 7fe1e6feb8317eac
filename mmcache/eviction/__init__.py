"""Eviction policies: what to drop first when a live owner needs pages, kept apart from the caches that hold them.

The extension point is ``EvictionPolicy`` (``mmcache.eviction.base``: the hooks the caches call, and the floor rule it
keeps for every policy). A pool takes a policy by name, as a factory (``factory(num_pages, clock)``: a policy class,
or a function), or built (``PagePool(n, eviction=...)``); ``register_policy`` names a factory so every API that takes
a name (``mmcache replay --eviction``, the engines' ``eviction=``) takes it too.

Policies (``POLICIES``):

- ``dip`` (the default, ``mmcache.eviction.dip``): LRU with an insertion rule chosen online by set dueling against
  LRU on sampled pools that serve requests as the real pool does: thrash resistance where sessions outgrow the pool,
  LRU where that does not pay.
- ``dip-costs`` (``mmcache.eviction.dip``): ``dip`` with a bounded weight for what an entry saves per page, so a pool
  shared with encoder outputs keeps more of them (more time saved, fewer KV hits while they come).
- ``lru`` (``mmcache.eviction.lru``): the tick of the last use.
- ``lfu`` (``mmcache.eviction.lfu``): recency plus capped frequency; loses to ``lru`` on session traffic.

``OfflineOptimal`` (``optimal`` in a replay) bounds them all on the same calls (``mmcache.eviction.optimal``).
"""

from __future__ import annotations

from typing import Callable, Union

from mmcache.errors import InvalidConfig
from mmcache.eviction.base import Clock, EvictionPolicy, entry_name
from mmcache.eviction.dip import DIP, CostedDIP
from mmcache.eviction.lfu import LFU
from mmcache.eviction.lru import LRU
from mmcache.eviction.optimal import LookupRecorder, OfflineOptimal

PolicyFactory = Callable[[int, Clock], EvictionPolicy]
Eviction = Union[str, PolicyFactory, EvictionPolicy, None]  # what a pool takes

POLICIES: dict[str, PolicyFactory] = {"dip": DIP, "dip-costs": CostedDIP, "lru": LRU, "lfu": LFU}
DEFAULT_POLICY = "dip"

__all__ = ["DEFAULT_POLICY", "DIP", "CostedDIP", "LFU", "LRU", "POLICIES", "Clock", "Eviction", "EvictionPolicy",
           "LookupRecorder", "OfflineOptimal", "PolicyFactory", "check_policy", "entry_name", "make_policy",
           "policy_name", "register_policy", "tier_policy"]


def register_policy(name: str, factory: PolicyFactory) -> None:
    """Make ``factory`` a policy every API that takes a policy's name knows as ``name`` (a prototype's way in)."""
    if not name or not callable(factory):
        raise InvalidConfig(f"register_policy needs a name and a factory, got {name!r} and {factory!r}")
    POLICIES[name] = factory


def check_policy(eviction: Eviction) -> Eviction:
    """``eviction`` checked as a pool's policy: None (the default), a registered name, a factory or a policy.
    ``InvalidConfig`` otherwise; APIs that build their pools later call it up front, so a bad one fails before any
    state changes. A name is returned as given (None: ``DEFAULT_POLICY``)."""
    if eviction is None:
        return DEFAULT_POLICY
    if isinstance(eviction, str):
        if eviction not in POLICIES:
            raise InvalidConfig(f"unknown eviction policy {eviction!r}; expected one of {', '.join(POLICIES)}")
        return eviction
    if isinstance(eviction, EvictionPolicy) or callable(eviction):
        return eviction
    raise InvalidConfig(f"eviction must be a policy's name, a factory or a policy, got {eviction!r}")


def make_policy(eviction: Eviction, num_pages: int, clock: Clock) -> EvictionPolicy:
    """The policy ``eviction`` stands for (``check_policy``) for a pool of ``num_pages`` on ``clock``."""
    eviction = check_policy(eviction)
    if isinstance(eviction, EvictionPolicy):
        return eviction
    factory = POLICIES[eviction] if isinstance(eviction, str) else eviction
    policy = factory(num_pages, clock)
    if not isinstance(policy, EvictionPolicy):
        raise InvalidConfig(f"eviction factory {eviction!r} made {policy!r}, not an EvictionPolicy")
    return policy


def policy_name(eviction: Eviction) -> str:
    """The name a replay or a report shows for ``eviction``."""
    eviction = check_policy(eviction)
    return eviction if isinstance(eviction, str) else getattr(eviction, "name", "") or type(eviction).__name__


def tier_policy(policy: EvictionPolicy) -> str:
    """The registered policy a host tier under a pool evicting by ``policy`` takes (its own clock and state)."""
    name = policy.tier_policy or policy.name
    return name if name in POLICIES else POLICIES[DEFAULT_POLICY].tier_policy or DEFAULT_POLICY
