"""Prefix reuse inside the drop-in: lookup before the first prefill, teardown into the label's index (generated
pages too), labels never sharing pages, cold-tail eviction before AllocationFailedError, exact owner counts, and
offload as suspension (the claim survives, the KV comes back)."""

import numpy as np
import pytest

from mstar_helpers import config, cpu_page_pool, dropin_manager, kv_tensor, require_mstar

require_mstar()

from mstar.engine.kv_store import AllocationFailedError  # noqa: E402

from mmcache.errors import InvalidRequest  # noqa: E402

P = 4


@pytest.fixture
def manager():
    cfg = config(max_num_pages=12, page_size=P)
    return dropin_manager(cfg, kv_tensor(cfg), reuse=True)


def serve(m, rid, prompt, label="main", generated=(), salt=b""):
    """A request's life as the engine drives it: match, prefill the rest, decode, remove. Returns the match."""
    m.add_request(rid, [label])
    k = m.match_prefix(rid, label, prompt, salt=salt)
    state = m.get_state(rid, label)
    total = len(prompt) + len(generated)
    m.alloc(rid, label, total)
    state.seq_len = state.position_id_start = total
    m.append_tokens(rid, label, list(generated))
    m.remove_request(rid)
    return k


def owners_exact(m):
    """Each page's count = live holders + (1 if indexed)."""
    expect = np.zeros(m.pool.num_pages, dtype=np.int64)
    for labels in m.request_states.values():
        for s in labels.values():
            np.add.at(expect, s.page_indices, 1)
    for index in m.indexes.values():
        expect += index.indexed
    assert (m.pool.counts == expect).all()


def test_a_second_request_reuses_full_pages_and_its_state_looks_prefilled(manager):
    prompt = list(range(1, 11))
    assert serve(manager, "a", prompt) == 0
    manager.add_request("b", ["main"])
    assert manager.match_prefix("b", "main", prompt + [99]) == 8
    state = manager.get_state("b", "main")
    assert (state.seq_len, state.position_id_start, len(state.page_indices)) == (8, 8, 2)
    manager.alloc("b", "main", 11)
    assert len(state.page_indices) == 3
    owners_exact(manager)
    manager.remove_request("b")
    owners_exact(manager)


def test_the_last_prompt_token_is_always_computed(manager):
    serve(manager, "a", list(range(8)))
    manager.add_request("b", ["main"])
    assert manager.match_prefix("b", "main", list(range(8))) == 4


def test_generated_pages_are_indexed(manager):
    serve(manager, "a", [1, 2, 3], generated=[4, 5, 6, 7, 8, 9])
    manager.add_request("b", ["main"])
    assert manager.match_prefix("b", "main", list(range(1, 12))) == 8


def test_labels_and_salts_never_share_pages(manager):
    serve(manager, "a", list(range(9)), label="main")
    manager.add_request("b", ["cfg_text"])
    assert manager.match_prefix("b", "cfg_text", list(range(9))) == 0
    manager.add_request("c", ["main"])
    assert manager.match_prefix("c", "main", list(range(9)), salt=b"tenant") == 0


def test_unwritten_pages_are_not_indexed(manager):
    manager.add_request("a", ["main"])
    manager.match_prefix("a", "main", list(range(12)))
    manager.alloc("a", "main", 12)
    manager.get_state("a", "main").seq_len = 5  # only 5 tokens' KV written
    manager.remove_request("a")
    manager.add_request("b", ["main"])
    assert manager.match_prefix("b", "main", list(range(13))) == 4


def test_cached_pages_are_evicted_before_allocation_fails(manager):
    for i in range(3):
        serve(manager, f"w{i}", [100 * i + t for t in range(13)])  # 3 indexed pages each
    assert manager.pool.num_free == 3 and manager.num_reclaimable_pages == 12
    manager.add_request("big", ["main"])
    manager.alloc("big", "main", 4 * 10)  # needs 7 evictions
    owners_exact(manager)
    with pytest.raises(AllocationFailedError) as err:
        manager.alloc("big", "main", 4 * 13)
    assert err.value.pages_short == 1 and len(manager.get_state("big", "main").page_indices) == 10


def test_a_live_holder_keeps_a_page_from_eviction(manager):
    serve(manager, "a", list(range(13)))
    manager.add_request("b", ["main"])
    assert manager.match_prefix("b", "main", list(range(13))) == 12
    manager.add_request("c", ["main"])
    with pytest.raises(AllocationFailedError) as err:
        manager.alloc("c", "main", 4 * 10)  # 9 free; the 3 cached pages are b's too
    assert err.value.pages_short == 1
    owners_exact(manager)


def test_match_prefix_refuses_a_label_with_kv(manager):
    manager.add_request("a", ["main"])
    manager.alloc("a", "main", 3)
    with pytest.raises(InvalidRequest):
        manager.match_prefix("a", "main", [1, 2, 3])
    with pytest.raises(InvalidRequest):
        manager.match_prefix("nobody", "main", [1, 2, 3])


def test_offload_is_a_suspension(manager):
    prompt = list(range(1, 14))
    serve(manager, "a", prompt)
    manager.add_request("b", ["main"])
    manager.match_prefix("b", "main", prompt)
    manager.alloc("b", "main", 13)
    state = manager.get_state("b", "main")
    state.seq_len = 13
    manager.kv_cache[:, state.page_indices[-1]] = 3.0
    cpu = cpu_page_pool(manager.config, 8)
    assert manager.offload_request("b", cpu) == 4
    owners_exact(manager)
    manager.reload_request("b", cpu)
    assert (manager.kv_cache[:, state.page_indices[-1]] == 3.0).all()
    manager.append_tokens("b", "main", [7, 7, 7])
    state.seq_len = 16
    manager.alloc("b", "main", 16)
    manager.remove_request("b")  # the claim survived offload: its 4th page is indexed now
    manager.add_request("c", ["main"])
    assert manager.match_prefix("c", "main", prompt + [7, 7, 7, 1]) == 16


def test_reuse_off_matches_nothing():
    cfg = config(max_num_pages=8, page_size=P)
    m = dropin_manager(cfg, kv_tensor(cfg), reuse=False)
    serve(m, "a", list(range(9)))
    m.add_request("b", ["main"])
    assert m.match_prefix("b", "main", list(range(9))) == 0 and m.pool.num_free == 8
