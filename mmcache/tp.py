"""Tensor-parallel agreement on the matched length (RFC phase 4a): the group minimum.

Under TP every rank admits a request on its own, but all ranks must run the same prefill: a rank that reused more
pages than another would skip tokens the other computes. ``TPAgreement.admit`` matches locally, reduces the matched
page count with MIN over the TP process group (``torch.distributed``: gloo on CPU, NCCL on GPU) and trims every
rank to exactly the agreed pages (``PrefixCache.trim_match`` releases the extra retains) before returning, so no
state with more pages is ever visible and no rank uses a page another rank did not match. A local failure (bad
input, or with ``reserve_tokens`` a pool full of live requests) travels in the same reduction: every rank undoes the
admission and raises (the failing rank its own error, the others ``RefusedByGroup``).

One collective per admission (two with ``reserve_tokens``); every other call (grow, finish, abort...) is local and
passes through to the wrapped cache. Ranks agree by construction, not by keeping their indexes in lockstep: their
contents may differ (a smaller pool, an eviction, a hash collision on one rank) and the minimum covers it.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from mmcache.errors import RefusedByGroup
from mmcache.prefix_cache import PrefixCache, RequestState


class TPAgreement:
    """A rank's ``PrefixCache`` whose admissions agree with the rest of its TP group (see the module doc).

    Every rank of ``group`` must call ``admit`` for the same requests in the same order (as TP ranks already run
    the same schedule); ``group=None`` is the default process group.
    """

    def __init__(self, cache: PrefixCache, group=None):
        self.cache = cache
        self.group = group

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def _all_ok_min(self, pages: int, ok: bool) -> tuple[int, bool]:
        t = torch.tensor([pages, int(ok)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]), bool(t[1])

    def admit(self, rid: Hashable, token_ids, media: Sequence = (), salt: bytes = b"",
              names: Sequence[int] | None = None, reserve_tokens: int | None = None) -> RequestState:
        """Admit on every rank with the group's minimum matched length; with ``reserve_tokens``, also hold pages for
        that many tokens on every rank or on none."""
        error, state = None, None
        try:
            state = self.cache.admit(rid, token_ids, media, salt, names)
        except Exception as e:  # carried to the group in the reduction below, then re-raised here
            error = e
        P = self.cache.page_size
        agreed, all_ok = self._all_ok_min(state.matched_tokens // P if state else 0, error is None)
        if not all_ok:
            if state is not None:
                self.cache.abort(rid)
            raise error if error is not None else RefusedByGroup(f"request {rid!r}: another rank could not admit it")
        if state.matched_tokens // P > agreed:
            state = self.cache.trim_match(rid, agreed)
        if reserve_tokens is None:
            return state
        try:
            state = self.cache.grow(rid, reserve_tokens)
        except Exception as e:  # OutOfPages, or a bad length: the group undoes the admission either way
            error = e
        _, all_ok = self._all_ok_min(0, error is None)
        if not all_ok:
            self.cache.abort(rid)
            raise error if error is not None else RefusedByGroup(
                f"request {rid!r}: another rank could not hold {reserve_tokens} tokens")
        return state
