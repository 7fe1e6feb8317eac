"""PagedAllocator: the engine-facing allocator over one PrefixCache per label, on real pools that carry data.

Every written KV slot holds a value that depends on the label, the salt and every token up to its position (or on
the request, for a label without a prompt), so a page reused, restored or kept under the wrong prefix shows up as
wrong bytes.
"""

import threading

import pytest
import torch

from mmcache import Fingerprint, OutOfPages, PrefixCache
from mmcache.paged_allocator import PagedAllocator
from mmcache.errors import AllocationFailed, DuplicateRequest, InvalidRequest, UnknownRequest
from mmcache.pool import HostPagePool
from conftest import (ALLOC_P as P, ALLOC_LABELS as LABELS, alloc_make as make, alloc_hosts as hosts,
                      alloc_sequence as sequence, alloc_values as values, alloc_write as write,
                      alloc_assert_exact as assert_exact, alloc_snapshot as snapshot, alloc_serve as serve)


# ---------------------------------------------------------------------------------------------------- scenarios
def test_engine_loop_on_two_labels_reuses_each_labels_prefix_in_its_own_pool():
    alloc = make()
    text, audio = list(range(10, 20)), [5, 6, 7, 5, 6, 7]
    serve(alloc, "a", {"text": text, "audio": audio})                     # text: 14 tokens, audio: 10
    assert alloc.cache("text").stats().pages_cached == 3
    assert alloc.cache("audio").stats().pages_cached == 2

    t2, a2 = sequence(text, 14) + [1], sequence(audio, 10) + [2]
    states = alloc.add_request("b", LABELS, token_ids={"text": t2, "audio": a2})
    assert states["text"].matched_tokens == 12 and states["audio"].matched_tokens == 8
    assert states["text"].seq_len == 12 and states["text"].position_id_start == 0
    assert alloc.get_state("b", "text") == states["text"]
    assert_exact(alloc, "b", "text", values("text", b"", text, 14))      # the bytes a wrote, read by b
    assert_exact(alloc, "b", "audio", values("audio", b"", audio, 10))

    # the engine loop: one prefill step, then decode steps, each a batch
    with alloc.batch(["b"]):
        for label, prompt in (("text", t2), ("audio", a2)):
            alloc.alloc("b", label, len(prompt))
            write(alloc, "b", label, len(prompt), values(label, b"", prompt, len(prompt)))
    for step in range(1, 4):
        with alloc.batch(["b"]):
            for label, prompt in (("text", t2), ("audio", a2)):
                n = len(prompt) + step
                alloc.alloc("b", label, n)
                write(alloc, "b", label, n, values(label, b"", prompt, n))
    assert alloc.get_state("b", "text").computed_tokens == 18
    assert alloc.remove_request("b", output_ids={"text": sequence(t2, 18)[15:], "audio": sequence(a2, 14)[11:]})
    assert alloc.cache("text").stats().pages_cached == 4 and alloc.cache("audio").stats().pages_cached == 3
    assert len(alloc) == 0
    for label in LABELS:                                                  # only the index owns pages now
        cache = alloc.cache(label)
        assert (cache.pool.counts == cache.index.indexed).all()


def test_a_label_without_a_prompt_is_admitted_at_first_alloc_and_never_indexed():
    alloc = make()
    prompt = list(range(9))
    states = alloc.add_request("a", LABELS, token_ids={"text": prompt})
    assert states["audio"].page_indices == () and states["audio"].seq_len == 0
    with pytest.raises(InvalidRequest):
        alloc.mark_computed("a", "audio", 1)                              # not admitted yet
    st_ = alloc.alloc("a", "audio", 9)
    assert len(st_.page_indices) == 3 and st_.matched_tokens == 0
    with pytest.raises(InvalidRequest):
        alloc.set_prompt("a", "audio", [1, 2, 3])                         # already admitted, without a prompt
    write(alloc, "a", "audio", 9, values("audio", b"", None, 9, rid="a"))
    alloc.alloc("a", "text", 9)
    write(alloc, "a", "text", 9, values("text", b"", prompt, 9))
    alloc.remove_request("a")
    assert alloc.cache("audio").pool.num_free == 12                      # nothing of the audio label was indexed
    assert alloc.cache("text").stats().pages_cached == 2

    # set_prompt gives a late label prefix reuse
    alloc.add_request("b", LABELS, token_ids={"text": prompt})
    assert alloc.set_prompt("b", "audio", [3] * 9).matched_tokens == 0
    alloc.alloc("b", "audio", 9)
    write(alloc, "b", "audio", 9, values("audio", b"", [3] * 9, 9))
    alloc.remove_request("b")
    alloc.add_request("c", ["audio"], token_ids=[3] * 10)                 # one prompt for every listed label
    assert alloc.get_state("c", "audio").matched_tokens == 8
    assert_exact(alloc, "c", "audio", values("audio", b"", [3] * 9, 9))


def test_allocation_failed_carries_request_and_label_and_only_when_live_demand_exceeds_the_pool():
    alloc = make(text_pages=8, audio_pages=4)
    serve(alloc, "cached", {"text": list(range(16))}, decode=0)           # 4 cached text pages
    alloc.add_request("a", LABELS, token_ids={"text": list(range(100, 120))})
    alloc.alloc("a", "text", 28)                                          # 7 pages: cached pages are evicted
    assert alloc.cache("text").stats().evicted_pages == 3
    alloc.add_request("b", LABELS)
    before = snapshot(alloc, ["a", "b"])
    with pytest.raises(AllocationFailed) as err:
        alloc.alloc("a", "text", 40)                                      # 10 pages > 8
    assert isinstance(err.value, OutOfPages)
    assert (err.value.pages_short, err.value.request_id, err.value.label) == (2, "a", "text")
    assert "'a'" in str(err.value) and "'text'" in str(err.value)
    with pytest.raises(AllocationFailed) as err:
        alloc.alloc("b", "audio", 20)                                     # a first alloc too: admission undone
    assert (err.value.pages_short, err.value.request_id, err.value.label) == (1, "b", "audio")
    assert snapshot(alloc, ["a", "b"]) == before
    assert alloc.alloc("b", "audio", 16).seq_len == 16                    # exactly the pool: fine
    assert alloc.alloc("a", "text", 3).seq_len == 28                      # never shrinks


def test_removal_during_a_batch_waits_for_the_batch_and_then_indexes_and_frees():
    alloc = make()
    prompt = list(range(12))
    alloc.add_request("a", LABELS, token_ids={"text": prompt})
    alloc.add_request("b", LABELS)
    alloc.alloc("a", "text", 14)
    write(alloc, "a", "text", 14, values("text", b"", prompt, 14))
    alloc.alloc("b", "audio", 6)
    first = alloc.begin_batch(["a", "b"])
    second = alloc.begin_batch(["a"])                                     # pipelined: a is in two batches
    before = snapshot(alloc, ["a", "b"])
    assert alloc.remove_request("a", output_ids={"text": sequence(prompt, 14)[12:]}) is False
    assert alloc.abort_request("b") is False
    assert alloc.stats().to_dict() == {"requests": 2, "batches_in_flight": 2, "removals_queued": 2,
                                       "requests_offloaded": 0}
    with pytest.raises(InvalidRequest):
        alloc.remove_request("a")                                         # its removal is already queued
    with pytest.raises(InvalidRequest):
        alloc.begin_batch(["a"])                                          # a request being removed
    assert snapshot(alloc, ["a", "b"]) == before                          # pages still owned by the requests
    assert alloc.get_state("a", "text").computed_tokens == 14

    assert alloc.complete_batch(first) == ["b"]                           # a is still in the second batch
    assert alloc.cache("audio").pool.num_free == 12 and "b" not in alloc
    assert alloc.cache("text").stats().pages_cached == 0 and alloc.get_state("a", "text").seq_len == 14
    assert alloc.complete_batch(second) == ["a"]
    text = alloc.cache("text")
    assert text.stats().pages_cached == 3 and text.pool.num_free == 16 - 3 and len(alloc) == 0
    with pytest.raises(InvalidRequest):
        alloc.complete_batch(second)
    with pytest.raises(UnknownRequest, match="already been removed"):
        alloc.remove_request("a")

    # the context-manager form: removal inside the block is applied on exit
    alloc.add_request("c", ["text"], token_ids=prompt + [1])
    with alloc.batch(["c"]):
        alloc.alloc("c", "text", 13)
        alloc.remove_request("c")
        assert text.pool.counts[alloc.get_state("c", "text").page_indices[0]] == 2
    assert "c" not in alloc and text.pool.num_free == 16 - 3


def test_windowed_label_indexes_only_its_protected_run_and_releases_through_counts():
    alloc = make()
    prompt = list(range(200, 220))
    alloc.add_request("w", LABELS, token_ids={"text": prompt})
    alloc.alloc("w", "text", 24)
    write(alloc, "w", "text", 24, values("text", b"", prompt, 24))
    alloc.protect_prefix("w", "text", 8)
    st_ = alloc.release_oldest("w", "text", 2)
    assert st_.released_tokens == 8 and len(st_.page_indices) == 4
    assert_exact(alloc, "w", "text", values("text", b"", prompt, 24))    # kept pages, at their positions
    with pytest.raises(InvalidRequest):
        alloc.offload_request("w", hosts(alloc))                          # windowed requests are not offloaded
    alloc.remove_request("w", output_ids={"text": sequence(prompt, 24)[20:]})
    text = alloc.cache("text")
    assert text.stats().pages_cached == 2 and text.pool.num_free == 14
    alloc.add_request("r", ["text"], token_ids=prompt)
    assert alloc.get_state("r", "text").matched_tokens == 8
    alloc.abort_request("r")

    # release_oldest of a page the index also holds: decremented, not freed
    serve(alloc, "shared", {"text": list(range(16))}, decode=0)           # 4 pages indexed
    st_ = alloc.add_request("v", ["text"], token_ids=list(range(16)) + [7] * 8)["text"]
    assert st_.matched_tokens == 16
    alloc.alloc("v", "text", 24)
    write(alloc, "v", "text", 24, values("text", b"", list(range(16)) + [7] * 8, 24))
    alloc.protect_prefix("v", "text", 4)
    page = st_.page_indices[1]
    assert text.pool.counts[page] == 2
    alloc.release_oldest("v", "text", 1)
    assert text.pool.counts[page] == 1 and page not in text.pool._free


def test_errors_are_clear_and_change_nothing():
    alloc = make(text_pages=8, audio_pages=4)
    alloc.add_request("a", LABELS, token_ids={"text": list(range(6))})
    alloc.alloc("a", "text", 6)
    alloc.alloc("a", "audio", 4)
    alloc.add_request("solo", ["text"])
    small_host = {"text": HostPagePool.like(alloc.cache("text").pool, 1),
                  "audio": HostPagePool.like(alloc.cache("audio").pool, 4)}
    before = snapshot(alloc, ["a", "solo"])
    with pytest.raises(UnknownRequest, match="never added"):
        alloc.alloc("ghost", "text", 4)
    with pytest.raises(InvalidRequest, match="unknown label"):
        alloc.alloc("a", "video", 4)
    with pytest.raises(InvalidRequest, match="has no label"):
        alloc.get_state("solo", "audio")
    with pytest.raises(DuplicateRequest):
        alloc.add_request("a", LABELS)
    with pytest.raises(InvalidRequest):
        alloc.add_request("z", LABELS, token_ids={"text": [1, 2], "audio": [1, -2]})   # bad second prompt
    with pytest.raises(InvalidRequest):
        alloc.add_request("z", ["text"], token_ids={"audio": [1]})       # prompt for a label not listed
    with pytest.raises(InvalidRequest):
        alloc.add_request("z", ["text", "text"])
    with pytest.raises(InvalidRequest):
        alloc.add_request("z", ["text"], media=[(0, b"image")])          # media without a prompt
    with pytest.raises(InvalidRequest):
        alloc.alloc("a", "text", -1)
    with pytest.raises(InvalidRequest):
        alloc.mark_computed("a", "text", 7)                               # beyond what is held
    with pytest.raises(InvalidRequest):
        alloc.remove_request("a", output_ids={"audio": [1]})              # audio has no prompt: never indexed
    with pytest.raises(InvalidRequest):
        alloc.remove_request("a", output_ids={"text": [-1]})
    with pytest.raises(UnknownRequest):
        alloc.begin_batch(["a", "ghost"])                                 # no partial batch
    with pytest.raises(InvalidRequest):
        alloc.begin_batch(["a", "a"])
    with pytest.raises(InvalidRequest):
        alloc.complete_batch(12345)
    with pytest.raises(InvalidRequest):
        alloc.reload_request("a", hosts(alloc))                           # not offloaded
    with pytest.raises(InvalidRequest):
        alloc.offload_request("a", HostPagePool(8, (3,), torch.float32))  # wrong page shape
    with pytest.raises(AllocationFailed) as err:
        alloc.offload_request("a", small_host)                            # the host pool is too small
    assert err.value.label == "text" and small_host["text"].num_free == 1 and small_host["audio"].num_free == 4
    with alloc.batch(["a"]) as batch_id:
        with pytest.raises(InvalidRequest):
            alloc.offload_request("a", hosts(alloc))
        with pytest.raises(InvalidRequest):
            alloc.reset_label("a", "text")
        assert isinstance(batch_id, int)
    assert snapshot(alloc, ["a", "solo"]) == before
    with pytest.raises(InvalidRequest, match="share"):
        cache = alloc.cache("text")
        PagedAllocator({"x": cache, "y": PrefixCache(cache.pool, Fingerprint("other", page_size=P))})

    alloc.remove_request("a")
    with pytest.raises(UnknownRequest, match="already been removed"):
        alloc.remove_request("a")                                         # double remove
    with pytest.raises(UnknownRequest):
        alloc.abort_request("a")


def test_reset_label_tears_one_label_down_and_readmits_it():
    alloc = make()
    prompt = list(range(12))
    alloc.add_request("a", LABELS, token_ids={"text": prompt})
    alloc.alloc("a", "text", 12)
    write(alloc, "a", "text", 12, values("text", b"", prompt, 12))
    alloc.alloc("a", "audio", 5)
    assert alloc.reset_label("a", "text") == 3
    assert alloc.reset_label("a", "audio") == 0
    assert alloc.get_state("a", "text").seq_len == 0 and alloc.cache("audio").pool.num_free == 12
    assert alloc.set_prompt("a", "text", prompt + [1]).matched_tokens == 12
    alloc.remove_request("a")
    assert alloc.cache("text").pool.num_free == 16 - 3


def test_engine_threads_keep_counts_exact():
    alloc = make(text_pages=64, audio_pages=64)
    errors = []

    def worker(k):
        try:
            for i in range(k, 80, 4):
                prompt = list(range(i % 5 * 4)) + [i % 3] * 5
                alloc.add_request(i, LABELS, token_ids={"text": prompt})
                with alloc.batch([i]):
                    alloc.alloc(i, "text", len(prompt) + 2)
                    write(alloc, i, "text", len(prompt) + 2, values("text", b"", prompt, len(prompt) + 2))
                    alloc.alloc(i, "audio", 6)
                    alloc.remove_request(i, output_ids={"text": sequence(prompt, len(prompt) + 2)[len(prompt):]})
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(alloc) == 0
    for label in LABELS:
        cache = alloc.cache(label)
        assert (cache.pool.counts == cache.index.indexed).all()
        cache.clear()
        assert cache.pool.num_free == 64
