"""TP agreement in M*'s KV resource: 2 real processes on 127.0.0.1 with gloo, each rank its own ``ReuseKVManager``
built with M*'s ``JointGroups`` (the TP group's process group is what the resource agrees over). Every admission
keeps the group's minimum on every rank, so both ranks run the same prefill; a rank that lost its cached pages makes
the other keep none, and outputs stay equal to reuse off."""

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import spawn_gloo
from mstar_helpers import require_mstar

require_mstar()


def _rank(rank: int, world: int) -> None:
    from mstar.distributed.communication import CommGroup, JointGroups

    from mstar_toy_ar import LABEL, PrefixReuse, node, serve, weights

    tp = CommGroup(my_global_rank=rank, my_group_rank=rank, group_members=list(range(world)))
    tp.device_group = dist.group.WORLD
    joint = JointGroups(tp_group=tp, sp_group=CommGroup.trivial())
    w = weights()
    on, off = node(w, reuse=PrefixReuse(model="toy@0"), joint=joint), node(w)
    prompt = list(range(1, 14))

    def both(rid, ids):  # tokens this request took from the cache, the same on every rank
        before = on.kv.stats(LABEL).hit_tokens
        got, want = serve(on, rid, ids, 2), serve(off, rid, ids, 2)
        assert got[0] == want[0] and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
        held = torch.tensor([on.kv.stats(LABEL).hit_tokens - before])
        every = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(every, held)
        assert len({int(x) for x in every}) == 1, every        # every rank kept the same matched length
        return int(held)

    assert both("a", prompt) == 0
    assert both("b", prompt + [5]) == 12                          # identical traffic: agreement is a no-op
    if rank == world - 1:
        on.kv.lifecycle(LABEL).index.clear()                      # one rank lost its cached pages
    assert both("c", prompt + [6]) == 0                           # ...so the group keeps none this time


@pytest.mark.slow
def test_tp_ranks_keep_the_group_minimum():
    spawn_gloo(_rank, 2)
