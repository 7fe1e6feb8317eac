"""A real peer to measure mmcache against: transformers' continuous-batching engine (``generation/continuous_batching``)
with its own paged KV and prefix sharing, driven request by request in a trace's order; and the same engine with
mmcache under it (``mmcache=True``: ``mmcache.hf.continuous_batching``), so the two differ only in the allocator.

What the driver relies on (transformers 5.24, read in its source):
- the engine is configured by ``ContinuousBatchingConfig`` only (``page_size``, ``num_blocks``, ``max_batch_tokens``,
  ``allow_block_sharing``); ``init_continuous_batching`` + ``start()`` once per configuration, then ``add_request``
  one at a time, because ``add_requests`` reverse-sorts the prompts when sharing is on;
- it keeps no counters: the tokens a request took from the cache come from its DEBUG line
  ``Found a prefix match of N tokens for request R`` (``PagedAttentionCache.search_prefix_match``), and the tokens
  every forward was fed from a forward pre-hook on the model (a cross-check: prefill + decode tokens);
- ``record_timestamps=True`` stamps each generated token (``time.perf_counter``, the clock of the request's
  ``created_time`` at ``add_request``); TTFT is the first stamp minus the creation time, the same origin as mmcache's
  runner (arrival at submission). ``replay`` also returns the submission and token times, so a serving harness can
  put queueing in front of them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import Sequence

import torch

from workloads.admission import Admission

MATCH_LINE = re.compile(r"Found a prefix match of (\d+) tokens for request (\S+)")
CB_LOGGER = "ContinuousBatchingLogger"  # continuous_batching/utils.py: the logger every module of the engine uses


@dataclasses.dataclass(frozen=True)
class Call:
    """One request of a replay: its id, its session (a later call of a session is sent only after the earlier one
    finished), and its prompt."""

    rid: str
    session: str
    token_ids: list[int]
    salt: bytes = b""  # tenant salt; only mmcache under the engine uses it (the engine's own hash has none)


@dataclasses.dataclass
class Outcome:
    """What one engine did with one call: generated ids, prompt tokens taken from its cache, time to first token;
    ``submitted_s`` (perf_counter at ``add_request``) and each token's time after it; log-probabilities when asked."""

    rid: str
    output_ids: list[int]
    matched_tokens: int
    ttft_s: float
    submitted_s: float = 0.0
    token_s: tuple[float, ...] = ()
    logprobs: tuple[float, ...] = ()


class _MatchLog(logging.Filter):
    """On the engine's logger: collects its ``Found a prefix match`` lines (request id -> matched tokens) and passes
    on only the records at or above ``shown`` (the level the logger had before it was lowered to DEBUG)."""

    def __init__(self):
        super().__init__()
        self.matched: dict[str, int] = {}
        self.shown = logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        m = MATCH_LINE.search(record.getMessage()) if record.levelno == logging.DEBUG else None
        if m:
            self.matched[m.group(2)] = int(m.group(1))
        return record.levelno >= self.shown


class PeerEngine:
    """transformers' ``ContinuousBatchingManager`` over ``model``, started on ``__enter__`` and stopped on
    ``__exit__`` (the model's attention implementation is restored then), with sharing on or off, and with mmcache's
    allocator under it when ``mmcache`` (turned off again on ``__exit__``; ``prefix_cache`` is its ``PrefixCache``),
    evicting by ``eviction`` (a name in ``mmcache.eviction.POLICIES``; None: mmcache's default).

    ``fed_tokens`` counts every input id the model was fed while the engine ran (prefill and decode)."""

    def __init__(self, model, *, share: bool, page_size: int, num_blocks: int, max_batch_tokens: int = 256,
                 max_new_tokens: int = 8, mmcache: bool = False, return_logprobs: bool = False, namer=None,
                 eviction: str | None = None):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model, self.max_new_tokens = model, max_new_tokens
        self.cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks,
                                                  max_batch_tokens=max_batch_tokens, allow_block_sharing=share,
                                                  return_logprobs=return_logprobs)
        self.use_mmcache, self.namer, self.eviction, self.mm = mmcache, namer, eviction, None
        # greedy, no EOS: every request generates exactly max_new_tokens, like mmcache's runner
        self.gen_config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1)
        self.fed_tokens = 0
        self._log = _MatchLog()

    def __enter__(self) -> PeerEngine:
        logger = logging.getLogger(CB_LOGGER)
        self._level, self._log.shown = logger.level, logger.getEffectiveLevel()
        logger.setLevel(logging.DEBUG)
        logger.addFilter(self._log)
        self._hook = self.model.register_forward_pre_hook(self._count, with_kwargs=True)
        if self.use_mmcache:
            from mmcache.hf.continuous_batching import enable_prefix_cache
            policy = {} if self.eviction is None else {"eviction": self.eviction}
            self.mm = enable_prefix_cache(self.model, namer=self.namer, **policy)
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.manager.stop(block=True)
        finally:
            if self.mm is not None:
                self.mm.disable()
            self._hook.remove()
            logger = logging.getLogger(CB_LOGGER)
            logger.removeFilter(self._log)
            logger.setLevel(self._level)

    def _count(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self.fed_tokens += int(ids.numel())

    @property
    def num_blocks(self) -> int:
        """The blocks the engine actually holds (it rounds ``num_blocks`` up to whole sectors)."""
        return self.manager.batch_processor.cache.num_blocks

    @property
    def prefix_cache(self):
        """mmcache's ``PrefixCache`` under the engine (None without ``mmcache`` or before the engine built one)."""
        return None if self.mm is None else self.mm.cache

    def replay(self, calls: Sequence[Call], inflight: int = 1, timeout_s: float = 600.0,
               arrivals: Sequence[float] | None = None, on_done=None) -> list[Outcome]:
        """Send ``calls`` in order, at most ``inflight`` at once, a call only after its session's previous call
        finished and (with ``arrivals``: seconds after the replay starts, one per call) not before it arrived;
        returns the outcomes in call order and passes each to ``on_done`` as it completes. Any failed request
        raises ``RuntimeError``."""
        admission = Admission([c.session for c in calls], arrivals, inflight)
        running: dict[str, int] = {}  # rid -> the index of its call
        results: dict[str, Outcome] = {}
        t0 = self.replay_started_s = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        while admission or running:
            for k in admission.take(time.perf_counter() - t0):
                nxt = calls[k]
                if nxt.salt and self.mm is not None:
                    self.mm.set_salt(nxt.rid, nxt.salt)
                self.manager.add_request(list(map(int, nxt.token_ids)), request_id=nxt.rid,
                                         max_new_tokens=self.max_new_tokens, record_timestamps=True)
                running[nxt.rid] = k
            arrival = admission.wait_s(time.perf_counter() - t0)  # wake for the next arrival, if one is to come
            wait = 1.0 if arrival is None else min(1.0, max(1e-3, arrival))
            out = self.manager.get_result(timeout=wait)
            if out is None:
                if wait < 1.0:
                    continue  # woke for the next arrival
                if time.monotonic() > deadline or not self.manager.is_running():
                    raise RuntimeError(f"the peer engine stopped answering ({len(running)} requests running)")
                continue
            if out.error is not None:
                raise RuntimeError(f"the peer engine failed request {out.request_id}: {out.error}")
            k = running.pop(out.request_id)
            admission.finished(k)
            call = calls[k]
            stamps = tuple(t - out.created_time for t in out.timestamps)
            results[call.rid] = Outcome(call.rid, list(out.generated_tokens), self._log.matched.get(call.rid, 0),
                                        stamps[0], out.created_time, stamps, tuple(out.logprobs or ()))
            if on_done is not None:
                on_done(results[call.rid])
        return [results[c.rid] for c in calls]
