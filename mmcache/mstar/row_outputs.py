"""Per-row outputs of a node's forward that its KV does not hold, kept per KV page beside the KV arena, so a walk cut
to its suffix still hands its consumer every row.

Qwen3-Omni's thinker streams each fed row's ``thinker_states`` (the row's input embedding and its hidden state after
the talker's layer) to the talker when audio output is asked: a walk cut at what the KV holds would emit states for
the suffix rows only. ``RowOutputs`` (a model module declares it, ``PrefixReuse.row_outputs``) says what those rows
are; ``SideRows`` (made by ``ReuseKVManager``) holds them in a ``[num_pages, page_size, width]`` tensor on the KV
device, indexed by the KV arena's own page ids.

The invariant, and why it needs no bookkeeping of its own: row ``s`` of side page ``p`` belongs to KV page ``p``'s
position ``s``, so it lives and dies with that page id: the pool's owner counts, the prefix index, eviction and
sharing that keep KV page ``p`` alive keep its side rows, and nothing writes a page another owner holds. A row is
marked valid when a committed step wrote it from a forward it watched, and every row of a page is marked invalid when
the page is taken fresh from the arena's allocator (``forget``): a page is served to a walk that needs its rows only
when all of them are valid (``servable``). Pages enter a stream only through that allocator or a match, so a page
whose KV came another way (a copy up from a lower tier, a reload after offload, a step no watched forward produced)
is never served with side rows it does not have.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np
import torch

from mmcache.errors import InvalidRequest

# what a watch hands ``record``: one forward's rows, packed in batch order, as column blocks of the width
RowParts = Sequence[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class RowOutputs:
    """The per-row outputs of a node's walks that the KV does not hold (``PrefixReuse.row_outputs``).

    - ``width``, ``dtype``: one row's outputs (the side tensor's last dim and dtype). Rows are stored only where
      ``dtype`` holds them exactly (the same dtype, or a wider float: bf16 rows in an fp32 side tensor), and
      ``restore`` casts them back to what the forward emits.
    - ``watch(submodule, record)``: installs a hook on the node's submodule that only reads: each forward hands
      ``record`` its rows, packed in the order of the step's segments, as column blocks whose widths sum to ``width``.
    - ``needed(graph_walk, fwd_info)``: whether this step's outputs carry every fed row (then the walk is cut only
      at pages whose side rows are valid, and its held rows are put back in front of what it emits).
    - ``keep(node_inputs)``: what ``restore`` needs from the step's inputs as they were before the cut (a mask).
    - ``restore(outputs, held_rows, kept)``: puts ``held_rows`` (the cut rows' outputs, in position order) in front
      of what the forward emitted in one request's ``outputs``, before the node's own postprocess.
    """

    width: int
    dtype: torch.dtype
    watch: Callable[[object, Callable[[RowParts], None]], None]
    needed: Callable[[str, object], bool]
    keep: Callable[[object], object]
    restore: Callable[[dict, torch.Tensor, object], None]


class SideRows:
    """``RowOutputs`` rows per KV page (see the module docstring for the invariant): ``rows`` is ``[num_pages,
    page_size, width]`` on ``device``, ``valid`` one bool per row. Callers hold the pool's ``cache_lock``."""

    def __init__(self, num_pages: int, page_size: int, spec: RowOutputs, device: torch.device):
        self.spec, self.page_size = spec, int(page_size)
        self.rows = torch.empty((num_pages, self.page_size, spec.width), dtype=spec.dtype, device=device)
        self._flat = self.rows.view(-1, spec.width)
        self.valid = np.zeros((num_pages, self.page_size), dtype=bool)
        self._valid_flat = self.valid.reshape(-1)
        self._fits: set[tuple] = set()  # the (dtype, width) column blocks a write has checked already

    def forget(self, pages: Sequence[int]) -> None:
        """``pages`` were taken fresh: none of their rows is valid until a step writes it."""
        self.valid[list(pages)] = False

    def servable(self, pages: np.ndarray) -> int:
        """How many leading ``pages`` have every row valid."""
        full = self.valid[np.asarray(pages, dtype=np.int64)].all(axis=1)
        return int(full.size if full.all() else full.argmin())

    def _flat_index(self, page_indices: Sequence[int], lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi)
        return np.asarray(page_indices, dtype=np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def write(self, spans: Sequence[tuple[Sequence[int], int, int, int]], parts: RowParts) -> None:
        """Store one forward's rows: ``spans`` are ``(page ids, first position, rows, first row in parts)`` of the
        streams it wrote; ``parts`` its column blocks (``RowOutputs.watch``). ``InvalidRequest`` when the blocks do
        not make a row of the declared width and dtype."""
        blocks = tuple((p.dtype, int(p.shape[-1])) for p in parts)
        if blocks not in self._fits:
            dtype = self.spec.dtype
            if sum(w for _, w in blocks) != self.spec.width or any(torch.promote_types(d, dtype) != dtype
                                                                   for d, _ in blocks):
                raise InvalidRequest(f"row outputs {[(tuple(p.shape), p.dtype) for p in parts]} are not rows of "
                                     f"width {self.spec.width} that {dtype} holds exactly (RowOutputs)")
            self._fits.add(blocks)
        P, chunks, few = self.page_size, [], []
        for pages, lo, n, _ in spans:
            if n <= 16:  # a decode step's rows: Python ints beat building arrays per stream
                few.extend(pages[p // P] * P + p % P for p in range(lo, lo + n))
                continue
            if few:
                chunks.append(np.asarray(few, dtype=np.int64))
                few = []
            chunks.append(self._flat_index(pages, lo, lo + n))
        if few:
            chunks.append(np.asarray(few, dtype=np.int64))
        flat = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        at = self._index(flat)
        total = parts[0].shape[0]
        if not (len(spans) and spans[0][3] == 0 and sum(n for *_, n, _ in spans) == total
                and all(b[3] == a[3] + a[2] for a, b in zip(spans, spans[1:]))):
            take = torch.from_numpy(np.concatenate([np.arange(r, r + n) for _, _, n, r in spans]))
            parts = [p[take.to(p.device)] for p in parts]
        col = 0
        for part in parts:
            w = int(part.shape[-1])
            self._flat[:, col:col + w].index_copy_(0, at, part.reshape(-1, w))
            col += w
        self._valid_flat[flat] = True

    def read(self, page_indices: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        """A copy of the rows of positions ``lo..hi-1`` of a stream on ``page_indices``; ``InvalidRequest`` when one
        is not valid (a walk cut at a page no ``servable`` check let through)."""
        flat = self._flat_index(page_indices, lo, hi)
        if not self._valid_flat[flat].all():
            raise InvalidRequest(f"positions {lo}..{hi - 1} were cut from a walk that needs every row, but their row "
                                 "outputs are not held")
        return self._flat.index_select(0, self._index(flat))

    def _index(self, flat: np.ndarray) -> torch.Tensor:
        # a pageable host-to-device copy would wait for the step's forward to drain (the commit runs right after its
        # launch): pinned and non-blocking, it queues behind it instead (not yet measured on a GPU)
        at = torch.from_numpy(flat)
        if self.rows.device.type == "cuda":
            return at.pin_memory().to(self.rows.device, non_blocking=True)
        return at
