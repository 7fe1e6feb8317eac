"""A decode walk costs no Python per request in the seam (``mmcache.mstar.switch``): once a walk's batch was all
one-id feeds of named streams, its batches run the node's own ``prepare_inputs`` and ``declare_step`` feeds the ids
from the inputs. What must hold whatever the batches hold: reuse on keeps reuse off's logits, a batch that breaks the
pattern is never cut and sends the walk back through the seam, and a stream first fed on a plain walk (whose salt the
seam does not see there) is never named, so no other tenant can match its pages."""

import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from mmcache.mstar import PrefixReuse  # noqa: E402
from mstar_toy_ar import ids_feed, node, serve, step, weights  # noqa: E402

REUSE, W = PrefixReuse(model="toy@plain"), weights()


def prefill_and_decode(n, prompts: dict[str, list[int]], steps: int) -> dict[str, list[int]]:
    """Prefill ``prompts`` in one batch, then ``steps`` greedy decode batches of them all; the fed ids per request."""
    for rid in prompts:
        n.runner.ingest_request(rid)
    _, got = step(n, "prefill", {rid: ids_feed(p) for rid, p in prompts.items()})
    fed = {rid: [] for rid in prompts}
    for _ in range(steps):
        for rid in fed:
            fed[rid].append(int(got[rid].argmax()))
        _, got = step(n, "decode", {rid: ids_feed(fed[rid][-1:]) for rid in fed})
    return fed


def test_a_decode_walk_goes_to_the_node_s_own_prepare_inputs_after_its_first_batch():
    n = node(W, pages=64, reuse=REUSE)
    seam = n.sub.prepare_inputs
    prefill_and_decode(n, {"a": list(range(10, 17)), "b": list(range(30, 35))}, steps=1)
    calls = []
    n.sub.prepare_inputs = lambda **kw: (calls.append(kw["fwd_info"].request_id), seam(**kw))[1]  # counts the seam
    _, _ = step(n, "decode", {"a": ids_feed([3]), "b": ids_feed([4])})
    # the first request reached the seam, which stepped aside: the second went to the node's own method
    assert calls == ["a"]
    # declare_step put the seam back for the next batch (the counting wrapper is gone with it)
    assert n.sub.prepare_inputs is seam


def test_plain_decode_indexes_generated_pages_and_keeps_reuse_off_s_logits():
    on, off = node(W, pages=64, reuse=REUSE), node(W, pages=64)
    prompts = {"a": list(range(10, 17)), "b": list(range(30, 35))}
    fed_on, fed_off = prefill_and_decode(on, prompts, 9), prefill_and_decode(off, prompts, 9)
    assert fed_on == fed_off
    probe = prompts["a"] + fed_on["a"][:8] + [1, 2]             # 15 ids a wrote, then two more
    out, logits = serve(on, "c", probe, 2)
    assert on.kv.stats("main").hit_tokens == 12                   # three pages, the last two named on the plain walk
    want = serve(off, "c", probe, 2)
    assert out == want[0] and all_equal(logits, want[1])


def test_a_batch_that_breaks_the_pattern_is_not_cut_and_the_walk_goes_through_the_seam_again():
    on, off = node(W, pages=64, reuse=REUSE), node(W, pages=64)
    prompts = {"a": list(range(10, 17)), "b": list(range(30, 35))}
    for n in (on, off):
        prefill_and_decode(n, prompts, 2)
    # the same walk, one request fed three ids (its seam stepped aside: nothing of it is cut, its naming stops)
    feeds = {"a": ids_feed([5, 6, 7]), "b": ids_feed([8])}
    got_on, got_off = step(on, "decode", feeds)[1], step(off, "decode", feeds)[1]
    assert all(torch.equal(got_on[r], got_off[r]) for r in feeds)
    calls = []
    seam = on.sub.prepare_inputs
    on.sub.prepare_inputs = lambda **kw: (calls.append(kw["fwd_info"].request_id), seam(**kw))[1]
    got_on, got_off = (step(n, "decode", {"a": ids_feed([1]), "b": ids_feed([2])})[1] for n in (on, off))
    assert calls == ["a", "b"]                                    # not plain any more: both through the seam
    assert all(torch.equal(got_on[r], got_off[r]) for r in ("a", "b"))
    assert not on.kv._mm.named["main"]["a"].covered               # a's write no feed named: nothing of it indexed


def test_a_stream_first_fed_on_a_plain_walk_is_never_named():
    """A salted request whose first step on the node is a one-id step of a plain walk: the seam does not see its
    forward pass there (nor its salt), so the stream stays unnamed: nothing it writes is indexed, under any salt."""
    n = node(W, pages=64, reuse=REUSE)
    prefill_and_decode(n, {"a": list(range(10, 17))}, 1)          # "decode" is plain now
    n.runner.ingest_request("s")
    for token in (40, 41, 42, 43, 44):                            # a whole page of one-id steps, salted request
        step(n, "decode", {"a": ids_feed([1]), "s": ids_feed([token])}, salt=b"tenant-s")
    assert "s" not in n.kv._mm.named["main"]
    cached = n.kv.stats("main").pages_cached
    n.runner.remove_request("s")
    assert n.kv.stats("main").pages_cached == cached              # nothing of s indexed when it leaves
    n.runner.ingest_request("t")                                  # an unsalted request with s's ids matches nothing
    assert n.kv.feed("t", "main", torch.tensor([40, 41, 42, 43, 44, 45])) == 0
