"""TP agreement: 2 and 4 real processes on 127.0.0.1 with gloo, each rank its own pool and PrefixCache. After every
admission all ranks hold the same matched length and the KV pages of the request hold the same bytes, which equal
what a fresh prefill writes (a deterministic function of the token prefix stands in for the KV)."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gloo_ranks import spawn_gloo
from mmcache import Fingerprint, PagePool, PrefixCache, page_names
from mmcache.errors import InvalidRequest, OutOfPages, RefusedByGroup
from mmcache.tp import TPAgreement

P = 4


def _kv(tokens: np.ndarray) -> torch.Tensor:
    """The stand-in KV of every position: (prefix sum, position), exact in float64."""
    t = torch.from_numpy(tokens.astype(np.float64))
    return torch.stack([torch.cumsum(t, 0), torch.arange(len(t), dtype=torch.float64)], dim=1)


class Rank:
    def __init__(self, rank, world, pages=64):
        self.rank, self.world = rank, world
        self.pool = PagePool(pages, page_shape=(P, 2), dtype=torch.float64)
        self.tp = PrefixCache(self.pool, Fingerprint("m", tp_rank=rank, tp_size=world, page_size=P),
                              agreement=TPAgreement())

    def run(self, rid, tokens, out=(), names=None):
        """Admit with agreement, check the group, 'prefill' what was not matched, finish."""
        tokens = np.asarray(tokens, dtype=np.int32)
        st = self.tp.admit(rid, tokens, names=names, reserve_tokens=len(tokens) + len(out))
        self.check(st, tokens)
        seq = np.concatenate([tokens, np.asarray(out, dtype=np.int32)])
        kv = _kv(seq)
        for j, page in enumerate(st.page_indices):
            if j * P >= st.matched_tokens:
                n = min(P, len(seq) - j * P)
                self.pool.data[page, :n] = kv[j * P:j * P + n]
        self.tp.mark_computed(rid, len(seq))
        self.tp.finish(rid, output_ids=out)
        return st

    def check(self, st, tokens):
        got = torch.tensor([st.matched_tokens])
        allm = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(allm, got)
        assert len({int(m) for m in allm}) == 1, f"matched lengths differ: {allm}"
        k = st.matched_tokens
        mine = self.pool.data[list(st.page_indices[:k // P])].reshape(-1, 2)
        assert torch.equal(mine, _kv(tokens)[:k]), "a matched page does not hold what a prefill writes"
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine)
        assert all(torch.equal(e, mine) for e in every)


def _scenarios(rank, world):
    rng = np.random.default_rng(0)  # same seed: every rank sees the same traffic
    base = rng.integers(0, 1000, 12).tolist()
    # identical traffic: agreement is a no-op
    r = Rank(rank, world)
    r.run("a", base + [1, 2], out=[7, 7, 7])
    assert r.run("b", base + [3]).matched_tokens == 12
    # one rank evicted its pages: everyone keeps none
    if rank == world - 1:
        r.tp.clear()
    st = r.run("c", base + [4])
    assert st.matched_tokens == 0 and r.tp.stats().requests_live == 0
    # a smaller pool on one rank: it keeps fewer pages; the group keeps what it kept
    r = Rank(rank, world, pages=6 if rank == 1 else 64)
    r.run("d", base + [5, 6, 7])                          # 4 pages
    r.run("e", rng.integers(0, 1000, 14).tolist())        # rank 1 evicts part of d's chain
    matched = r.run("f", base + [8]).matched_tokens
    assert matched < 12 and r.pool.counts.sum() == len(r.tp.index)
    # a rank whose pool is full of live requests at admission: all ranks refuse, nothing is left held
    r = Rank(rank, world, pages=8)
    r.run("g", base + [1])
    if rank == 0:
        r.tp.admit_unnamed("hog")
        r.tp.grow("hog", 6 * P)
    err = OutOfPages if rank == 0 else RefusedByGroup
    with pytest.raises(err):
        r.tp.admit("h", np.asarray(base + [2], dtype=np.int32), reserve_tokens=13)
    assert r.tp.stats().requests_live == (1 if rank == 0 else 0)
    if rank == 0:
        r.tp.abort("hog")
    assert r.run("h", base + [2]).matched_tokens < 12  # rank 0 evicted part of g's chain for the hog
    # a forced collision on one rank: its index holds other tokens under the request's names
    r = Rank(rank, world)
    target = np.asarray(base + [9], dtype=np.int32)
    names = page_names(r.tp.fingerprint, target)
    if rank == 1:
        r.run("evil", rng.integers(0, 1000, 13).tolist(), names=names)
    else:
        rng.integers(0, 1000, 13)
        r.run("first", target)
    st = r.run("target", target)
    assert st.matched_tokens == 0
    if rank == 1:
        assert r.tp.stats().collisions >= 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_the_matched_length_and_hold_the_same_bytes(world):
    spawn_gloo(_scenarios, world)


class GroupOf:
    """A group whose other ranks matched ``pages`` pages (None: another rank refused): the lifecycle must keep exactly
    the minimum and count only what it kept."""

    def __init__(self, pages):
        self.pages, self.calls = pages, []

    def agree(self, pages, ok):
        self.calls.append((pages, ok))
        if self.pages is None:
            return 0, False
        return min(pages, self.pages), ok


def test_the_group_minimum_is_kept_and_counted_and_a_refusal_holds_nothing():
    pool = PagePool(16)
    group = GroupOf(1)
    cache = PrefixCache(pool, Fingerprint("m", page_size=P), agreement=group)
    cache.admit("a", list(range(13)))
    cache.grow("a", 13)
    cache.mark_computed("a", 13)
    cache.finish("a")
    assert pool.counts.sum() == 3                                   # the index's owners of a's 3 full pages
    st = cache.admit("b", list(range(13)))
    assert st.matched_tokens == st.seq_len == 4 and len(st.page_indices) == 1 and pool.counts.sum() == 4
    assert cache.stats().hit_tokens == 4 and group.calls[-1] == (3, True)
    group.pages = None
    with pytest.raises(RefusedByGroup):
        cache.admit("c", list(range(13)))
    assert pool.counts.sum() == 4 and cache.stats().queries == 2    # nothing held, nothing counted
    with pytest.raises(InvalidRequest):
        cache.admit("bad", [])                                      # a local failure is told to the group too
    assert group.calls[-1] == (0, False)
