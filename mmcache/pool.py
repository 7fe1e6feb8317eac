"""PagePool: a fixed slab of pages with one owner count per page.

An owner is anything with a defined end (a live request, the prefix index, the encoder store). The pool is the only
place pages are freed: a page is on the free list exactly when its owner count is 0.

HostPagePool is a PagePool in host memory that holds offloaded pages; ``copy_pages`` is the one copy between two
pools. Offload copies a request's exclusively owned device pages into host pages of the same ``page_shape`` and
dtype; reload copies them back into fresh device pages. Ownership works as on the device: the offload record is the
host pages' only owner, and releasing them returns them to the host free list.
"""

from __future__ import annotations

import array
import itertools
import math
import threading
from typing import Iterable, Sequence

import numpy as np
import torch

from mmcache.checks import as_ids, as_int, require
from mmcache.errors import InvalidRequest, OutOfPages, PageOwnershipError
from mmcache.eviction import Eviction, make_policy, tier_policy

# A request-sized list of at most this many page ids is counted (and, in the prefix index, stamped) one by one on
# the arrays, not through numpy: see PagePool.
SCALAR_PAGES = 64


class Clock:
    """The one recency clock of a pool: a monotonic tick its owners stamp entries with (``itertools.count`` is atomic
    under the GIL), so the eviction keys of every cache on one pool compare."""

    def __init__(self):
        self._count = itertools.count(1)
        self.now = 0  # the last tick handed out

    def tick(self) -> int:
        self.now = t = next(self._count)
        return t


def canonical_device(device: str | torch.device) -> torch.device:
    """``device`` with its index made explicit: "cuda" means the current CUDA device (0 when CUDA is absent), so a
    pool built on "cuda" and tensors on "cuda:0" compare equal (``torch.device("cuda") != torch.device("cuda:0")``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def same_device(a: str | torch.device, b: str | torch.device) -> bool:
    return canonical_device(a) == canonical_device(b)


class PagePool:
    """``num_pages`` pages of ``page_shape`` allocated once, plus one owner count per page.

    Invariants, enforced by ``alloc``/``retain``/``release`` under ``self.lock``:
    - a page is on the free list if and only if its owner count is 0;
    - counts never go below 0 (releasing a free page raises) and an unowned page is never retained;
    - ``num_free + owned pages == num_pages`` at all times.

    ``page_shape=()`` (or any zero-size shape) makes a metadata-only pool: ids and counts, no tensor.

    One pool per node: the caches on it (prefix indexes, an encoder store) register in ``evictables``, order their
    entries by the one ``clock`` and take the one ``cache_lock`` (see ``mmcache.reclaim``), so a shortfall of any
    owner evicts the coldest cached pages of either kind.

    The counts live in one ``array('i')`` that ``_counts`` views as numpy: a list of a few page ids (a request's
    pages) is checked and counted one by one on the array, a larger or numpy one through the view. Both make the same
    checks; the scalar path exists because an engine calls between forwards, when each numpy call runs cold and costs
    tens of microseconds.
    """

    def __init__(self, num_pages: int, page_shape: Iterable[int] = (), dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", eviction: Eviction = None):
        self.num_pages = as_int(num_pages, "num_pages")
        if self.num_pages <= 0:
            raise InvalidRequest(f"num_pages must be positive, got {num_pages}")
        self.clock = Clock()
        # what every cache on the pool asks for its entries' eviction keys (mmcache.eviction: a name, a factory or a
        # policy)
        self.policy = make_policy(eviction, self.num_pages, lambda: self.clock.now)
        self.page_shape = tuple(int(s) for s in page_shape)
        self.dtype = dtype
        self.device = canonical_device(device)
        self.data: torch.Tensor | None = None
        if self.page_shape and math.prod(self.page_shape) > 0:
            # Pages are always written before they are read, so the slab need not be zeroed (nor touched) up front.
            self.data = torch.empty((self.num_pages, *self.page_shape), dtype=dtype, device=self.device)
        self.lock = threading.Lock()
        self.cache_lock = threading.RLock()  # taken before ``lock``, never after
        self.evictables: list = []
        self._count_ids = array.array("i", bytes(4 * self.num_pages))  # never resized: _counts views its memory
        self._counts = np.frombuffer(self._count_ids, dtype=np.int32)
        # A stack popped from the end: low page ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))

    @classmethod
    def over(cls, data: torch.Tensor, page_dim: int = 0,
             eviction: Eviction = None) -> "PagePool":
        """A pool whose pages are the slices of an engine's own tensor along ``page_dim`` (M*'s KV tensor
        ``[layers, pages, ...]`` has them in dim 1), evicting by ``eviction``: ``data`` is that tensor's view with
        the page first, so copies in and out of pages (tiers) write through to the engine's tensor."""
        pool = cls(data.shape[page_dim], eviction=eviction)
        pool.data = data.movedim(page_dim, 0)
        pool.page_shape, pool.dtype, pool.device = tuple(pool.data.shape[1:]), data.dtype, canonical_device(data.device)
        return pool

    def register(self, cache) -> None:
        """Add a cache (``mmcache.reclaim.Evictable``) whose entries any owner's shortfall on this pool may evict."""
        with self.cache_lock:
            self.evictables.append(cache)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's data (0 for a metadata-only pool)."""
        if self.data is None:
            return 0
        return math.prod(self.page_shape) * self.data.element_size()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def counts(self) -> np.ndarray:
        """A read-only view of the owner counts, indexed by page id."""
        view = self._counts.view()
        view.flags.writeable = False
        return view

    def owners(self, page: int) -> int:
        """The owner count of one page (a Python int page id), read on the array: no numpy call."""
        return self._count_ids[page]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages, each with owner count 1, or raise ``OutOfPages`` and take none."""
        n = as_int(n, "a page count")
        if n < 0:
            raise InvalidRequest(f"cannot allocate {n} pages")
        if n == 0:
            return []
        with self.lock:
            if n > len(self._free):
                raise OutOfPages(n - len(self._free), requested=n)
            pages = self._free[-n:]
            del self._free[-n:]
            if n <= SCALAR_PAGES:
                counts = self._count_ids
                for p in pages:
                    counts[p] = 1
            else:
                self._counts[pages] = 1
        return pages

    def alloc_split(self, counts: Sequence[int]) -> list[list[int]] | None:
        """``[alloc(c) for c in counts]`` in one lock hold: the same pages in the same order as those calls, all
        or none. Returns None and takes nothing when the free pages do not cover the sum (no ``OutOfPages``: the
        caller decides what a shortfall means)."""
        if counts and min(counts) < 0:
            raise InvalidRequest(f"cannot allocate a negative page count: {list(counts)}")
        total = sum(counts)
        with self.lock:
            if total > len(self._free):
                return None
            taken = self._free[len(self._free) - total:]
            del self._free[len(self._free) - total:]
            self._counts[taken] = 1
        # alloc pops from the end of the free list, so the first call's pages are the last of the batch's slice.
        out, end = [], total
        for c in counts:
            out.append(taken[end - c:end])
            end -= c
        return out

    def retain(self, pages, distinct: bool = False) -> None:
        """Add one owner to each page (a page listed twice gains two); every page must already be owned.

        ``distinct=True`` is the caller's promise that no page repeats (a verified chain), which skips a sort.
        """
        few = self._few(pages, distinct)
        if few is not None:
            with self.lock:
                counts = self._count_ids
                for p in few:
                    if counts[p] <= 0:
                        raise PageOwnershipError(f"retain of unowned page(s) {[q for q in few if counts[q] <= 0][:8]}")
                for p in few:
                    counts[p] += 1
            return
        idx, mult = self._checked(pages, distinct)
        if idx is None:
            return
        with self.lock:
            held = self._counts[idx]  # one gather: checked, then written back (the ids are unique here)
            if held.min() <= 0:
                raise PageOwnershipError(f"retain of unowned page(s) {idx[held <= 0].tolist()[:8]}")
            self._counts[idx] = held + mult

    def release(self, pages, distinct: bool = False) -> list[int]:
        """Drop one owner from each page; pages whose count reaches 0 return to the free list and are returned.
        ``distinct=True`` is the caller's promise that no page repeats (a request's own page list), which skips a
        sort."""
        few = self._few(pages, distinct)
        if few is not None:
            with self.lock:
                counts, freed = self._count_ids, []
                for p in few:
                    if counts[p] <= 0:
                        raise PageOwnershipError(f"release of free or over-released page(s) "
                                                 f"{[q for q in few if counts[q] <= 0][:8]}")
                for p in few:
                    left = counts[p] = counts[p] - 1
                    if not left:
                        freed.append(p)
                self._free.extend(freed)
            return freed
        idx, mult = self._checked(pages, distinct)
        if idx is None:
            return []
        with self.lock:
            left = self._counts[idx] - mult  # one gather: checked, then written back (the ids are unique here)
            if left.min() < 0:
                raise PageOwnershipError(f"release of free or over-released page(s) {idx[left < 0].tolist()[:8]}")
            self._counts[idx] = left
            freed = idx[left == 0].tolist()
            self._free.extend(freed)
        return freed

    def check(self) -> None:
        """``BrokenInvariant`` unless the free list is exactly the pages whose owner count is 0, each once, and no
        count is negative."""
        with self.lock:
            free = list(self._free)
            counts = self._counts.copy()
        require(len(free) == len(set(free)), "no page is on the free list twice")
        require(sorted(free) == np.flatnonzero(counts == 0).tolist(), "the free list is exactly the unowned pages")
        require((counts >= 0).all(), "no owner count is negative")

    def _few(self, pages, distinct: bool) -> list[int] | tuple[int, ...] | None:
        """``pages`` when the scalar path takes them: a list or tuple of at most ``SCALAR_PAGES`` distinct Python ints
        inside the pool; None sends them to ``_checked`` (which also refuses what is malformed)."""
        if type(pages) not in (list, tuple) or len(pages) > SCALAR_PAGES:
            return None
        n = self.num_pages
        for p in pages:
            if type(p) is not int or not 0 <= p < n:
                return None
        if not distinct and len(set(pages)) < len(pages):
            return None
        return pages

    def _checked(self, pages, distinct: bool = False):
        """Page ids as unique ids with multiplicities; raises on non-integer ids and ids outside the pool."""
        idx = as_ids(pages, "page ids")
        if idx.size == 0:
            return None, None
        if int(idx.view(np.uint64).max()) >= self.num_pages:  # one pass: a negative id reads as 2**63 or more
            raise PageOwnershipError(f"page id outside the pool of {self.num_pages} pages")
        if idx.size == 1 or distinct:
            return idx, 1
        idx, mult = np.unique(idx, return_counts=True)
        return idx, mult.astype(np.int32)

    def __repr__(self) -> str:
        kind = "metadata-only" if self.data is None else f"{tuple(self.page_shape)} {self.dtype} on {self.device}"
        return f"PagePool({self.num_pages} pages, {kind}, {self.num_free} free)"


class HostPagePool(PagePool):
    """``num_pages`` host pages of ``page_shape``/``dtype``; ``pin_memory=True`` allocates page-locked memory (needs
    CUDA), so device-to-host copies run at full bandwidth."""

    def __init__(self, num_pages: int, page_shape: Iterable[int] = (), dtype: torch.dtype = torch.float32,
                 pin_memory: bool = False, eviction: Eviction = None):
        super().__init__(num_pages, (), dtype, "cpu", eviction)  # ids and counts; the slab is made below
        self.page_shape = tuple(int(s) for s in page_shape)
        self.pinned = bool(pin_memory)
        if self.pinned and not torch.cuda.is_available():
            raise InvalidRequest("pin_memory=True needs CUDA; use pin_memory=False on a CPU-only machine")
        if self.page_shape and math.prod(self.page_shape) > 0:
            self.data = torch.zeros((self.num_pages, *self.page_shape), dtype=dtype, pin_memory=self.pinned)

    @classmethod
    def like(cls, pool: PagePool, num_pages: int, pin_memory: bool = False) -> "HostPagePool":
        """A host pool whose pages can hold ``pool``'s pages, evicting by the policy ``pool``'s names for a tier under
        it (``mmcache.eviction.tier_policy``; a policy of its own, on its own clock)."""
        return cls(num_pages, pool.page_shape, pool.dtype, pin_memory, tier_policy(pool.policy))


def can_hold(dst: PagePool, src: PagePool) -> bool:
    """Whether ``dst``'s pages have ``src``'s page shape and dtype (both metadata-only counts as equal)."""
    if dst.data is None or src.data is None:
        return dst.data is None and src.data is None
    return dst.page_shape == src.page_shape and dst.dtype == src.dtype


def copy_pages(src: PagePool, src_pages: Sequence[int], dst: PagePool, dst_pages: Sequence[int]) -> None:
    """``dst.data[dst_pages[i]] = src.data[src_pages[i]]`` for every i, across devices; a no-op for metadata-only
    pools. Blocking: when it returns, the source pages may be released and reused."""
    if len(src_pages) != len(dst_pages):
        raise InvalidRequest(f"{len(src_pages)} source page(s) for {len(dst_pages)} destination page(s)")
    if not len(src_pages) or src.data is None:
        return
    rows = src.data.index_select(0, torch.as_tensor(list(src_pages), dtype=torch.long, device=src.data.device))
    dst.data.index_copy_(0, torch.as_tensor(list(dst_pages), dtype=torch.long, device=dst.data.device),
                         rows.to(dst.data.device))
