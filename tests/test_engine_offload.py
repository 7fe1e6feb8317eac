"""PagedAllocator offload and reload: exact bytes back at the same positions, evicted prefixes recomputed, refusals
that leave the request offloaded."""

import pytest
import torch

from mmcache.errors import AllocationFailed, InvalidRequest
from mmcache.pool import HostPagePool
from conftest import (ALLOC_P as P, ALLOC_LABELS as LABELS, alloc_make as make, alloc_hosts as hosts,
                      alloc_sequence as sequence, alloc_values as values, alloc_write as write, alloc_held as held,
                      alloc_assert_exact as assert_exact, alloc_snapshot as snapshot, alloc_serve as serve)


def test_offload_and_reload_restore_the_exact_bytes_at_the_same_positions():
    alloc = make(text_pages=8, audio_pages=4)
    host = hosts(alloc, 6)
    stem = list(range(8))
    serve(alloc, "seed", {"text": stem}, decode=0)                        # 2 shared text pages in the index
    prompt = stem + [9] * 6
    alloc.add_request("b", LABELS, token_ids={"text": prompt})
    alloc.alloc("b", "text", 16)
    write(alloc, "b", "text", 15, values("text", b"", prompt, 16))        # the last page half written
    alloc.alloc("b", "audio", 7)
    write(alloc, "b", "audio", 7, values("audio", b"", None, 7, rid="b"))
    text, audio = alloc.cache("text").pool, alloc.cache("audio").pool
    st_t, st_a = alloc.get_state("b", "text"), alloc.get_state("b", "audio")
    _, saved_t = held(alloc, "b", "text")
    _, saved_a = held(alloc, "b", "audio")
    shared = list(st_t.page_indices[:2])
    assert (text.counts[shared] == 2).all()

    assert alloc.offload_request("b", host) == 4                          # 2 own text pages + 2 audio pages
    assert (text.counts[shared] == 1).all() and not set(shared) & set(text._free)   # resident, one owner less
    assert text.num_free == 6 and audio.num_free == 4
    assert host["text"].num_free == 4 and host["audio"].num_free == 4
    assert alloc.is_offloaded("b") and alloc.get_state("b", "text").position_id_start == 8
    assert alloc.stats().requests_offloaded == 1
    with pytest.raises(InvalidRequest):
        alloc.alloc("b", "text", 20)                                      # an offloaded request does not grow
    with pytest.raises(InvalidRequest):
        alloc.begin_batch(["b"])

    serve(alloc, "other", {"text": [50] * 13, "audio": [1] * 9}, decode=3)  # reuses and overwrites freed pages
    alloc.cache("audio").clear()

    back = alloc.reload_request("b", host)
    assert (back["text"].restored_pages, back["text"].discarded_pages) == (2, 0)
    assert (back["audio"].restored_pages, back["audio"].discarded_pages) == (2, 0)
    assert back["text"].state.computed_tokens == 15 and back["text"].state.page_indices[:2] == tuple(shared)
    assert back["text"].state == alloc.get_state("b", "text")
    assert torch.equal(held(alloc, "b", "text")[1], saved_t)             # every position, same bytes
    assert torch.equal(held(alloc, "b", "audio")[1], saved_a)
    assert host["text"].num_free == 6 and host["audio"].num_free == 6
    assert len(back["text"].state.page_indices) == len(st_t.page_indices)
    assert len(back["audio"].state.page_indices) == len(st_a.page_indices)
    assert not alloc.is_offloaded("b")

    # the restored request finishes and indexes its pages like any other
    write(alloc, "b", "text", 16, values("text", b"", prompt, 16))
    alloc.remove_request("b", output_ids={"text": sequence(prompt, 16)[14:]})
    alloc.add_request("c", ["text"], token_ids=sequence(prompt, 16) + [0])
    assert alloc.get_state("c", "text").matched_tokens == 16
    assert_exact(alloc, "c", "text", values("text", b"", prompt, 16))


def test_reload_after_the_shared_prefix_was_evicted_recomputes_without_corruption():
    alloc = make(text_pages=8, audio_pages=4)
    host = hosts(alloc, 8)
    stem = list(range(8))
    serve(alloc, "seed", {"text": stem}, decode=0)
    prompt = stem + [9] * 6
    alloc.add_request("b", LABELS, token_ids={"text": prompt})
    alloc.alloc("b", "text", 14)
    write(alloc, "b", "text", 14, values("text", b"", prompt, 14))
    alloc.offload_request("b", host)
    serve(alloc, "hog", {"text": list(range(100, 132))}, decode=0)       # 8 pages: the shared prefix is evicted

    back = alloc.reload_request("b", host)["text"]
    assert back.state.matched_tokens == 0 and back.state.computed_tokens == 0
    assert (back.restored_pages, back.discarded_pages) == (0, 2) and len(back.state.page_indices) == 4
    assert host["text"].num_free == 8
    write(alloc, "b", "text", 14, values("text", b"", prompt, 14))       # the engine recomputes from 0
    assert_exact(alloc, "b", "text", values("text", b"", prompt, 14))
    alloc.remove_request("b")
    alloc.add_request("c", ["text"], token_ids=prompt + [0])
    assert alloc.get_state("c", "text").matched_tokens == 12
    assert_exact(alloc, "c", "text", values("text", b"", prompt, 14))


def test_reload_refused_for_lack_of_pages_leaves_the_request_offloaded():
    alloc = make(text_pages=8, audio_pages=4)
    host = hosts(alloc, 8)
    prompt = list(range(30, 42))
    serve(alloc, "seed", {"text": prompt[:8]}, decode=0)
    alloc.add_request("b", LABELS, token_ids={"text": prompt})
    alloc.alloc("b", "text", 12)
    write(alloc, "b", "text", 12, values("text", b"", prompt, 12))
    alloc.alloc("b", "audio", 8)
    write(alloc, "b", "audio", 8, values("audio", b"", None, 8, rid="b"))
    _, saved_t = held(alloc, "b", "text")
    _, saved_a = held(alloc, "b", "audio")
    alloc.offload_request("b", host)
    alloc.add_request("hog", ["audio"])
    alloc.alloc("hog", "audio", 12)                                       # 3 of 4 audio pages live

    before = snapshot(alloc)
    with pytest.raises(AllocationFailed) as err:
        alloc.reload_request("b", host)                                   # text resumes, then audio cannot
    assert (err.value.label, err.value.request_id, err.value.pages_short) == ("audio", "b", 1)
    assert alloc.is_offloaded("b") and snapshot(alloc) == before
    assert host["text"].num_free == 7 and host["audio"].num_free == 6

    alloc.abort_request("hog")
    alloc.reload_request("b", host)
    assert torch.equal(held(alloc, "b", "text")[1], saved_t)
    assert torch.equal(held(alloc, "b", "audio")[1], saved_a)


def test_refused_reload_after_a_prefix_eviction_keeps_the_request_offloaded_with_its_prefix_to_recompute():
    alloc = make(text_pages=8, audio_pages=4)
    host = hosts(alloc, 8)
    prompt = list(range(8)) + [9] * 6
    serve(alloc, "seed", {"text": prompt[:8]}, decode=0)
    alloc.add_request("b", LABELS, token_ids={"text": prompt})
    alloc.alloc("b", "text", 14)
    write(alloc, "b", "text", 14, values("text", b"", prompt, 14))
    alloc.alloc("b", "audio", 8)
    write(alloc, "b", "audio", 8, values("audio", b"", None, 8, rid="b"))
    _, saved_a = held(alloc, "b", "audio")
    alloc.offload_request("b", host)
    serve(alloc, "evictor", {"text": list(range(100, 132))}, decode=0)   # the shared text prefix is evicted
    alloc.add_request("hog", ["audio"])
    alloc.alloc("hog", "audio", 12)

    with pytest.raises(AllocationFailed):
        alloc.reload_request("b", host)                                   # text resumed (prefix gone), audio not
    assert alloc.is_offloaded("b") and alloc.get_state("b", "text").computed_tokens == 0
    assert host["text"].num_free == 8 and host["audio"].num_free == 6     # the text data was past computed
    alloc.abort_request("hog")
    back = alloc.reload_request("b", host)
    assert back["text"].restored_pages == 0 and back["text"].state.computed_tokens == 0
    assert len(back["text"].state.page_indices) == 4 and back["audio"].restored_pages == 2
    assert torch.equal(held(alloc, "b", "audio")[1], saved_a)
    write(alloc, "b", "text", 14, values("text", b"", prompt, 14))
    assert_exact(alloc, "b", "text", values("text", b"", prompt, 14))


def test_offloaded_request_can_be_removed_and_frees_its_host_pages():
    alloc = make()
    host = hosts(alloc)
    alloc.add_request("a", LABELS, token_ids={"text": list(range(10))})
    alloc.alloc("a", "text", 10)
    write(alloc, "a", "text", 10, values("text", b"", list(range(10)), 10))
    alloc.offload_request("a", host)
    assert host["text"].num_free == 13
    alloc.remove_request("a")
    assert host["text"].num_free == 16 and alloc.cache("text").pool.num_free == 16   # nothing indexed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_host_pool():
    assert HostPagePool(2, (2, P), torch.float16, pin_memory=True).data.is_pinned()
