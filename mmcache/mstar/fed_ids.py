"""How the ids a stream is fed become the int32 ids its pages are named by (``mmcache.mstar.reuse_state``): consecutive
feeds joined by one call of their library (``joined_tokens``), a decode step's one-id feeds turned into ints at once
(``step_ids``), and ids on a CUDA device copied to pinned host memory without waiting (``ids_to_host``), the pages
they name waiting meanwhile (``Landing``); joined, they go into a stream's ``generated`` (``append_generated``)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from mmcache.errors import InvalidRequest
from mmcache.names import as_tokens


def joined_tokens(chunks: list) -> np.ndarray:
    """The ids of ``chunks`` (what consecutive feeds fed: ints (``feed_rows``' one id a step), tensors, arrays or lists,
    one step's ids each) as one int32 array; ``InvalidRequest`` when one is not a flat sequence of token ids. Chunks
    of one kind are joined by one call of their library (one device copy for tensors), mixed ones id by id."""
    first = chunks[0]
    try:
        if type(first) is int:
            return as_tokens(chunks)
        if isinstance(first, torch.Tensor):
            return as_tokens(torch.cat(chunks))
        if isinstance(first, np.ndarray):
            return as_tokens(np.concatenate(chunks))
    except (InvalidRequest, RuntimeError, TypeError, ValueError):  # mixed chunks: the general path says what is wrong
        pass
    return as_tokens([i for c in chunks
                      for i in ((c,) if type(c) is int else c.tolist() if hasattr(c, "tolist") else c)])


def append_generated(named, ids: np.ndarray) -> None:
    """``named.generated`` += ``ids`` (``named``: a stream's names in ``reuse_state``), in room that doubles (a
    stream's generated ids are copied O(log n) times, not at every page that fills). ``generated`` stays a view of its
    first ids: a view taken earlier still reads what it read, since the room is only ever written past it."""
    n, k = named.generated.size, ids.size
    room = named.spare
    if n + k > room.size:
        room = np.empty(max(2 * room.size, n + k), dtype=np.int32)
        room[:n] = named.generated
        named.spare = room
    room[n:n + k] = ids
    named.generated = room[:n + k]


_INT_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8))


def one_tensor(tensors: list) -> torch.Tensor | None:
    """``tensors`` joined by one ``torch.cat`` (on their device, without reading them) into one flat tensor; None
    when one call does not join them so (the caller's general path then says what is wrong)."""
    try:
        joined = torch.cat(tensors)
    except (RuntimeError, TypeError, ValueError):
        return None
    return joined if joined.dim() == 1 else None


def step_ids(ids: list) -> list[int] | None:
    """A decode step's fed ids (one one-element tensor per request, as M* hands them) as ints, joined by one call:
    a stream then keeps an int a step, not a tensor, and the pages that fill are named from ints. None for ids on a
    CUDA device (reading them here would wait for the forward just launched: they go through ``ids_to_host``) and
    for anything one call does not join into one integer id a request (kept as fed, checked where joined)."""
    first = ids[0]
    if not isinstance(first, torch.Tensor) or first.device.type == "cuda":
        return None
    joined = one_tensor(ids)
    if joined is None or joined.numel() != len(ids) or joined.dtype not in _INT_DTYPES:
        return None
    return joined.tolist()


def ids_to_host(chunks: list[list]) -> tuple[torch.Tensor, object] | None:
    """Fed id tensors on a CUDA device (a decode step's sampled tokens, fed back; ``chunks``: each stream's, in
    order), joined there and copied to pinned host memory without waiting: ``(host tensor, the copy's event)``. M*'s
    GPU thread commits a step right after launching its forward, so a blocking copy there would wait for that forward.
    None for anything else (ids on the host are joined where they are, at once)."""
    first = chunks[0][0]
    if not isinstance(first, torch.Tensor) or first.device.type != "cuda":
        return None
    ids = one_tensor([chunk for stream in chunks for chunk in stream])
    if ids is None:
        return None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class Landing(NamedTuple):
    """Pages that filled in a step whose fed ids are on their way to the host (``ids_to_host``): the streams, how
    many of the ids each fed, the host tensor and the copy's event."""

    streams: list
    sizes: list[int]
    host: torch.Tensor
    event: object
