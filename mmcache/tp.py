"""Tensor-parallel agreement on the matched length (RFC phase 4a): the group minimum, as a ``GroupAgreement``.

Under TP every rank admits a request on its own, but all ranks must run the same prefill: a rank that reused more
pages than another would skip tokens the other computes. ``TPAgreement`` reduces the locally matched page count with
MIN over the TP process group (``torch.distributed``: gloo on CPU, NCCL on GPU) together with an all-ok flag; the
lifecycle (``mmcache.lifecycle.PrefixLifecycle.match``) keeps exactly the agreed pages on every rank before any state
is visible, and a local failure (bad input, a duplicate, with ``reserve_tokens`` a pool full of live requests) makes
every rank undo the admission (the failing rank raises its own error, the others ``RefusedByGroup``).

Turn it on with ``PrefixCache(pool, fp, agreement=TPAgreement(group))`` (or the same argument of any table built on
the lifecycle, M*'s KV resource included). One collective per admission (two with ``reserve_tokens``); nothing else
is collective. Ranks agree by construction, not by keeping their indexes in lockstep: their contents may differ (a
smaller pool, an eviction, a hash collision on one rank) and the minimum covers it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class TPAgreement:
    """MIN of (matched pages, ok) over ``group`` (None: the default process group). Every rank must call ``agree``
    for the same requests in the same order, as TP ranks already run the same schedule."""

    def __init__(self, group=None):
        self.group = group

    def agree(self, pages: int, ok: bool) -> tuple[int, bool]:
        t = torch.tensor([int(pages), int(ok)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t[0]), bool(t[1])
