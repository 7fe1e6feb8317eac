"""What a replay's pools cost in memory, measured, and whether this machine has that much.

A replay's pool is metadata only (``page_shape=()``: no KV tensor), but not free: every page of it is allocated up
front, the pool's owner count and free-list entry, and the prefix index's row of ``page_size`` token ids and its
dozen per-page fields (``mmcache.prefix_index``); a host tier under it holds the same for each of its pages. Four
bytes per token and some hundred per page: ``--pool-tokens 16G`` is about 70 GB before the first request.

``bytes_per_page`` measures that by building two small pools of the replay's own kind (pool and prefix cache, or a
host tier) and taking the difference of what they allocate (``tracemalloc``), so it follows the library as it
changes. A store tier's memory grows with what is written to it, never past what the trace holds, so it is not
counted. ``pool_memory_problem`` refuses a replay whose pools need more than the memory available, with the size
they would need, before any pool is built.
"""

from __future__ import annotations

import functools
import os
import tracemalloc

_SMALL, _LARGE = 256, 2304  # pages of the two pools measured; their difference cancels the fixed costs


def _allocated(build) -> int:
    """Bytes ``build()`` allocates and keeps (traced by ``tracemalloc``) while its result is alive."""
    was_tracing = tracemalloc.is_tracing()
    if not was_tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = build()
        allocated = tracemalloc.get_traced_memory()[0] - before
        del kept
        return allocated
    finally:
        if not was_tracing:
            tracemalloc.stop()


@functools.lru_cache(maxsize=None)
def bytes_per_page(page_size: int, tier: str = "pool") -> float:
    """Measured bytes per page of a replay's device pool with its prefix cache (``tier="pool"``) or of a host tier
    (``"host"``), at ``page_size`` tokens a page."""
    from mmcache import Fingerprint, PagePool, PrefixCache
    from mmcache.pool import HostPagePool
    from mmcache.tiers import HostTier

    fp = Fingerprint(model="replay", page_size=page_size)

    def build(pages: int):
        if tier == "host":
            return HostTier(HostPagePool.like(PagePool(1, page_shape=()), pages), page_size)
        pool = PagePool(pages, page_shape=())
        return pool, PrefixCache(pool, fp)
    return max(0, _allocated(lambda: build(_LARGE)) - _allocated(lambda: build(_SMALL))) / (_LARGE - _SMALL)


def available_bytes() -> int | None:
    """Memory this process can still take: Linux's MemAvailable, else the machine's physical memory (None: unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 1024:,.1f} KiB"


def pool_memory_problem(flag: str, tokens: int, page_size: int, tier: str = "pool", available: int | None = None,
                        instead: str = "give a smaller size (inf replays an unbounded pool, sized to the trace)"
                        ) -> str | None:
    """Why a replay pool of ``tokens`` (``flag`` says which) cannot be built in this machine's memory, with what it
    would need and what to do ``instead``; None when it fits. The pools of one replay are built one after another,
    so each is checked alone."""
    available = available_bytes() if available is None else available
    pages = max(1, tokens // page_size)
    if available is None or pages * (4 * page_size + 1024) <= available // 2:  # far below: no need to measure
        return None
    need = pages * bytes_per_page(page_size, tier)
    if need <= available:
        return None
    return (f"{flag} {tokens:,} tokens: a replay pool of {pages:,} pages of {page_size} tokens needs about "
            f"{format_bytes(need)} of memory ({bytes_per_page(page_size, tier):,.0f} bytes a page: token ids and "
            f"index entries, measured), more than the {format_bytes(available)} available; {instead}")
