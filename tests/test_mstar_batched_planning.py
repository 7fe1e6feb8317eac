"""M*'s real ``FlashInferCacheManager`` with the batched allocation mixin (``mmcache.mstar.cache_manager``) vs M*'s
per-request ``alloc`` loop, on the CPU with the flashinfer stand-in: the same page tables after every step, logits
bit-equal (also to M*'s own manager), and a shortfall raising M*'s ``AllocationFailedError`` with the same payload and
the same state left behind, with and without cached pages to evict first."""

import pytest
import torch

import flashinfer_standin
from mstar_helpers import config, dropin_manager, kv_tensor, mstar_manager, require_mstar

require_mstar()

from mstar.engine.cache_manager import (  # noqa: E402
    FlashInferCacheManager, WorkspaceBufferManager, create_cache_manager,
)
from mstar.engine.kv_store import AllocationFailedError  # noqa: E402
from mstar_tiny_ar import TinyAR, H, L, D, P  # noqa: E402

from mmcache.mstar.cache_manager import BatchedAllocPlanning, batched_backend, use_batched_planning  # noqa: E402

PROMPTS = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [2, 7, 1, 8, 2, 8, 1], "c": [1, 1, 2, 3, 5, 8, 13, 21, 34],
           "d": [9]}


@pytest.fixture(autouse=True)
def flashinfer(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_standin.module())
    monkeypatch.setattr(BatchedAllocPlanning, "min_growing_share", 0)  # every plan batched, whatever grows


def manager(kind, monkeypatch, pages=64, reuse=False):
    """"mstar": M*'s manager; "dropin": the drop-in under M*'s classes; "batched": the drop-in under the mixin."""
    cfg = config(max_num_pages=pages, page_size=P, num_layers=L, num_kv_heads=H, head_dim=D)
    if kind == "mstar":
        return mstar_manager(cfg, kv_tensor(cfg), monkeypatch)
    alloc = dropin_manager(cfg, kv_tensor(cfg), reuse=reuse)
    if kind == "batched":
        use_batched_planning(alloc.config)
    return alloc


def tables(alloc) -> dict:
    return {rid: {label: list(s.page_indices) for label, s in labels.items()}
            for rid, labels in alloc.request_states.items()}


def run(alloc, prompts, decode, model=None):
    """Prefill ``prompts`` in one step, then decode greedily; the logits and page tables after every step."""
    for rid in prompts:
        alloc.add_request(rid, ["main"])
    if hasattr(alloc, "match_prefix"):
        prompts = {rid: ids[alloc.match_prefix(rid, "main", ids):] for rid, ids in prompts.items()}
    model = model or TinyAR()
    steps = [model.step(alloc, prompts)]
    seen = [tables(alloc)]
    for _ in range(decode):
        steps.append(model.step(alloc, {rid: [int(x.argmax())] for rid, x in steps[-1].items()}))
        seen.append(tables(alloc))
    return steps, seen


def test_the_batched_class_is_what_m_star_builds(monkeypatch):
    alloc = manager("batched", monkeypatch)
    assert alloc.config.attention_backend == batched_backend("flashinfer") == "mmcache.flashinfer"
    cm = create_cache_manager(request_ids=[], active_labels_per_request={}, kv_cache=alloc.kv_cache,
                              alloc_manager=alloc, buffer_manager=WorkspaceBufferManager(1024, "cpu"),
                              kv_cache_config=alloc.config, device="cpu")
    assert isinstance(cm, BatchedAllocPlanning) and isinstance(cm, FlashInferCacheManager)
    assert manager("dropin", monkeypatch).config.attention_backend == "flashinfer"  # M*'s registry entry untouched


def test_batched_gives_the_same_page_tables_and_bit_equal_logits(monkeypatch):
    calls = []
    per_request, batched = manager("dropin", monkeypatch), manager("batched", monkeypatch)
    take = batched.try_alloc_many
    monkeypatch.setattr(batched, "try_alloc_many", lambda *a, **k: calls.append(take(*a, **k)) or calls[-1])
    logits, seen = run(per_request, PROMPTS, decode=9)
    logits_b, seen_b = run(batched, PROMPTS, decode=9)
    logits_m, _ = run(manager("mstar", monkeypatch), PROMPTS, decode=9)
    assert calls == [True] * 10  # every plan went through the one batched call
    assert seen_b == seen
    for a, b, m in zip(logits, logits_b, logits_m, strict=True):
        assert a.keys() == b.keys() == m.keys()
        assert all(torch.equal(a[r], b[r]) and torch.equal(a[r], m[r]) for r in a)


def test_batched_with_reuse_matches_per_request_when_eviction_is_needed(monkeypatch):
    """Cached pages fill the pool: the batch's take needs eviction, so the mixin leaves it to M*'s loop, which evicts
    per request exactly as without the mixin (same tables, same logits, same index left behind)."""
    out, calls = {}, []
    for kind in ("dropin", "batched"):
        alloc = manager(kind, monkeypatch, pages=13, reuse=True)
        monkeypatch.setattr(alloc, "try_alloc_many",
                            lambda *a, take=alloc.try_alloc_many, **k: calls.append(take(*a, **k)) or calls[-1])
        run(alloc, {"a": PROMPTS["a"], "c": PROMPTS["c"]}, decode=2)
        for rid in ("a", "c"):
            alloc.remove_request(rid)
        assert alloc.pool.num_free < 16  # their full pages are cached
        out[kind] = run(alloc, {"b": PROMPTS["b"], "x": PROMPTS["a"][:8] + [7, 7], "d": [9] * 13}, decode=6)
        out[kind] += (alloc.pool.num_free, sorted(len(i) for i in alloc.indexes.values()))
    assert True in calls and False in calls  # some steps batched, some needed eviction and went per request
    assert out["batched"][1:] == out["dropin"][1:]
    for a, b in zip(out["dropin"][0], out["batched"][0], strict=True):
        assert all(torch.equal(a[r], b[r]) for r in a)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_shortfall_raises_m_stars_error_with_the_same_payload_and_state(monkeypatch, reuse):
    """Three requests cross a page boundary in one decode step with pages for only one: the second fails. Over every
    manager the error names it with its own shortfall, the first keeps its new page, nothing else changed."""
    results = {}
    for kind in ("mstar", "dropin", "batched"):
        alloc = manager(kind, monkeypatch, pages=10, reuse=reuse and kind != "mstar")
        prompts = {"a": [1] * 12, "b": [2] * 12, "c": [3] * 11}  # 3 + 3 + 3 pages: 1 free
        _, seen = run(alloc, prompts, decode=0)
        held = seen[-1]
        with pytest.raises(AllocationFailedError) as err:
            TinyAR().step(alloc, {"a": [4], "b": [4], "c": [4]})  # a and b need a 4th page, c does not
        e = err.value
        grown = {rid: len(t["main"]) - len(held[rid]["main"]) for rid, t in tables(alloc).items()}
        results[kind] = (e.pages_short, e.request_id, e.label, grown, alloc.page_allocator.num_free)
        if kind != "mstar":
            assert tables(alloc)["a"]["main"][:3] == held["a"]["main"]
    assert results["mstar"] == results["dropin"] == results["batched"] == (1, "b", "main", {"a": 1, "b": 0, "c": 0},
                                                                            0)


def test_a_pre_planned_label_allocates_nothing(monkeypatch):
    alloc = manager("batched", monkeypatch)
    alloc.add_request("r", ["main"])
    cm = create_cache_manager(request_ids=["r"], active_labels_per_request={"r": "main"}, kv_cache=alloc.kv_cache,
                              alloc_manager=alloc, buffer_manager=WorkspaceBufferManager(1024, "cpu"),
                              kv_cache_config=alloc.config, device="cpu")
    cm._pre_planned_labels.add("main")  # what M*'s CUDA-graph runner sets after planning ahead
    cm.plan_attention(seq_lens=[5], dtype=torch.float32)
    assert alloc.get_state("r", "main").page_indices == [] and "main" not in cm._pre_planned_labels


def test_a_plan_where_few_requests_can_grow_is_left_to_m_stars_loop(monkeypatch):
    """Decode steps over pages of 4: at most a quarter of the requests grow a page, under a share of 1/2."""
    monkeypatch.setattr(BatchedAllocPlanning, "min_growing_share", 1 / 2)
    calls, per_request, batched = [], manager("dropin", monkeypatch), manager("batched", monkeypatch)
    take = batched.try_alloc_many
    monkeypatch.setattr(batched, "try_alloc_many", lambda *a, **k: calls.append(take(*a, **k)) or calls[-1])
    logits, seen = run(per_request, PROMPTS, decode=3)
    logits_b, seen_b = run(batched, PROMPTS, decode=3)
    assert calls == [True] and seen_b == seen  # only the prefill went through the batched call
    assert all(torch.equal(a[r], b[r]) for a, b in zip(logits, logits_b) for r in a)
