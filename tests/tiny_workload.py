"""A model workload without a model, for the command line's model-replay paths: 4 requests, served in a blink, with
Ctrl-C or failures where a test puts them. ``use(monkeypatch, **kw)`` makes every model workload name build it."""

from __future__ import annotations

from mmcache.errors import OutOfPages
from workloads import registry
from workloads.harness import serving
from workloads.harness.metrics import RequestResult


class TinyWorkload:
    """``interrupt_off`` / ``interrupt_on``: Ctrl-C at that request (counted over both runs) of the cache-off /
    cache-on run; ``fail_on``: every cache-on request fails for want of pages."""

    name = "tiny"

    def __init__(self, interrupt_off: int | None = None, interrupt_on: int | None = None, fail_on: bool = False):
        self.interrupt_off, self.interrupt_on, self.fail_on, self.served = interrupt_off, interrupt_on, fail_on, 0

    def requests(self):
        return [serving.Request(f"r{k}", "s", float(k)) for k in range(4)]

    def serve(self, req, cached, clock):
        self.served += 1
        if self.served == (self.interrupt_on if cached else self.interrupt_off):
            raise KeyboardInterrupt
        if cached and self.fail_on:
            raise OutOfPages(3)
        clock.token()
        return RequestResult(prompt_tokens=10, output_tokens=1)

    def cache_stats(self):
        return {}

    def ceilings(self):
        return {}


def use(monkeypatch, **kw) -> None:
    monkeypatch.setattr(registry, "model_factory", lambda name, options: lambda: TinyWorkload(**kw))
