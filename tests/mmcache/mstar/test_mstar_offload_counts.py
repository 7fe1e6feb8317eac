"""M*'s offload contract on mmcache's KV resource, and its shortfall counts, with M*'s real classes (mstar-ai 0.2.1:
``KVManager``'s offload and reload, its ``CPUPagePool`` copies, ``StepRunner``; ``tests/mstar_toy_ar.py``).

M*'s worker offers a request as a victim only when ``reclaimable(rid) > 0`` and reads ``offload(rid) == 0`` as
"nothing moved, pick another"; so ``offload`` returns what it freed exactly when the request moved, whichever order
the calls come in and whatever other requests did to its pages in between. ``stats(label)`` reports the shortfalls M*'s
arena counted."""

import pytest
import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar_toy_ar import LABEL, P, PrefixReuse, host_pool, ids_feed, node, serve, step, weights  # noqa: E402

W = weights()
PROMPT = list(range(1, 3 * P + 1))  # three whole pages: prefilled, every page is indexed at the commit


def prefilled(rid: str = "b", pages: int = 32):
    """Nodes with reuse on and off, ``rid`` prefilled with ``PROMPT`` and left live on each, M*'s host pool under the
    one with reuse; returns them and each one's last logits."""
    on, off = node(W, pages=pages, reuse=PrefixReuse(model="toy@0")), node(W, pages=pages)
    on.kv._cpu_pool = host_pool(on, 16)
    logits = []
    for n in (on, off):
        n.runner.ingest_request(rid)
        logits.append(step(n, "prefill", {rid: ids_feed(PROMPT)})[1][rid])
    return on, off, logits


def share_with_live(on, rid: str = "c") -> None:
    """``rid`` matches every page the prefilled request holds, and stays live."""
    on.runner.ingest_request(rid)
    assert step(on, "prefill", {rid: ids_feed(PROMPT + [5, 6])})[0].ok
    assert on.kv.stats(LABEL).hit_tokens == len(PROMPT)


def unmoved(on, rid: str, pages: list[int], free: int) -> bool:
    """Nothing of ``rid`` moved: its stream holds the same pages, it is not offloaded, no host copy is left, and the
    pool has the ``free`` pages it had."""
    host = on.kv._cpu_pool
    return (on.kv._streams[rid][LABEL].page_indices == pages and not on.kv.is_offloaded(rid)
            and not host.is_offloaded(rid) and host.num_free_pages == 16 and on.kv.pool.num_free == free)


def decode_equal(on, off, rid: str, logits: list, n: int = 3) -> None:
    for _ in range(n):
        tok = int(logits[0].argmax())
        logits = [step(x, "decode", {rid: ids_feed([tok])})[1][rid] for x in (on, off)]
        assert torch.equal(*logits)


@pytest.mark.parametrize("ask_first", [True, False], ids=["reclaimable-then-offload", "offload-directly"])
def test_a_request_whose_pages_other_live_requests_hold_is_not_moved(ask_first):
    """Every page of ``b`` is held by the index and by live ``c``: offloading ``b`` frees nothing, so it moves nothing
    and returns 0, asked first or not; ``b`` then runs on, exact."""
    on, off, logits = prefilled()
    share_with_live(on)
    pages, free = list(on.kv._streams["b"][LABEL].page_indices), on.kv.pool.num_free
    if ask_first:
        assert on.kv.reclaimable("b") == 0
    assert on.kv.offload("b") == 0
    assert unmoved(on, "b", pages, free)
    decode_equal(on, off, "b", logits)


@pytest.mark.parametrize("ask_first", [True, False], ids=["reclaimable-then-offload", "offload-directly"])
def test_a_request_whose_pages_only_the_index_shares_is_moved_and_says_so(ask_first):
    """Every page of ``b`` is indexed and no other live request holds one: offloading it leaves them to the index alone
    (eviction candidates, which M*'s free count includes), so it moves and returns 3, the same figure
    ``reclaimable`` gave; reloaded, ``b`` runs on, exact."""
    on, off, logits = prefilled()
    room = on.kv._arena.num_free
    if ask_first:
        assert on.kv.reclaimable("b") == 3
    assert on.kv.offload("b") == 3
    assert on.kv.is_offloaded("b") and on.kv.reclaimable("b") == 0
    assert on.kv._arena.num_free == room + 3 and on.kv.stats(LABEL).pages_cached == 3
    assert on.kv.reload("b")
    decode_equal(on, off, "b", logits)


def test_pages_shared_while_the_offload_copies_them_leave_the_request_where_it_was():
    """The race M*'s worker runs: ``reclaimable`` says 3, then, while ``offload`` copies ``b`` to the host (outside
    the lock), ``c`` matches all of ``b``'s pages. The commit finds nothing to free: M*'s claims are abandoned, the
    host copy discarded, ``offload`` returns 0 and ``b`` runs on, exact."""
    on, off, logits = prefilled()
    assert on.kv.reclaimable("b") == 3
    pages = list(on.kv._streams["b"][LABEL].page_indices)
    host = on.kv._cpu_pool
    copy = host.offload_stream

    def copy_while_c_matches(**kw):
        done = copy(**kw)
        share_with_live(on)
        return done

    host.offload_stream = copy_while_c_matches
    free = on.kv.pool.num_free
    assert on.kv.offload("b") == 0 and "c" in on.kv._streams   # the copy ran, and c matched meanwhile
    assert unmoved(on, "b", pages, free - 1)                    # c took one page of its own; no host copy is left
    host.offload_stream = copy
    decode_equal(on, off, "b", logits)


def test_a_request_with_a_page_of_its_own_frees_it_and_its_indexed_ones():
    """``b`` matched ``a``'s three pages and wrote one more of its own (not full, so not indexed): all four are freed
    for M* (one free page, three left to the index)."""
    on = node(W, reuse=PrefixReuse(model="toy@0"))
    on.kv._cpu_pool = host_pool(on, 16)
    serve(on, "a", PROMPT + [9], 0)
    on.runner.ingest_request("b")
    assert step(on, "prefill", {"b": ids_feed(PROMPT + [7, 8])})[0].ok
    free = on.kv.pool.num_free
    assert on.kv.reclaimable("b") == 4 and on.kv.offload("b") == 4 and on.kv.pool.num_free == free + 1


# -- one source for the shortfall counts ----------------------------------------------------------------------------
def test_stats_report_the_shortfalls_m_star_s_arena_counted():
    """Requests that do not fit beside the cached pages evict them through M*'s arena (``CountedPageAllocator``):
    ``stats(label)`` reports exactly the batches, shortfall pages and stalls the allocator counted, and the label's
    index lost at least the pages the shortfalls asked for."""
    on = node(W, pages=8, reuse=PrefixReuse(model="toy@0", evict_batch_pages=1))
    for i in range(6):                                          # 4 pages each, 7 usable: every request evicts
        serve(on, f"r{i}", [10 * i + j for j in range(1, 14)], 2)
    on.runner.ingest_request("live")
    assert step(on, "prefill", {"live": ids_feed(range(90, 103))})[0].ok
    on.runner.ingest_request("big")
    assert not step(on, "prefill", {"big": ids_feed(range(60, 80))})[0].ok   # 5 pages beside 4 live: a stall
    counted = on.kv._arena.allocator.counters
    s = on.kv.stats(LABEL)
    assert counted["eviction_batches"] > 0 and counted["stalls"] == 1
    assert (s.eviction_batches, s.shortfall_pages, s.stalls) == (
        counted["eviction_batches"], counted["shortfall_pages"], counted["stalls"])
    assert s.evicted_pages >= s.shortfall_pages


def test_shortfalls_add_a_host_tier_s_copies_up_once():
    """With a host tier, pages copied up for a hit may evict too (counted on the label's index): ``shortfalls`` adds
    them to the arena's once, and ``stats`` reports that sum."""
    from mmcache.pool import HostPagePool
    from mmcache.tiers import HostTier, TierStack

    def host(fp, pool):
        return TierStack(fp, host=HostTier(HostPagePool.like(pool, 16), fp.page_size))

    on = node(W, pages=8, reuse=PrefixReuse(model="toy@0", tiers=host, evict_batch_pages=1))
    serve(on, "a", PROMPT + [9], 0)                             # 3 pages cached
    serve(on, "big", list(range(60, 84)), 1)                    # 7 pages: a's go down to the host tier
    serve(on, "again", PROMPT + [9], 2)                         # a's copied up: the room is made by evicting big's
    arena, tier = on.kv._arena.allocator.counters, on.kv.lifecycle(LABEL).index.counters
    s = on.kv.stats(LABEL)
    assert tier["eviction_batches"] > 0 and arena["eviction_batches"] > 0
    for k in ("eviction_batches", "shortfall_pages", "stalls"):
        assert getattr(s, k) == on.kv.shortfalls()[k] == arena[k] + tier[k]
