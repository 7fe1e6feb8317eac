"""mixed: the model workloads that can be imported (``COMPONENTS``), served by one server, interleaved by arrival.

Each component keeps its own models and caches (a workload's caches are sized and fingerprinted for its model); the
blend shares the server, so one component's long requests queue the others'. Its requests are every component's,
each component's arrival times shifted to start at 0, merged in arrival order (ties: component order, then listed
order, so each session's turns stay in causal order); request and session ids are prefixed ``<component>/``.
``options`` go to every component; ``options.limit`` caps each component's requests.

Cache statistics are summed over the components (pool pages, counters, encoder counters per modality). A ceiling
that one component reports is passed through; one that several report is their mean weighted by what each ceiling
is a share of (``ceiling_weights()``: prompt tokens, items), and left out if a component does not say.
"""

from __future__ import annotations

from typing import Callable

from workloads import registry
from workloads.harness.metrics import RequestResult
from workloads.harness.serving import Clock, Request, Workload
from workloads.options import ModelWorkloadOptions

COMPONENTS = ("vlm-chat", "agent-model", "image-gen", "voice-clone", "video-gen", "video-chat")


def available() -> tuple[list[str], dict[str, str]]:
    """The components whose modules import, and why each other one does not."""
    names, missing = [], {}
    for name in COMPONENTS:
        try:
            registry.import_model_module(name)
            names.append(name)
        except registry.UnknownWorkload as e:
            missing[name] = str(e)
    return names, missing


def _sum(a: dict, b: dict) -> dict:
    """``a`` + ``b`` key by key: numbers added, dicts summed recursively, anything else kept from ``a``."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = _sum(out[k], v)
        elif isinstance(v, (int, float)) and isinstance(out[k], (int, float)):
            out[k] = out[k] + v
    return out


class Mixed:
    """Components' requests interleaved by arrival time, each served by its own workload."""

    name = "mixed"

    def __init__(self, parts: dict[str, Workload]):
        self.parts = parts
        tagged = []
        for k, (name, wl) in enumerate(parts.items()):
            reqs = list(wl.requests())
            t0 = min((r.arrival_s for r in reqs), default=0.0)
            tagged += [(r.arrival_s - t0, k, j, Request(f"{name}/{r.rid}", f"{name}/{r.session}", r.arrival_s - t0,
                                                         (name, r))) for j, r in enumerate(reqs)]
        self._requests = [req for *_, req in sorted(tagged, key=lambda x: x[:3])]

    def requests(self) -> list[Request]:
        return self._requests

    def serve(self, req: Request, cached: bool, clock: Clock) -> RequestResult:
        name, inner = req.payload
        return self.parts[name].serve(inner, cached, clock)

    def cache_stats(self) -> dict:
        total: dict = {}
        for wl in self.parts.values():
            total = _sum(total, wl.cache_stats())
        return total

    def ceilings(self) -> dict[str, float]:
        by_cache: dict[str, list[tuple[float, float | None]]] = {}
        for wl in self.parts.values():
            weights = getattr(wl, "ceiling_weights", dict)()
            for cache, rate in wl.ceilings().items():
                by_cache.setdefault(cache, []).append((rate, weights.get(cache)))
        out = {}
        for cache, pairs in by_cache.items():
            if len(pairs) == 1:
                out[cache] = pairs[0][0]
            elif all(w is not None for _, w in pairs) and sum(w for _, w in pairs):
                out[cache] = sum(r * w for r, w in pairs) / sum(w for _, w in pairs)
        return out


def factory(options: ModelWorkloadOptions) -> Callable[[], Mixed]:
    """Build every importable component's factory once (``registry.UnknownWorkload`` if none imports); each call
    returns a ``Mixed`` of fresh component workloads."""
    names, missing = available()
    if not names:
        raise registry.UnknownWorkload("workload 'mixed' has no component: " + "; ".join(missing.values()))
    makers = {name: registry.model_factory(name, options) for name in names}
    return lambda: Mixed({name: make() for name, make in makers.items()})
