"""The pool sizes a trace replay can run, checked after the trace is read and before any pool is built.

Refused, each in one line naming the size given and the size that would do:
- a pool smaller than every request: the replay admits none (each counts as failed, ``replay``), so its row would
  be a measurement of nothing; the smallest request's prompt + output pages are the least pool that replays one;
- a pool past the machine's memory (``memory.pool_memory_problem``), including the unbounded pool of the ceiling,
  which holds every request's pages at once.
"""

from __future__ import annotations

from typing import Sequence

from workloads.sizes import format_size
from workloads.sizing.memory import pool_memory_problem
from workloads.sizing.replay import pool_pages_for
from workloads.traces.text_trace import TextTrace


def smallest_request_pages(trace: TextTrace, page_size: int) -> int:
    """Pages the smallest request of ``trace`` needs alone: its prompt and output, rounded up to whole pages."""
    return min(-(-(c.prompt_len + c.output_len) // page_size) for s in trace.sessions for c in s.calls)


def _tokens(pages: int, page_size: int) -> str:
    return f"{pages * page_size:,} tokens ({pages:,} page{'s' if pages != 1 else ''} of {page_size})"


def pool_problem(trace: TextTrace, page_size: int, sizes: Sequence[int | None], replicas: Sequence[int] = (1,),
                 host_tokens: int | None = None, ceiling: bool = True) -> str | None:
    """Why the replay of ``trace`` cannot run at ``sizes`` (``--pool-tokens``; with ``replicas``, each total is split
    evenly over each count) with a host tier of ``host_tokens``, or None. ``ceiling``: the unbounded pool is built
    too (a sweep's)."""
    need = smallest_request_pages(trace, page_size)
    for size in sizes:
        if size is None:
            continue
        for r in replicas:
            pages = max(1, size // r // page_size)
            if pages < need:
                split = f" over {r} replicas" if r > 1 else ""
                return (f"--pool-tokens {format_size(size)}{split}: a pool of {_tokens(pages, page_size)} is "
                        f"smaller than every request, so every request would fail; the smallest needs "
                        f"{_tokens(need, page_size)} for its prompt and output: give at least "
                        f"{format_size(need * page_size * r)}")
        if problem := pool_memory_problem("--pool-tokens", size, page_size):
            return problem
    if host_tokens and (problem := pool_memory_problem("--host-tokens", host_tokens, page_size, tier="host")):
        return problem
    if ceiling:
        unbounded = pool_pages_for(trace, page_size, None) * page_size
        return pool_memory_problem("the ceiling's unbounded pool of", unbounded, page_size,
                                   instead="replay fewer requests (--limit N)")
    return None
