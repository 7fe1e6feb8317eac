"""Two lifecycle contracts: ``resume`` re-matches the generated pages a request committed, and
``abort(rid, discard=True)`` unindexes only the pages the request's own commits still stand for."""

import pytest
import torch

from mmcache import Fingerprint, PagePool, PrefixCache

P = 4
FP = Fingerprint(model="org/m@rev", page_size=P)


def make(num_pages, **kw):
    return PrefixCache(PagePool(num_pages, (), torch.int64), FP, **kw)


@pytest.mark.parametrize("generated_pages", [3, 70])  # a request's few pages, and a chain past the scalar paths
def test_resume_rematches_the_generated_pages_the_request_committed(generated_pages):
    cache = make(2 * generated_pages + 8)
    prompt = list(range(6))                                          # page 1 is the prompt's, filled by generated ids
    output = [100 + i for i in range(generated_pages * P)]
    total = len(prompt) + len(output)                                # 1 + generated_pages full pages and 2 tokens
    cache.admit("a", prompt)
    st = cache.grow("a", total)
    cache.mark_computed("a", total, output)
    full = total // P
    assert all(cache.index.serial(p) for p in st.page_indices[:full])  # every full page is indexed as written
    assert len(cache.suspend("a")) == 1                              # only the tail page is the request's alone
    back = cache.resume("a")
    assert back.matched_tokens == full * P and back.computed_tokens == total
    assert back.page_indices == st.page_indices                      # the indexed pages themselves, not copies
    cache.finish("a", output)
    assert cache.stats().pages_live == 0


def test_discard_leaves_pages_another_request_indexed_under_a_recycled_page_id():
    cache = make(4, evict_batch_pages=1)
    a = cache.admit("a", list(range(9)))
    a = cache.grow("a", 9)
    cache.mark_computed("a", 9)                                      # a's pages 0 and 1 are indexed
    a_indexed = set(a.page_indices[:2])
    cache.suspend("a")                                               # ...and held by the index alone
    b_prompt = list(range(100, 109))
    cache.admit("b", b_prompt)
    b = cache.grow("b", 9)                                           # evicts a's pages: b gets their ids
    cache.mark_computed("b", 9)
    cache.finish("b")
    assert a_indexed & set(b.page_indices[:2])
    assert all(cache.index.serial(p) for p in b.page_indices[:2])
    cache.abort("a", discard=True)
    assert all(cache.index.serial(p) for p in b.page_indices[:2])    # b's chain stays indexed
    assert cache.admit("c", b_prompt).matched_tokens == 8


def test_discard_still_unindexes_what_the_request_committed_and_what_hangs_under_it():
    cache = make(16)
    cache.admit("a", list(range(9)))
    a = cache.grow("a", 9)
    cache.mark_computed("a", 9)
    c = cache.admit("c", list(range(9)) + [7] * 8)                  # continues a's chain while a runs
    cache.grow("c", 17)
    cache.mark_computed("c", 17)
    cache.finish("c")
    assert c.matched_tokens == 8 and cache.stats().pages_cached == 4
    cache.abort("a", discard=True)
    assert not any(cache.index.serial(p) for p in a.page_indices) and cache.stats().pages_cached == 0
    assert cache.admit("d", list(range(9)) + [7] * 8).matched_tokens == 0
