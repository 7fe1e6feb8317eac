import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mmcache import OutOfPages, PagePool
from mmcache.errors import PageOwnershipError


def test_alloc_release_returns_pages_exactly_at_zero():
    pool = PagePool(4, (2, 3), torch.float16)
    assert pool.data.shape == (4, 2, 3) and pool.page_bytes == 12
    a = pool.alloc(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    pool.retain(a[:1])
    assert sorted(pool.release(a)) == sorted(a[1:])  # a[0] still has an owner
    assert pool.release(a[:1]) == a[:1] and pool.num_free == 4


def test_out_of_pages_carries_shortfall_and_takes_nothing():
    pool = PagePool(3)
    pool.alloc(2)
    with pytest.raises(OutOfPages) as err:
        pool.alloc(4)
    assert err.value.shortfall == 3 and pool.num_free == 1


@pytest.mark.parametrize("shape", [(), (0,), (4, 0)])
def test_metadata_only_pool_has_no_tensor(shape):
    pool = PagePool(8, shape)
    assert pool.data is None and pool.page_bytes == 0 and len(pool.alloc(8)) == 8


def test_ownership_errors_leave_counts_intact():
    pool = PagePool(4)
    (p,) = pool.alloc(1)
    with pytest.raises(PageOwnershipError):
        pool.retain([p, p + 1])              # p + 1 is free
    with pytest.raises(PageOwnershipError):
        pool.release([p, p])                 # would go below zero
    with pytest.raises(PageOwnershipError):
        pool.release([99])
    assert pool.counts[p] == 1 and pool.num_free == 3
    with pytest.raises(ValueError):
        pool.counts[p] = 5                   # the view is read-only


@given(st.lists(st.tuples(st.sampled_from("arx"), st.integers(0, 5)), max_size=60))
def test_free_list_matches_zero_counts(ops):
    pool = PagePool(6)
    held: list[int] = []
    for op, n in ops:
        if op == "a":
            try:
                held += pool.alloc(n)
            except OutOfPages as e:
                assert e.shortfall == n - pool.num_free > 0
        elif op == "r" and held:
            pool.retain(held[: n])
            held += held[: n]
        elif op == "x" and held:
            n = min(n, len(held))
            pool.release(held[len(held) - n:])
            del held[len(held) - n:]
        counts = pool.counts
        assert sorted(pool._free) == np.flatnonzero(counts == 0).tolist()
        assert (np.bincount(held, minlength=6) == counts).all()


def test_cuda_without_an_index_is_the_current_device():
    """A pool built on "cuda" accepts tensors on "cuda:0" (torch.device("cuda") != torch.device("cuda:0")); no GPU
    is needed to check the comparison, and a metadata-only pool allocates nothing on the device."""
    from mmcache.pool import canonical_device, same_device
    assert same_device("cuda", "cuda:0") and same_device("cpu", torch.device("cpu"))
    assert not same_device("cpu", "cuda:0")
    assert PagePool(4, device="cuda").device == canonical_device("cuda") and canonical_device("cuda").index is not None


@given(st.lists(st.integers(0, 4), max_size=6), st.integers(0, 8), st.integers(6, 20))
def test_alloc_split_gives_what_alloc_calls_in_turn_give(counts, held, size):
    batched, serial = PagePool(size), PagePool(size)
    for pool in (batched, serial):  # the same history: some pages taken, a few given back out of order
        pool.release(pool.alloc(min(held, size))[::2])
    free = batched.num_free
    got = batched.alloc_split(counts)
    if sum(counts) > free:
        assert got is None and batched.num_free == free  # all or none
    else:
        assert got == [serial.alloc(c) for c in counts]
        assert batched.num_free == serial.num_free and (batched.counts == serial.counts).all()
