"""PagedAllocator: the engine-facing allocator over one PrefixCache per label, on real pools that carry data.

Every written KV slot holds a value that depends on the label, the salt and every token up to its position (or on
the request, for a label without a prompt), so a page reused, restored or kept under the wrong prefix shows up as
wrong bytes.
"""

import threading

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mmcache import Fingerprint, OutOfPages, PagePool, PrefixCache
from mmcache.paged_allocator import PagedAllocator
from mmcache.errors import AllocationFailed, DuplicateRequest, InvalidRequest, UnknownRequest
from mmcache.pool import HostPagePool

P = 4
SHAPES = {"text": ((2, P, 2, 8), torch.float32), "audio": ((2, P, 1, 4), torch.float16)}  # (k/v, slot, heads, dim)
LABELS = ["text", "audio"]
MOD = 2039  # values stay exact in float16


def make(text_pages=16, audio_pages=12, evict=1):
    caches = {}
    for label, pages in (("text", text_pages), ("audio", audio_pages)):
        shape, dtype = SHAPES[label]
        caches[label] = PrefixCache(PagePool(pages, shape, dtype),
                                    Fingerprint(f"org/{label}@rev", page_size=P, kv_dtype=str(dtype)),
                                    evict_batch_pages=evict)
    return PagedAllocator(caches)


def hosts(alloc, pages=16):
    return {label: HostPagePool.like(alloc.cache(label).pool, pages) for label in LABELS}


def generated(t: int) -> int:
    return (t * 7) % 3  # the token a request "generates" at position t


def sequence(prompt, upto):
    return list(prompt) + [generated(t) for t in range(len(prompt), upto)]


def values(label, salt, prompt, upto, rid=None) -> list[int]:
    """The 'KV' of positions 0..upto-1: a rolling hash of the whole prefix, or of the request for no prompt."""
    if prompt is None:
        return [(hash(rid) % 97 * 31 + t) % MOD for t in range(upto)]
    h, out = (hash(label) ^ hash(salt)) & 0xFFFF, []
    for tok in sequence(prompt, upto):
        h = (h * 1_000_003 + tok + 1) % (1 << 61)
        out.append(h % MOD)
    return out


def page_of(state, t: int) -> int | None:
    """The page holding token t (None inside a released window)."""
    j = t // P - state.position_id_start // P
    keep = -(-(state.protected_tokens or 0) // P)
    if state.protected_tokens is not None and j >= keep:
        j -= state.released_tokens // P
        if j < keep:
            return None
    return state.page_indices[j]


def write(alloc, rid, label, upto, vals):
    """What an engine's forward pass does: write the KV of computed..upto-1 into the request's own pages."""
    state, pool = alloc.get_state(rid, label), alloc.cache(label).pool
    for t in range(state.computed_tokens, upto):
        page = page_of(state, t)
        assert pool.counts[page] == 1, "a request writes only into pages it owns alone"
        pool.data[page, :, t % P] = vals[t]
    return alloc.mark_computed(rid, label, upto)


def held(alloc, rid, label):
    """The KV bytes of every computed position the request holds, position by position."""
    state, data = alloc.get_state(rid, label), alloc.cache(label).pool.data
    ts = [t for t in range(state.computed_tokens) if page_of(state, t) is not None]
    if not ts:
        return ts, data[:0, :, 0]
    return ts, data[[page_of(state, t) for t in ts], :, [t % P for t in ts]]


def assert_exact(alloc, rid, label, expected):
    ts, got = held(alloc, rid, label)
    want = torch.tensor([expected[t] for t in ts], dtype=got.dtype).reshape(-1, *[1] * (got.dim() - 1))
    assert torch.equal(got, want.expand_as(got)), f"request {rid!r} label {label!r} holds wrong KV"


def snapshot(alloc, rids=()):
    return ([alloc.cache(label).pool.counts.copy().tolist() for label in LABELS],
            [alloc.cache(label).stats().pages_cached for label in LABELS],
            [alloc.get_state(rid, label) for rid in rids for label in alloc.get_labels(rid)])


def serve(alloc, rid, prompts, decode=4, salt=b""):
    """A whole request: add with prompts, allocate, prefill + decode, remove with its outputs."""
    alloc.add_request(rid, LABELS, token_ids=prompts, salt=salt)
    outputs = {}
    for label, prompt in prompts.items():
        total = len(prompt) + decode
        alloc.alloc(rid, label, total)
        write(alloc, rid, label, total, values(label, salt, prompt, total))
        outputs[label] = sequence(prompt, total)[len(prompt):]
    alloc.remove_request(rid, output_ids=outputs)


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
    assert alloc.stats().to_dict() == {"requests": 2, "batches_in_flight": 2, "removals_queued": 2, "requests_offloaded": 0}
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


# ---------------------------------------------------------------------------------------------------- stateful
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1, 2, 0], [2, 2, 1, 1, 0, 0, 2, 2, 1, 1], [1] * 10]
PROMPTS = st.builds(lambda stem, cut, tail: stem[:cut] + tail or [0], st.sampled_from(STEMS), st.integers(0, 10),
                    st.lists(st.integers(0, 2), max_size=4))
PAGES, HOST_PAGES = {"text": 10, "audio": 7}, 3


class EngineMachine(RuleBasedStateMachine):
    """An engine over two labels: requests come and go, in batches or not, offloaded, reloaded and windowed, while
    another thread of control clears an index now and then."""

    def __init__(self):
        super().__init__()
        self.alloc = make(PAGES["text"], PAGES["audio"], evict=2)
        self.host = hosts(self.alloc, HOST_PAGES)
        self.reqs: dict[int, dict] = {}
        self.batches: dict[int, list[int]] = {}
        self.next_id = 0

    # ---- model helpers
    def expected(self, rid, label, upto):
        r = self.reqs[rid]
        return values(label, r["salt"], r["prompts"].get(label), upto, rid=rid)

    def admitted(self, rid):
        r = self.reqs[rid]
        return [label for label in LABELS if label in r["prompts"] or label in r["allocated"]]

    def held_by_live(self, label):
        return {p for rid in self.reqs for p in self.alloc.get_state(rid, label).page_indices}

    def in_batch(self, rid):
        return any(rid in rids for rids in self.batches.values())

    def pick(self, data, ok=lambda r: True):
        rids = sorted(rid for rid, r in self.reqs.items() if ok(r))
        return data.draw(st.sampled_from(rids)) if rids else None

    # ---- rules
    @precondition(lambda self: len(self.reqs) < 4)
    @rule(text=PROMPTS, audio=st.none() | PROMPTS, salt=st.sampled_from([b"", b"tenant"]),
          windowed=st.sampled_from([False, False, True]))
    def add(self, text, audio, salt, windowed):
        rid, self.next_id = self.next_id, self.next_id + 1
        prompts = {"text": text} if audio is None else {"text": text, "audio": audio}
        states = self.alloc.add_request(rid, LABELS, token_ids=prompts, salt=salt)
        self.reqs[rid] = {"prompts": prompts, "salt": salt, "offloaded": False, "removing": False,
                          "allocated": {}, "windowed": windowed}
        for label, state in states.items():
            assert state.matched_tokens <= max(0, (len(prompts.get(label, [0])) - 1)) // P * P

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(text=PROMPTS, audio=PROMPTS, decode=st.integers(0, 6))
    def serve(self, text, audio, decode):
        """A whole request in one step, so that the indexes fill and later requests hit and evict."""
        rid = self.next_id
        self.add(text, audio, b"", False)
        outputs = {}
        for label, prompt in self.reqs[rid]["prompts"].items():
            total = len(prompt) + decode
            try:
                self.alloc.alloc(rid, label, total)
            except AllocationFailed:
                self.alloc.abort_request(rid)
                del self.reqs[rid]
                return
            write(self.alloc, rid, label, total, self.expected(rid, label, total))
            outputs[label] = sequence(prompt, total)[len(prompt):]
        self.alloc.remove_request(rid, output_ids=outputs)
        del self.reqs[rid]

    @rule(data=st.data(), label=st.sampled_from(LABELS), extra=st.integers(0, 10),
          fill=st.sampled_from([False, False, False, True]))
    def alloc_pages(self, data, label, extra, fill):
        """Grow by ``extra`` tokens, or (``fill``) to exactly every page no live request holds: that must succeed."""
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None:
            return
        before, held = self.alloc.get_state(rid, label), self.held_by_live(label)
        spanned = before.position_id_start // P + len(before.page_indices) + before.released_tokens // P
        total = (spanned + PAGES[label] - len(held)) * P if fill else before.seq_len + extra
        try:
            self.alloc.alloc(rid, label, total)
        except AllocationFailed as err:
            assert (err.request_id, err.label) == (rid, label) and err.pages_short > 0
            assert -(-total // P) - spanned > PAGES[label] - len(held), "refused because of cached data"
            assert self.alloc.get_state(rid, label) == before
            return
        self.reqs[rid]["allocated"][label] = True

    @rule(data=st.data(), label=st.sampled_from(LABELS), k=st.integers(1, 9))
    def write_kv(self, data, label, k):
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None or label not in self.admitted(rid):
            return
        state = self.alloc.get_state(rid, label)
        upto = min(state.seq_len, state.computed_tokens + k)
        write(self.alloc, rid, label, upto, self.expected(rid, label, upto))

    @rule(data=st.data(), abort=st.booleans())
    def remove(self, data, abort):
        rid = self.pick(data)
        if rid is None:
            return
        r = self.reqs[rid]
        if r["removing"]:
            with pytest.raises(InvalidRequest):
                self.alloc.remove_request(rid)
            return
        outputs = {}
        for label, prompt in r["prompts"].items():
            upto = self.alloc.get_state(rid, label).seq_len
            outputs[label] = sequence(prompt, upto)[len(prompt):]
        before = snapshot(self.alloc, [rid])
        now = self.alloc.abort_request(rid) if abort else self.alloc.remove_request(rid, output_ids=outputs)
        assert now == (not self.in_batch(rid))
        if now:
            del self.reqs[rid]
        else:
            assert snapshot(self.alloc, [rid]) == before, "a queued removal changed pages"
            r["removing"] = True

    @rule(data=st.data())
    def begin(self, data):
        rids = sorted(rid for rid, r in self.reqs.items() if not r["offloaded"] and not r["removing"])
        if not rids:
            return
        chosen = data.draw(st.lists(st.sampled_from(rids), min_size=1, unique=True))
        self.batches[self.alloc.begin_batch(chosen)] = chosen

    @precondition(lambda self: self.batches)
    @rule(data=st.data())
    def complete(self, data):
        batch_id = data.draw(st.sampled_from(sorted(self.batches)))
        rids = self.batches.pop(batch_id)
        due = [rid for rid in rids if self.reqs[rid]["removing"] and not self.in_batch(rid)]
        assert self.alloc.complete_batch(batch_id) == due
        for rid in due:
            del self.reqs[rid]

    @rule(data=st.data())
    def offload(self, data):
        rid = self.pick(data, lambda r: not r["offloaded"])
        if rid is None:
            return
        labels = self.admitted(rid)
        states = {label: self.alloc.get_state(rid, label) for label in labels}
        windowed = any(s.protected_tokens is not None for s in states.values())
        before = snapshot(self.alloc, [rid])
        if windowed or self.in_batch(rid):
            with pytest.raises(InvalidRequest):
                self.alloc.offload_request(rid, self.host)
            assert snapshot(self.alloc, [rid]) == before
            return
        counts = {label: self.alloc.cache(label).pool.counts.copy() for label in labels}
        try:
            freed = self.alloc.offload_request(rid, self.host)
        except AllocationFailed as err:                                  # the host pool is full
            assert self.host[err.label].num_free < (counts[err.label][list(states[err.label].page_indices)]
                                                    == 1).sum()
            assert snapshot(self.alloc, [rid]) == before
            return
        own = 0
        for label, state in states.items():
            pool, pages = self.alloc.cache(label).pool, list(state.page_indices)
            shared = [p for p in pages if counts[label][p] > 1]
            assert (pool.counts[shared] == counts[label][shared] - 1).all(), "shared pages stay resident"
            own += len(pages) - len(shared)
        assert freed == own
        self.reqs[rid]["offloaded"] = True

    @precondition(lambda self: any(r["offloaded"] for r in self.reqs.values()))
    @rule(data=st.data())
    def reload(self, data):
        rid = self.pick(data, lambda r: r["offloaded"])
        if rid is None:
            return
        records = self.alloc._requests[rid].offloaded
        need = {label: off.first_page + off.pages for label, off in records.items()}
        try:
            back = self.alloc.reload_request(rid, self.host)
        except AllocationFailed as err:
            assert need[err.label] > PAGES[err.label] - len(self.held_by_live(err.label))
            assert self.alloc.is_offloaded(rid)
            return
        for label, got in back.items():
            assert got.restored_pages + got.discarded_pages == records[label].pages
        self.reqs[rid]["offloaded"] = False

    @rule(data=st.data(), label=st.sampled_from(LABELS), release=st.integers(0, 3))
    def slide_window(self, data, label, release):
        rid = self.pick(data, lambda r: r["windowed"] and not r["offloaded"])
        if rid is None or label not in self.admitted(rid):
            return
        protect = data.draw(st.integers(0, self.alloc.get_state(rid, label).seq_len))
        try:
            self.alloc.protect_prefix(rid, label, protect)
            self.alloc.release_oldest(rid, label, release)
        except InvalidRequest:
            pass

    @rule(label=st.sampled_from(LABELS))
    def clear_index(self, label):
        self.alloc.cache(label).clear()

    # ---- invariants
    @invariant()
    def owner_counts_equal_holders(self):
        for label in LABELS:
            cache = self.alloc.cache(label)
            holders = np.zeros(PAGES[label], dtype=np.int32)
            for rid in self.reqs:
                np.add.at(holders, list(self.alloc.get_state(rid, label).page_indices), 1)
            holders += cache.index.indexed
            assert (cache.pool.counts == holders).all()
            assert sorted(cache.pool._free) == np.flatnonzero(cache.pool.counts == 0).tolist()
        for label, host in self.host.items():
            offloaded = sum(len(e.offloaded[label].host_pages) for e in self.alloc._requests.values()
                            if e.offloaded and label in e.offloaded)
            assert host.num_pages - host.num_free == offloaded

    @invariant()
    def every_held_position_holds_its_own_kv(self):
        for rid, r in self.reqs.items():
            if r["offloaded"]:
                continue
            for label in self.admitted(rid):
                upto = self.alloc.get_state(rid, label).computed_tokens
                assert_exact(self.alloc, rid, label, self.expected(rid, label, upto))

    def teardown(self):
        for batch_id in list(self.batches):
            self.alloc.complete_batch(batch_id)
        for rid in list(self.alloc._requests):
            self.alloc.remove_request(rid)
        assert len(self.alloc) == 0
        for label in LABELS:
            self.alloc.cache(label).clear()
            assert self.alloc.cache(label).pool.num_free == PAGES[label], "pages leaked"
            assert self.host[label].num_free == HOST_PAGES, "host pages leaked"


TestEngineAllocatorStateful = EngineMachine.TestCase
