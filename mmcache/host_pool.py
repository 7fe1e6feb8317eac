"""HostPagePool: a PagePool in host memory that holds offloaded pages, and the one copy between two pools.

Offload copies a request's exclusively owned device pages into host pages of the same ``page_shape`` and dtype; reload
copies them back into fresh device pages. Ownership works as on the device: the offload record is the host pages'
only owner, and releasing them returns them to the host free list.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

from mmcache.pool import PagePool


class HostPagePool(PagePool):
    """``num_pages`` host pages of ``page_shape``/``dtype``; ``pin_memory=True`` allocates page-locked memory (needs
    CUDA), so device-to-host copies run at full bandwidth."""

    def __init__(self, num_pages: int, page_shape: Iterable[int] = (), dtype: torch.dtype = torch.float32,
                 pin_memory: bool = False):
        super().__init__(num_pages, (), dtype, "cpu")  # ids and counts; the slab is made here, pinned if asked
        self.page_shape = tuple(int(s) for s in page_shape)
        self.pinned = bool(pin_memory)
        if self.pinned and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA; use pin_memory=False on a CPU-only machine")
        if self.page_shape and math.prod(self.page_shape) > 0:
            self.data = torch.zeros((self.num_pages, *self.page_shape), dtype=dtype, pin_memory=self.pinned)

    @classmethod
    def like(cls, pool: PagePool, num_pages: int, pin_memory: bool = False) -> "HostPagePool":
        """A host pool whose pages can hold ``pool``'s pages."""
        return cls(num_pages, pool.page_shape, pool.dtype, pin_memory)


def can_hold(dst: PagePool, src: PagePool) -> bool:
    """Whether ``dst``'s pages have ``src``'s page shape and dtype (both metadata-only counts as equal)."""
    if dst.data is None or src.data is None:
        return dst.data is None and src.data is None
    return dst.page_shape == src.page_shape and dst.dtype == src.dtype


def copy_pages(src: PagePool, src_pages: Sequence[int], dst: PagePool, dst_pages: Sequence[int]) -> None:
    """``dst.data[dst_pages[i]] = src.data[src_pages[i]]`` for every i, across devices; a no-op for metadata-only
    pools. Blocking: when it returns, the source pages may be released and reused."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source page(s) for {len(dst_pages)} destination page(s)")
    if not len(src_pages) or src.data is None:
        return
    rows = src.data.index_select(0, torch.as_tensor(list(src_pages), dtype=torch.long, device=src.data.device))
    dst.data.index_copy_(0, torch.as_tensor(list(dst_pages), dtype=torch.long, device=dst.data.device),
                         rows.to(dst.data.device))
