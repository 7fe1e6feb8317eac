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
- ``kv-aware``: routes by what each replica's caches hold, as a router that reads their events does (Dynamo's KV
  router, llm-d's precise prefix-cache scorer): among the replicas whose queue is below ``threshold`` (all, when none
  is), the one with the highest score, ``cached leading pages of the prompt + media_weight x the request's encoded
  media whose encoder output it holds``, ties to the shorter queue, then the lower index. It holds no state of its
  own: the replay attaches one view per replica (``attach``), by default a ``mmcache.events.CacheView`` rebuilt from
  the replica's decoded KV and encoder-output events.

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


class KVAwareRouter:
    """The ``kv-aware`` policy (see the module doc) over views with ``matched_pages(names)`` and
    ``holds_media(digest)``; ``media_weight``: pages an encoder output held counts for (an encoder run saved)."""

    def __init__(self, replicas: int, threshold: int = DEFAULT_THRESHOLD, media_weight: int = 4):
        self.replicas, self.threshold, self.media_weight = replicas, threshold, media_weight
        self.views: list | None = None

    def attach(self, views) -> None:
        if len(views) != self.replicas:
            raise ValueError(f"{len(views)} views for {self.replicas} replicas")
        self.views = list(views)

    def choose(self, names, prompt_len, loads, now, media=()) -> int:
        if self.views is None:
            raise RuntimeError("kv-aware routing needs a view of each replica (attach)")
        score = [v.matched_pages(names) + self.media_weight * sum(map(v.holds_media, media)) for v in self.views]
        open_ = [i for i in range(self.replicas) if loads[i] < self.threshold] or range(self.replicas)
        return max(open_, key=lambda i: (score[i], -loads[i], -i))


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
    if name == "kv-aware":
        return KVAwareRouter(replicas, threshold)
    raise ValueError(f"unknown router {name!r}; expected one of {', '.join(ROUTERS)}")
