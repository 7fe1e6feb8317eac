"""Replica choice policies compared by the multi-replica replay: ``choose(names, prompt_len, loads, now, media)
-> replica``, ``media`` being the digests of the request's encoder inputs in prompt order.

- ``random``: today's M* choice (uniform, seeded);
- ``round-robin``: replicas in turn;
- ``affinity``: ``mmcache.routing.AffinityRouter`` by text (rendezvous hashing of the first page names below a queue
  threshold, random above it); holds no cache state;
- ``media-affinity``: the same router keyed by the request's first media digest (its text key when it has none);
- ``cache-aware``: SGLang router's cache-aware policy with its documented defaults (cache_threshold 0.5,
  balance_abs_threshold 32, balance_rel_threshold 1.5, eviction every 60 s to max_tree_size 2**24). When loads are
  imbalanced (``max - min > 32`` and ``max > 1.5 * min``) it takes the least-loaded replica; otherwise the replica
  whose approximate prefix tree matches the longest prefix if that match covers more than half the prompt, else the
  replica with the smallest tree. The chosen replica's tree then takes the request's prompt. SGLang's trees hold
  the request text by character; here they hold page names (a chain name is a whole prefix, so a set of names per
  replica is a radix tree at page granularity) and sizes count tokens.

``loads`` are the live (admitted, not yet finished) requests of each replica, SGLang's "pending requests".
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from mmcache.routing import DEFAULT_KEY_PAGES, DEFAULT_THRESHOLD, AffinityRouter
from workloads.sizing.router_names import ROUTERS


class RandomRouter:
    def __init__(self, replicas: int, seed: int = 0):
        self.replicas, self.rng = replicas, random.Random(seed)

    def choose(self, names: Sequence[int], prompt_len: int, loads: Sequence[int], now: float,
               media: Sequence[bytes] = ()) -> int:
        return self.rng.randrange(self.replicas)


class RoundRobinRouter:
    def __init__(self, replicas: int):
        self.replicas, self.next = replicas, 0

    def choose(self, names, prompt_len, loads, now, media=()) -> int:
        self.next = (self.next + 1) % self.replicas
        return (self.next - 1) % self.replicas


class PrefixAffinityRouter:
    """``AffinityRouter`` behind the replay's interface, keyed by ``key`` ("text" or "media")."""

    def __init__(self, replicas: int, threshold: int = DEFAULT_THRESHOLD, key_pages: int = DEFAULT_KEY_PAGES,
                 seed: int = 0, key: str = "text"):
        self.router = AffinityRouter(range(replicas), threshold, key_pages, random.Random(seed), key=key)

    def choose(self, names, prompt_len, loads, now, media=()) -> int:
        return self.router.choose(names, loads, media)


class CacheAwareRouter:
    """SGLang's cache-aware policy over per-replica approximate trees of page names (see the module doc)."""

    def __init__(self, replicas: int, page_size: int, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, eviction_interval_s: float = 60.0, max_tree_size: int = 2**24):
        self.page_size = page_size
        self.cache_threshold, self.abs, self.rel = cache_threshold, balance_abs_threshold, balance_rel_threshold
        self.eviction_interval_s, self.max_tree_pages = eviction_interval_s, max(1, max_tree_size // page_size)
        self.trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(replicas)]  # LRU order, newest last
        self.next_eviction = eviction_interval_s

    def choose(self, names, prompt_len, loads, now, media=()) -> int:
        if now >= self.next_eviction:
            for tree in self.trees:
                while len(tree) > self.max_tree_pages:
                    tree.popitem(last=False)
            self.next_eviction = now + self.eviction_interval_s
        hi, lo = max(loads), min(loads)
        if hi - lo > self.abs and hi > self.rel * lo:
            pick = min(range(len(loads)), key=lambda i: (loads[i], i))
        else:
            matched = [self._matched(tree, names) for tree in self.trees]
            best = max(range(len(matched)), key=lambda i: (matched[i], -i))
            if prompt_len and matched[best] * self.page_size / prompt_len > self.cache_threshold:
                pick = best
            else:
                pick = min(range(len(self.trees)), key=lambda i: (len(self.trees[i]), loads[i], i))
        tree = self.trees[pick]
        for name in names:
            tree[name] = None
            tree.move_to_end(name)
        return pick

    @staticmethod
    def _matched(tree, names) -> int:
        k = 0
        while k < len(names) and names[k] in tree:
            k += 1
        return k


def make_router(name: str, replicas: int, page_size: int, *, threshold: int = DEFAULT_THRESHOLD,
                key_pages: int = DEFAULT_KEY_PAGES, seed: int = 0):
    if name == "random":
        return RandomRouter(replicas, seed)
    if name == "round-robin":
        return RoundRobinRouter(replicas)
    if name in ("affinity", "media-affinity"):
        key = "media" if name == "media-affinity" else "text"
        return PrefixAffinityRouter(replicas, threshold, key_pages, seed, key)
    if name == "cache-aware":
        return CacheAwareRouter(replicas, page_size)
    raise ValueError(f"unknown router {name!r}; expected one of {', '.join(ROUTERS)}")
