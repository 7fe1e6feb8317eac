"""One pool per M* node: the drop-in's prefix indexes and an EncoderStore on the node's pool, encoder bytes in M*'s
own KV tensor (page in dim 1), evicted across both kinds before AllocationFailedError."""

import pytest
import torch

from mstar_helpers import config, dropin_manager, kv_tensor, require_mstar

require_mstar()

from mstar.engine.kv_store import AllocationFailedError  # noqa: E402

from mmcache.encoder_store import EncoderStore  # noqa: E402
from conftest import store_key as key, store_floats as floats, assert_same_value  # noqa: E402

P = 4


@pytest.fixture
def node():
    cfg = config(max_num_pages=8, page_size=P, num_layers=2)
    m = dropin_manager(cfg, kv_tensor(cfg), reuse=True)
    return m, EncoderStore(pool=m.pool, page_data=m.kv_cache, page_dim=1)


def serve(m, rid, prompt):
    m.add_request(rid, ["main"])
    m.match_prefix(rid, "main", prompt)
    m.alloc(rid, "main", len(prompt))
    m.get_state(rid, "main").seq_len = len(prompt)
    m.remove_request(rid)


def test_encoder_bytes_live_in_the_kv_tensor_pages(node):
    m, store = node
    page_bytes = 2 * (2 * P * 1 * 2) * 4  # layers x (K/V x page x heads x dim) float32
    assert store.page_bytes == page_bytes
    v = floats(2 * page_bytes // 4 + 3)  # 3 pages
    assert store.put(key(0), v)
    pin = store.pin(key(0))
    pages = list(pin.pages)
    assert len(pages) == 3 and m.pool.num_free == 5
    first = m.kv_cache[:, pages[0]].reshape(-1).view(torch.uint8)  # layer 0's slice, then layer 1's
    assert torch.equal(first, v.view(torch.uint8)[:page_bytes])
    assert_same_value(store.get(key(0)), v)
    pin.release()


def test_a_live_request_evicts_encoder_outputs_and_a_put_evicts_kv(node):
    m, store = node
    for i in range(4):
        assert store.put(key(i), floats(store.page_bytes // 4, seed=i))  # one page each
    pin = store.pin(key(3))
    serve(m, "a", list(range(1, 10)))               # 2 full pages indexed (the third released)
    assert m.pool.num_free == 2
    m.add_request("b", ["main"])
    m.alloc("b", "main", 5 * P)                     # 5 pages: 2 free + 3 unpinned encoder entries (the coldest)
    assert [key(i) in store for i in range(4)] == [False, False, False, True]
    with pytest.raises(AllocationFailedError) as err:
        m.alloc("b", "main", 8 * P)                 # 3 more: 2 KV pages cached, 1 pinned: one short
    assert err.value.pages_short == 1 and len(m.get_state("b", "main").page_indices) == 5
    assert len(m.indexes["main"]) == 2 and key(3) in store
    m.remove_request("b")
    pin.release()
    assert store.put(key(7), floats(7 * store.page_bytes // 4))  # 7 pages, 5 free: the two coldest go
    assert key(3) not in store and len(m.indexes["main"]) == 1 and m.pool.num_free == 0  # key 3, the KV tail
