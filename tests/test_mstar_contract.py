"""One contract, three managers: M*'s own ``PagedAllocationManager``, the drop-in with reuse off, and the drop-in
with reuse on (no prompt matched, so it must behave as M* does). Everything M*'s cache manager and cuda-graph runner
rely on: lazy labels, grow-only alloc that never sets seq_len, the AllocationFailedError payload with nothing
changed, reset_label(free=False) under the cuda-graph state swap, page conservation, get_per_label_seq_info,
offload/reload through M*'s CPUPagePool, and a full CPU pool."""

import pytest
import torch

from mstar_helpers import cpu_page_pool, free_pages, held_pages, make_manager, require_mstar

require_mstar()

from mstar.engine.kv_store import AllocationFailedError  # noqa: E402

KINDS = ["mstar", "dropin", "reuse"]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


@pytest.fixture
def manager(kind, monkeypatch):
    return make_manager(kind, monkeypatch, max_num_pages=16, page_size=4)


def test_labels_are_created_on_first_access(manager):
    manager.add_request("r", ["main"])
    assert manager.get_labels("r") == ["main"]
    state = manager.get_state("r", "cfg_text")
    assert state.page_indices == [] and state.seq_len == 0 and state.position_id_start == 0
    assert manager.get_labels("r") == ["main", "cfg_text"]


def test_alloc_grows_only_and_never_sets_seq_len(manager):
    manager.add_request("r", ["main"])
    manager.alloc("r", "main", 5)
    state = manager.get_state("r", "main")
    assert len(state.page_indices) == 2 and state.seq_len == 0
    first = list(state.page_indices)
    manager.alloc("r", "main", 3)  # smaller: nothing changes
    assert state.page_indices == first
    manager.alloc("r", "main", 9)
    assert state.page_indices[:2] == first and len(state.page_indices) == 3
    assert len(set(state.page_indices)) == 3 and free_pages(manager) == 13


def test_allocation_failure_carries_its_payload_and_changes_nothing(manager):
    manager.add_request("a", ["main"])
    manager.add_request("b", ["main"])
    manager.alloc("a", "main", 4 * 14)
    manager.alloc("b", "main", 4)
    before = list(manager.get_state("b", "main").page_indices)
    with pytest.raises(AllocationFailedError) as err:
        manager.alloc("b", "main", 4 * 5)
    assert isinstance(err.value, RuntimeError)
    assert (err.value.pages_short, err.value.request_id, err.value.label) == (3, "b", "main")
    assert manager.get_state("b", "main").page_indices == before and free_pages(manager) == 1


def test_cuda_graph_state_swap_and_reset_without_free(manager):
    """cuda_graph_runner.py:2798-2840: a dummy id borrows the real request's state object, then reset_label(dummy,
    free=False) gives the dummy a fresh state while the real request keeps its pages."""
    manager.add_request("real", ["main"])
    manager.add_request("dummy", ["main"])
    manager.alloc("real", "main", 8)
    real = manager.get_state("real", "main")
    real.seq_len = real.position_id_start = 8
    manager.get_state("dummy", "main")
    manager.request_states["dummy"]["main"] = real
    manager.alloc("dummy", "main", 9)  # the graph's plan grows the borrowed state
    assert len(real.page_indices) == 3
    manager.reset_label("dummy", "main", free=False)
    assert manager.get_state("real", "main") is real and len(real.page_indices) == 3
    assert manager.get_state("dummy", "main").page_indices == []
    assert free_pages(manager) == 13
    manager.remove_request("dummy")
    manager.remove_request("real")
    assert free_pages(manager) == 16


def test_pages_are_conserved_through_reset_and_remove(manager):
    for i in range(4):
        manager.add_request(f"r{i}", ["main", "uncond"])
        manager.alloc(f"r{i}", "main", 4 * (i + 1))
        manager.alloc(f"r{i}", "uncond", 3)
    assert free_pages(manager) + held_pages(manager) == 16
    manager.reset_label("r1", "main")
    assert manager.get_state("r1", "main").page_indices == []
    assert free_pages(manager) + held_pages(manager) == 16
    for i in range(4):
        manager.remove_request(f"r{i}")
    assert free_pages(manager) == 16 and manager.request_states == {} and manager.pending_reads == {}


def test_per_label_seq_info_reports_each_label(manager):
    manager.add_request("r", ["main", "cfg_text"])
    manager.alloc("r", "main", 6)
    state = manager.get_state("r", "main")
    state.seq_len, state.position_id_start = 6, 7
    info = manager.get_per_label_seq_info("r")
    assert set(info) == {"main", "cfg_text"}
    assert (info["main"].seq_len, info["main"].pos_id, info["main"].page_indices) == (6, 7, state.page_indices)
    assert info["cfg_text"].seq_len == 0


def test_sync_retrieve_reads_pages_from_another_manager(kind, monkeypatch):
    """The remote-read path (start_async_retrieve/sync_retrieve) between two managers on one node."""
    src, dst = make_manager(kind, monkeypatch), make_manager(kind, monkeypatch)
    src.add_request("r", ["main"])
    src.alloc("r", "main", 7)
    s = src.get_state("r", "main")
    s.seq_len, s.position_id_start = 7, 7
    for j, page in enumerate(s.page_indices):
        src.kv_cache[:, page] = float(j + 1)
    dst.add_request("r", ["main"])
    dst.sync_retrieve("r", "main", src.get_per_label_seq_info("r")["main"])
    d = dst.get_state("r", "main")
    assert (d.seq_len, d.position_id_start, d.read_in_progress) == (7, 7, False)
    assert torch.equal(dst.kv_cache[:, d.page_indices[0]], src.kv_cache[:, s.page_indices[0]])
    assert torch.equal(dst.kv_cache[:, d.page_indices[1], :, :3], src.kv_cache[:, s.page_indices[1], :, :3])


def test_offload_and_reload_restore_kv(manager):
    manager.add_request("r", ["main", "uncond"])
    cpu = cpu_page_pool(manager.config, 8)
    for label, n in (("main", 9), ("uncond", 4)):
        manager.alloc("r", label, n)
        state = manager.get_state("r", label)
        state.seq_len, state.position_id_start = n, n + 1
        for page in state.page_indices:
            manager.kv_cache[:, page] = torch.randn_like(manager.kv_cache[:, page])
    saved = {label: manager.kv_cache[:, manager.get_state("r", label).page_indices].clone()
             for label in ("main", "uncond")}
    assert manager.offload_request("r", cpu) == 4
    assert free_pages(manager) == 16 and cpu.is_offloaded("r")
    manager.reload_request("r", cpu)
    for label, n in (("main", 9), ("uncond", 4)):
        state = manager.get_state("r", label)
        assert (state.seq_len, state.position_id_start) == (n, n + 1)
        assert torch.equal(manager.kv_cache[:, state.page_indices], saved[label])
    assert cpu.num_free_pages == 8 and free_pages(manager) == 12


def test_full_cpu_pool(kind, manager):
    """M* frees the GPU pages even when its CPU pool refused them (the KV is lost: kv_store.py:712-716 after
    cpu_page_pool.py:77-83); the drop-in keeps such a label resident. Pages are conserved either way."""
    manager.add_request("r", ["main"])
    manager.alloc("r", "main", 12)
    state = manager.get_state("r", "main")
    state.seq_len = 12
    manager.kv_cache[:, state.page_indices] = 5.0
    cpu = cpu_page_pool(manager.config, 2)
    freed = manager.offload_request("r", cpu)
    assert not cpu.is_offloaded("r")
    if kind == "mstar":
        assert freed == 3 and state.page_indices == [] and state.seq_len == 0  # the KV is gone
    else:
        assert freed == 0 and len(state.page_indices) == 3 and state.seq_len == 12
        assert bool((manager.kv_cache[:, state.page_indices] == 5.0).all())
    manager.remove_request("r")
    assert free_pages(manager) == 16
