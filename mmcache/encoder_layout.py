"""An encoder output as bytes: the tree spec of its container, the aligned layout of its tensors, the entry's bytes
in that layout, and the pages of a tensor viewed as bytes (what ``mmcache.encoder_store`` writes and gathers, what
``mmcache.tiers.encoder_entry`` puts in a payload).

Page shape: the store views any pool's pages as bytes, so KV pages and encoder outputs share one pool (one pool per
node). A page is ``page_bytes`` = the bytes of one page of the pool's tensor, whatever its ``page_shape`` and dtype
(a KV page of shape (2, page_size, heads, head_dim) in bf16 is 4·page_size·heads·head_dim bytes), and an entry spans
ceil(nbytes / page_bytes) of them viewed as uint8. ``PageBytes`` serves a tensor whose pages lie in another
dimension (M*'s KV tensor ``[layers, pages, 2, page_size, heads, head_dim]``, page in dim 1): a page's bytes are then
its slices in every layer, in layer order, moved with one indexed copy and no per-page loop.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator

import torch

from mmcache.encoder_key import EncoderKey
from mmcache.errors import EncoderOutputError, InvalidRequest

_ALIGN = 16  # byte offset of each tensor within an entry: every dtype view of the gathered bytes is aligned


def flatten(value, leaves: list) -> Any:
    """The tree spec of ``value`` (None for a tensor, else (container type, dict keys, children)); appends its
    tensors to ``leaves`` in order."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.device.type == "meta":
            raise EncoderOutputError(f"encoder outputs must be dense tensors with data, got {value.layout} on "
                                     f"{value.device}")
        leaves.append(value)
        return None
    if isinstance(value, (tuple, list)):
        return (list if isinstance(value, list) else tuple), None, tuple(flatten(v, leaves) for v in value)
    if isinstance(value, dict):
        return dict, tuple(value), tuple(flatten(v, leaves) for v in value.values())
    raise EncoderOutputError(f"encoder outputs must be tensors or tuples/lists/dicts of tensors, "
                             f"got {type(value).__name__}")


def unflatten(tree, leaves: Iterator[torch.Tensor]):
    """Inverse of ``flatten``; containers come back as plain tuple/list/dict."""
    if tree is None:
        return next(leaves)
    kind, keys, children = tree
    items = [unflatten(child, leaves) for child in children]
    return dict(zip(keys, items)) if kind is dict else kind(items)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of ``t``'s elements in row-major order (a copy only when ``t`` is not contiguous)."""
    return t.detach().contiguous().view(-1).view(torch.uint8)


def entry_bytes(leaves: list[torch.Tensor], layout: tuple, size: int, device) -> torch.Tensor:
    """The entry's bytes in its aligned ``layout``, zero-padded to ``size``, as a 1-D uint8 tensor on ``device`` (the
    one tensor's own bytes, not a copy, when it is alone, on ``device`` and exactly ``size`` bytes)."""
    if len(leaves) == 1 and leaves[0].numel() * leaves[0].element_size() == size:
        return as_bytes(leaves[0]).to(device)
    blob = torch.zeros(size, dtype=torch.uint8, device=device)
    for t, (_, _, off) in zip(leaves, layout):
        blob[off:off + t.numel() * t.element_size()].copy_(as_bytes(t))
    return blob


def tensor_views(buf: torch.Tensor, layout: tuple) -> Iterator[torch.Tensor]:
    """The tensors of ``layout`` as views of ``buf`` (uint8, the aligned layout)."""
    return (buf[off:off + dtype.itemsize * math.prod(shape)].view(dtype).view(shape) for shape, dtype, off in layout)


def entry_layout(specs) -> tuple[tuple, int]:
    """``((shape, dtype, byte offset) per tensor, total bytes)`` of an entry whose tensors have ``specs`` (shape,
    dtype): each tensor starts at a multiple of ``_ALIGN`` bytes, in order, so the layout is a function of the specs
    alone (what a tier checks an entry read back against)."""
    layout, nbytes = [], 0
    for shape, dtype in specs:
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        layout.append((tuple(shape), dtype, nbytes))
        nbytes += math.prod(shape) * dtype.itemsize
    return tuple(layout), nbytes


@dataclasses.dataclass(frozen=True, eq=False)
class StoredBytes:
    """One entry as bytes, what an ``EncoderLowerTier`` keeps and hands back: ``key``, the tree spec and ``layout``
    of its tensors (``entry_layout``), ``nbytes``, the encoder seconds it cost (``compute_s``) and ``data``, a 1-D
    uint8 tensor of exactly ``nbytes`` in the aligned layout."""

    key: EncoderKey
    tree: Any
    layout: tuple
    nbytes: int
    compute_s: float
    data: torch.Tensor


class PageBytes:
    """Pages of a tensor viewed as bytes: ``data`` as ``(A, num_pages, B)`` uint8 with the page in the middle, so
    ``page_bytes = A·B`` (A = 1 when pages lie in dim 0). ``write``/``read`` move whole pages with one indexed copy."""

    def __init__(self, data: torch.Tensor, page_dim: int, num_pages: int):
        if not data.is_contiguous() or data.dim() <= page_dim or data.shape[page_dim] != num_pages:
            raise InvalidRequest(f"page data {tuple(data.shape)} must be contiguous with the pool's {num_pages} "
                                 f"pages in dim {page_dim}")
        a = math.prod(data.shape[:page_dim])
        self.view = data.view(-1).view(torch.uint8).view(a, num_pages, -1)
        self.device = data.device
        self.page_bytes = a * self.view.shape[2]

    def write(self, index: torch.Tensor, blob: torch.Tensor) -> None:
        """Pages ``index`` := ``blob`` (``len(index) * page_bytes`` bytes)."""
        a, b = self.view.shape[0], self.view.shape[2]
        self.view.index_copy_(1, index, blob.view(len(index), a, b).transpose(0, 1))

    def read(self, index: torch.Tensor) -> torch.Tensor:
        """A fresh 1-D copy of pages ``index`` in order (never aliases a page)."""
        rows = self.view.index_select(1, index)
        return (rows if rows.shape[0] == 1 else rows.transpose(0, 1).contiguous()).view(-1)

    def write_entry(self, index: torch.Tensor, leaves: list[torch.Tensor], layout: tuple) -> None:
        """Pages ``index`` := the entry of ``leaves`` in its aligned ``layout``, zero-padded to whole pages (a lone
        tensor's whole pages straight from its bytes, only a partial last page staged)."""
        device, pb = self.device, self.page_bytes
        if len(leaves) == 1:
            blob = as_bytes(leaves[0]).to(device)
            full = blob.numel() // pb
            if full:
                self.write(index[:full], blob[:full * pb])
            if blob.numel() > full * pb:
                last = torch.zeros(pb, dtype=torch.uint8, device=device)
                last[:blob.numel() - full * pb] = blob[full * pb:]
                self.write(index[full:], last)
        elif len(index):
            self.write(index, entry_bytes(leaves, layout, len(index) * pb, device))
