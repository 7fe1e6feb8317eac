"""mmcache's KV resource inside M* 0.2.1 (``ReuseKVManager`` from a ``ReuseKVSpec``), built by M*'s
``build_resource`` and driven by M*'s ``StepRunner`` with M*'s ``RopeManager``, a tiny AR node whose only stand-in is
attention (``tests/mstar_toy_ar.py``, checked against a dense reference here). Reuse on vs off on the same schedule:
logits torch.equal. The ways the old seam served wrong KV are regression tests: a prompt fed in several walks, the
retry after an allocation failure, and the retry of a chunk whose match was continued."""


import numpy as np
import pytest
import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from mmcache import EncoderKey, EncoderStore  # noqa: E402
from mmcache.errors import InvalidRequest  # noqa: E402
from mstar_toy_ar import (  # noqa: E402
    KV,
    LABEL,
    KVStep,
    P,
    PendingCopy,
    PrefixReuse,
    Segment,
    StepContext,
    SubmoduleStep,
    dense_logits,
    ids_as_from_a_device,
    ids_feed,
    node,
    serve,
    step,
    weights,
)

W = weights()
REUSE = PrefixReuse(model="toy@0")



def test_the_attention_stand_in_is_dense_attention():
    prompt = list(range(3, 16))
    out, logits = serve(node(W), "a", prompt, 4)
    ref = dense_logits(W, prompt + out)
    assert all(torch.allclose(lg, ref[len(prompt) - 1 + i], rtol=0, atol=1e-12) for i, lg in enumerate(logits))


def test_reuse_on_equals_reuse_off_across_turns_and_generated_pages_are_reused():
    on, off = node(W, reuse=REUSE), node(W)
    turn1 = list(range(1, 14))
    a_on, a_off = serve(on, "a", turn1, 5), serve(off, "a", turn1, 5)
    assert a_on[0] == a_off[0] and all_equal(a_on[1], a_off[1])
    turn2 = turn1 + a_on[0] + [7, 8, 9]                        # the history with the reply, then a new question
    b_on, b_off = serve(on, "b", turn2, 4), serve(off, "b", turn2, 4)
    assert b_on[0] == b_off[0] and all_equal(b_on[1], b_off[1])
    s = on.kv.stats(LABEL)
    assert s.hit_tokens == 16 and s.hits == 1                   # 13 prompt + 3 generated tokens: 4 whole pages
    assert on.kv.pool.num_free + s.pages_cached + 1 == on.kv.pool.num_pages  # + M*'s sink page


def test_a_second_request_shares_pages_the_first_committed_while_it_still_runs():
    on = node(W, reuse=REUSE)
    system = list(range(20, 33))
    on.runner.ingest_request("a")
    step(on, "prefill", {"a": ids_feed(system + [1])})         # a is prefilled, not finished
    out, logits = serve(on, "b", system + [2], 3)
    assert on.kv.stats(LABEL).hit_tokens == 12                  # a's three full pages, while a is live
    want = serve(node(W), "b", system + [2], 3)
    assert out == want[0] and all_equal(logits, want[1])
    on.runner.remove_request("a")


def kv_step(n, rids, span: int) -> None:
    """One step of the KV resource alone (admit, plan, commit; no forward), as M*'s ``StepRunner`` runs it."""
    s = SubmoduleStep(segments=[Segment(rid, LABEL, span) for rid in rids], steps={KV: KVStep()})
    s.set_ctx(StepContext(request_ids=rids, graph_walk="decode", slot=0, capture=False))
    assert n.runner.admit(s).ok
    n.runner.plan(s)
    n.runner.commit(s)


@pytest.mark.parametrize("by_step", [False, True], ids=["feed", "feed_rows"])
def test_pages_that_fill_in_one_step_are_named_together_and_a_bad_id_stops_only_its_own_stream(by_step):
    """Decode ids fed one request at a time (``feed``) or a step at once (``feed_rows``, each request's id a view of
    the step's sampled tokens, as M*'s nodes return them: joined into ints when fed; a step whose ids one call does
    not join into integer ids keeps them as fed)."""
    on = node(W, reuse=REUSE)
    kv, prompts = on.kv, {"a": list(range(100, 100 + P)), "b": list(range(200, 200 + P))}
    for rid, prompt in prompts.items():
        on.runner.ingest_request(rid)
        assert kv.feed(rid, LABEL, torch.tensor(prompt)) == 0
    kv_step(on, ["a", "b"], P)
    fed = {"a": [], "b": []}
    for t in range(P):  # both streams fill their second page in the same step: one join of both streams' ids
        sampled = torch.tensor([7 + t, 7 + t])
        rows = {rid: sampled[i:i + 1] for i, rid in enumerate(fed)}
        if t == 1:
            rows["b"] = torch.tensor([7.5])                     # no token id
        for rid in fed:
            fed[rid].append(7 + t)
        if by_step:
            assert kv.feed_rows(LABEL, rows) == []
        else:
            for rid, tok in rows.items():
                kv.feed(rid, LABEL, tok)
        kv_step(on, ["a", "b"], 1)
    assert kv.stats(LABEL).pages_cached == 3                    # a's two pages and b's prompt page
    for rid, want in (("a", 2 * P), ("b", P)):                  # a later request with the same ids matches that much
        on.runner.ingest_request(rid + "2")
        assert kv.feed(rid + "2", LABEL, torch.tensor(prompts[rid] + fed[rid] + [1, 2])) == want
    for rid in ("a", "b", "a2", "b2"):
        on.runner.remove_request(rid)


def test_decode_ids_copied_from_the_device_index_their_pages_when_the_copy_lands():
    """Ids on a CUDA device reach the host through a copy that the GPU thread does not wait for
    (``kv_resource.ids_to_host``; stood in on the CPU by a copy that lands when the test says): the pages that filled
    are indexed at the first commit after it landed, not before; a request that leaves before its copy lands indexes
    nothing of it and holds no page. Reuse on keeps reuse off's logits."""
    copies: list[PendingCopy] = []
    on, prompts = node(W, reuse=REUSE), {"a": list(range(100, 100 + P)), "b": list(range(60, 60 + P))}
    with ids_as_from_a_device(copies):
        kv, fed = on.kv, {"a": [], "b": []}
        for rid, prompt in prompts.items():
            on.runner.ingest_request(rid)
        _, got = step(on, "prefill", {rid: ids_feed(prompt) for rid, prompt in prompts.items()})
        assert kv.stats(LABEL).pages_cached == 2                # the prompt pages: indexed at once (ids on the host)
        for _ in range(P):                                      # both fill their second page in the last step
            for rid in fed:
                fed[rid].append(int(got[rid].argmax()))
            _, got = step(on, "decode", {rid: ids_feed(fed[rid][-1:]) for rid in fed})
        # reading the index indexes what decode steps filled (they wait a few steps' worth otherwise): the copy of
        # their ids starts then, and has not landed
        assert kv.stats(LABEL).pages_cached == 2 and len(copies) == 1
        on.runner.remove_request("b")                           # b leaves first: nothing of its copy is indexed
        copies[0].done = True
        step(on, "decode", {"a": ids_feed([int(got["a"].argmax())])})   # the next commit indexes a's page
        assert kv.stats(LABEL).pages_cached == 3
        on.runner.remove_request("a")
        assert kv.pool.num_free + kv.stats(LABEL).pages_cached + 1 == kv.pool.num_pages  # + M*'s sink page
        probe = prompts["a"] + fed["a"] + [3, 4]
        out, logits = serve(on, "c", probe, 2)
        assert kv.stats(LABEL).hit_tokens == 2 * P               # a's prompt page and the page its copy brought
    want = serve(node(W), "c", probe, 2)
    assert out == want[0] and all_equal(logits, want[1])


def test_a_walk_the_names_do_not_cover_is_never_indexed():
    """Text, then an embeddings walk (media), then text: the pages the embeddings walk wrote hold KV no ids describe.
    A later request whose ids equal the first walk's plus what the seam was told must not match past the first walk
    (the old seam matched 12 tokens here and served logits 0.61 off)."""
    on = node(W, reuse=REUSE)
    text = list(range(40, 48))                                  # two full pages of text
    on.runner.ingest_request("mm")
    step(on, "prefill", {"mm": ids_feed(text)})
    embeds = torch.randn(6, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    step(on, "embed", {"mm": {"embeds": embeds}})
    step(on, "prefill", {"mm": ids_feed([5, 6, 7, 8, 9, 10])})
    on.runner.remove_request("mm")
    assert on.kv.stats(LABEL).pages_cached == 2                 # the text pages; none from the embeddings walk on
    probe = text + [5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 11]
    out, logits = serve(on, "probe", probe, 2)
    assert on.kv.stats(LABEL).hit_tokens == 8
    want = serve(node(W), "probe", probe, 2)
    assert out == want[0] and all_equal(logits, want[1])


def test_the_retry_after_an_allocation_failure_feeds_only_what_is_not_held():
    on = node(W, pages=8, reuse=REUSE)
    prompt = list(range(1, 14))
    serve(on, "a", prompt, 0)                                   # 3 pages cached
    on.runner.ingest_request("hog")
    step(on, "prefill", {"hog": ids_feed(list(range(100, 112)))})  # 3 pages live: 1 free, 3 cached, 1 sink
    on.runner.ingest_request("b")
    outcome, _ = step(on, "prefill", {"b": ids_feed(prompt + [50] * 8)})   # needs 3 more pages than it matched
    assert not outcome.ok and type(outcome.reason).__name__ == "AllocationFailed"
    stream = on.kv._streams["b"][LABEL]
    assert stream.stored_len == 12                              # the match stays; nothing was written
    on.runner.remove_request("hog")
    outcome, got = step(on, "prefill", {"b": ids_feed(prompt + [50] * 8)})  # M*'s worker retries the step
    assert outcome.ok and stream.stored_len == 21               # not 12 + 21: the held prefix was not fed again
    want = serve(node(W), "b", prompt + [50] * 8, 0)
    assert torch.equal(got["b"], want[1][0])
    on.runner.remove_request("b")                               # the retried prompt was named as it was written:
    before = on.kv.stats(LABEL).hit_tokens                      # its pages after the matched ones are indexed too
    serve(on, "c", prompt + [50] * 8, 0)
    assert on.kv.stats(LABEL).hit_tokens - before == 4 * P


def test_cached_pages_are_evicted_before_allocation_fails_and_encoder_outputs_share_the_pool():
    on = node(W, pages=8, reuse=REUSE)
    store = EncoderStore(pool=on.kv.pool, page_data=on.kv.kv_cache.tensor, page_dim=1)
    key = EncoderKey(b"\x01" * 16, "vit", "image")
    assert store.put(key, torch.arange(64, dtype=torch.float64))   # 512 bytes = 1 KV page of this node
    serve(on, "a", list(range(1, 14)), 0)                       # 3 KV pages cached, 1 encoder page, 1 sink
    out, logits = serve(on, "big", list(range(60, 84)), 1)      # needs 7 pages: evicts every cached page
    s = on.kv.stats(LABEL)
    assert s.evicted_pages == 3 and key not in store
    want = serve(node(W), "big", list(range(60, 84)), 1)
    assert out == want[0] and all_equal(logits, want[1])


def test_reset_without_free_never_rewrites_a_shared_page():
    on = node(W, reuse=REUSE)
    prompt = list(range(1, 14))
    serve(on, "a", prompt, 0)
    on.runner.ingest_request("b")
    step(on, "prefill", {"b": ids_feed(prompt + [9])})
    shared = list(on.kv._streams["b"][LABEL].page_indices[:3])
    before = on.kv.kv_cache.tensor[:, shared].clone()
    on.kv.reset_request("b", free=False)                        # M*'s cuda-graph state swap rewinds the stream
    assert on.kv._streams["b"][LABEL].page_indices == []        # its shared pages were given up, not kept
    step(on, "prefill", {"b": ids_feed([30] * 13)})
    assert torch.equal(on.kv.kv_cache.tensor[:, shared], before)
    on.runner.remove_request("b")
    out, logits = serve(on, "c", prompt + [9], 1)
    want = serve(node(W), "c", prompt + [9], 1)
    assert out == want[0] and all_equal(logits, want[1])


def test_salts_share_nothing_and_forced_collisions_cost_a_miss():
    on = node(W, reuse=REUSE)
    prompt = list(range(1, 15))
    serve(on, "a", prompt, 0, salt=b"tenant-a")
    serve(on, "b", prompt, 0, salt=b"tenant-b")
    assert on.kv.stats(LABEL).hit_tokens == 0
    serve(on, "c", prompt, 0, salt=b"tenant-a")
    assert on.kv.stats(LABEL).hit_tokens == 12                   # 3 pages of 4, 2 rows left to compute
    life = on.kv.lifecycle(LABEL)
    other = list(range(70, 84))
    claim = life.match(life.name(other, names=life.name(prompt, salt=b"").names))  # other ids, the same names
    assert claim[1].pages == []                                 # nothing verified: a wasted comparison, a miss
    life.release(claim[1].pages)


def test_bad_ids_are_refused_before_any_state_changes():
    on = node(W, reuse=REUSE)
    on.runner.ingest_request("a")
    free = on.kv.pool.num_free
    with pytest.raises(InvalidRequest):
        on.kv.feed("a", LABEL, np.array([1, -2, 3]))
    assert on.kv.pool.num_free == free and not on.kv._mm.named
    assert on.kv.feed("a", "another-label", [1, 2, 3]) == 0     # a label reuse is off for: M* as it ships


def test_offload_and_reload_with_shared_pages():
    from mstar_toy_ar import host_pool

    on, off = node(W, reuse=REUSE), node(W)
    on.kv._cpu_pool = host_pool(on, 16)          # the CPU stand-in for M*'s pinned host pool
    prompt = list(range(1, 14))
    serve(on, "a", prompt, 0)
    on.runner.ingest_request("b")
    off.runner.ingest_request("b")
    second = prompt + [9, 9, 9, 9, 9]
    logits = [step(n, "prefill", {"b": ids_feed(second)})[1]["b"] for n in (on, off)]
    # 5 pages: 3 matched and 1 committed into the index (the index their only other owner), 1 its own alone
    assert on.kv.reclaimable("b") == 5
    free, room = on.kv.pool.num_free, on.kv._arena.num_free
    assert on.kv.offload("b") == 5 and on.kv.pool.num_free == free + 1 and on.kv._arena.num_free == room + 5
    assert on.kv.stats(LABEL).pages_cached == 4                 # the shared pages stayed for the index
    assert on.kv.reload("b")
    out = []
    for _ in range(3):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = [step(n, "decode", {"b": ids_feed([tok])})[1]["b"] for n in (on, off)]
        assert torch.equal(*logits)


def test_a_host_tier_under_m_star_s_kv_tensor():
    """``PrefixReuse(tiers=...)``: pages evicted from M*'s KV tensor go down to a host tier with their verifying ids and
    come back up, verified, for a later request; logits equal reuse off."""
    from mmcache.pool import HostPagePool
    from mmcache.tiers import HostTier, TierStack

    def host(fp, pool):
        return TierStack(fp, host=HostTier(HostPagePool.like(pool, 16), fp.page_size))

    on = node(W, pages=8, reuse=PrefixReuse(model="toy@0", tiers=host, evict_batch_pages=1))
    prompt = list(range(1, 14))
    serve(on, "a", prompt, 0)                                   # 3 pages cached on the device
    serve(on, "big", list(range(60, 84)), 1)                    # 7 pages: a's pages go down to the host tier
    assert on.kv.stats(LABEL).evicted_pages == 3
    out, logits = serve(on, "again", prompt + [9], 2)
    assert on.kv.stats(LABEL).hit_tokens == 12                  # from the host tier
    want = serve(node(W), "again", prompt + [9], 2)
    assert out == want[0] and all_equal(logits, want[1])


def test_a_prompt_prefilled_in_chunks_is_matched_chunk_by_chunk():
    """The match continues at each later feed that starts at a page boundary with everything before it indexed (a
    chunked prefill): the second chunk is matched too, and logits equal reuse off on the same chunk schedule."""
    on, off = node(W, reuse=REUSE), node(W)
    chunks = [list(range(1, 9)), list(range(20, 28)), [5, 6, 7]]

    def run(n, rid):
        n.runner.ingest_request(rid)
        logits = [step(n, "prefill", {rid: ids_feed(c)})[1][rid] for c in chunks]
        n.runner.remove_request(rid)
        return logits

    run(on, "a")
    got, want = run(on, "b"), run(off, "b")
    assert all_equal(got, want)
    assert on.kv.stats(LABEL).hit_tokens == 4 + 4           # each 8-token chunk: its full pages but its last token's


def test_a_continued_chunk_retried_after_an_allocation_failure_is_cut_as_before():
    """A chunk whose continued match took a cached page in ``prepare_inputs`` and whose admit then failed is fed
    again by M*'s worker: the stream still holds that page, so the same ids are cut (not looked up again from past
    it, which fed the chunk's first ids at the wrong positions), and logits equal reuse off on the same chunks."""
    on, off = node(W, pages=9, reuse=REUSE), node(W, pages=9)
    chunks = [list(range(1, 9)), list(range(20, 28)), [5, 6, 7]]
    on.runner.ingest_request("a")                               # a stays live: its 5 pages are held, none evictable
    for c in chunks:
        step(on, "prefill", {"a": ids_feed(c)})
    off.runner.ingest_request("b")
    want = [step(off, "prefill", {"b": ids_feed(c)})[1]["b"] for c in chunks]
    on.runner.ingest_request("b")
    got = [step(on, "prefill", {"b": ids_feed(chunks[0])})[1]["b"]]  # 1 page shared, 1 taken: 2 free
    on.runner.ingest_request("hog")
    step(on, "prefill", {"hog": ids_feed(range(30, 38))})      # the last 2 free pages
    outcome, _ = step(on, "prefill", {"b": ids_feed(chunks[1])})  # a's page for ids 8-11 found, none for 12-15
    assert not outcome.ok and type(outcome.reason).__name__ == "AllocationFailed"
    on.runner.remove_request("hog")
    for c in chunks[1:]:
        outcome, out = step(on, "prefill", {"b": ids_feed(c)})
        assert outcome.ok
        got.append(out["b"])
    assert all_equal(got, want) and on.kv._streams["b"][LABEL].stored_len == 19


def _media_walk_reuse():
    """A reuse whose model describes an embeddings walk by the digest its inputs carry (as a data worker's digest of
    the bytes it read travels with the request)."""
    return PrefixReuse(model="toy@0", walk_media=lambda walk, info, inputs, out: (
        [(0, inputs["digest"])] if "digest" in inputs else None))


def _media_request(n, rid, digest: bytes):
    """Text, an embeddings walk whose rows are a function of ``digest`` (the media item), then text."""
    seed = int.from_bytes(digest[:4], "little")
    embeds = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n.runner.ingest_request(rid)
    logits = [step(n, "prefill", {rid: ids_feed(range(40, 48))})[1][rid],
              step(n, "embed", {rid: {"embeds": embeds, "digest": digest}})[1][rid],
              step(n, "prefill", {rid: ids_feed([5, 6, 7, 8, 9, 10])})[1][rid]]
    n.runner.remove_request(rid)
    return logits


def test_an_embeddings_walk_named_by_its_media_digest_is_reused_and_another_item_never():
    on, off = node(W, reuse=_media_walk_reuse()), node(W)
    d1, d2 = b"\x01" * 16, b"\x02" * 16
    _media_request(on, "a", d1)
    hit = on.kv.stats(LABEL).hit_tokens
    assert all_equal(_media_request(on, "b", d1), _media_request(off, "b", d1))
    assert on.kv.stats(LABEL).hit_tokens - hit == 4 + 4 + 4   # text page, media page, text page after it
    hit = on.kv.stats(LABEL).hit_tokens
    assert all_equal(_media_request(on, "c", d2), _media_request(off, "c", d2))
    assert on.kv.stats(LABEL).hit_tokens - hit == 4           # only the text before the other item


def test_a_media_walk_retried_after_an_allocation_failure_is_named_once():
    """A media walk's step refused (``AllocationFailed``) and fed again by M*'s worker is the walk the seam named:
    ``walk_media`` (which hashes every row where no digest was carried) runs once for both, and the logits are reuse
    off's."""
    named = []

    def media(walk, info, inputs, out):
        named.append(walk)
        return [(0, inputs["digest"])]

    on, off = node(W, pages=8, reuse=PrefixReuse(model="toy@0", walk_media=media)), node(W)
    embeds = torch.randn(6, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    walks = [("prefill", ids_feed(range(40, 48))), ("embed", {"embeds": embeds, "digest": b"\x03" * 16}),
             ("prefill", ids_feed([5, 6, 7, 8, 9, 10]))]
    off.runner.ingest_request("b")
    want = [step(off, walk, {"b": feed})[1]["b"] for walk, feed in walks]
    on.runner.ingest_request("b")
    got = [step(on, walks[0][0], {"b": walks[0][1]})[1]["b"]]
    on.runner.ingest_request("hog")
    step(on, "prefill", {"hog": ids_feed(range(100, 100 + P * on.kv.pool.num_free))})  # every free page
    outcome, _ = step(on, "embed", {"b": walks[1][1]})          # its 6 rows need 2 pages
    assert not outcome.ok and type(outcome.reason).__name__ == "AllocationFailed"
    assert named == ["embed"] and on.kv.marks_taken("b", LABEL)
    on.runner.remove_request("hog")
    for walk, feed in walks[1:]:
        outcome, out = step(on, walk, {"b": feed})
        assert outcome.ok
        got.append(out["b"])
    assert named == ["embed"] and not on.kv.marks_taken("b", LABEL)
    assert all_equal(got, want)


def test_kv_events_from_m_stars_resource_name_every_indexed_page():
    class Heard:  # an IndexObserver that keeps what a router would
        def __init__(self):
            self.names = set()

        def stored(self, names, parent, tokens, media, salt, depth):
            self.names.update(names)

        def removed(self, names):
            self.names.difference_update(names)

        def cleared(self):
            self.names.clear()
    heard = Heard()
    on = node(W, reuse=PrefixReuse(model="toy@0", observer=lambda fp, pool: heard))
    serve(on, "a", list(range(1, 14)), 5)
    index = on.kv.lifecycle(LABEL).index
    assert heard.names and heard.names == {int(index.tier_view().name[p]) for p in np.flatnonzero(index.indexed)}


def test_kv_events_put_a_media_walk_s_key_on_every_page_the_item_overlaps():
    """A walk of embeddings named by its media digest: the seam tells the label's KV event observer how many rows the
    item holds (``describe_media``), so vLLM's ``extra_keys`` carry ``[identifier, offset]`` on each page the item
    overlaps, not on its first alone (built by the events' own ``EventBuilder``, as the publisher builds them)."""
    from mmcache.events.builder import EventBuilder
    from mmcache.events.extra_keys import media_identifier

    class Builds(EventBuilder):  # an IndexObserver that builds each event at once
        def __init__(self):
            super().__init__(P)
            self.keys = {}

        def stored(self, names, parent, tokens, media, salt, depth):
            event = super().stored(names, parent, tokens, media, salt, depth)
            self.keys.update(zip(range(depth, depth + len(names)), event.extra_keys or [None] * len(names)))

        def removed(self, names):
            pass

        def cleared(self):
            pass

    built = Builds()
    on = node(W, reuse=PrefixReuse(model="toy@0", walk_media=_media_walk_reuse().walk_media,
                                   observer=lambda fp, pool: built))
    digest = b"\x07" * 16
    _media_request(on, "a", digest)                             # 8 text rows, 8 media rows, 6 text rows
    ident = media_identifier(digest)
    assert [built.keys[d] for d in range(5)] == [None, None, ((ident, 0),), ((ident, -P),), None]
    assert built.spans.unsized == 0


def test_shadow_mode_measures_what_reuse_would_match_and_changes_nothing():
    """Phase 1 on M*: ``PrefixReuse(shadow=True)`` names and looks up every prompt, generated pages included, but M*
    computes everything itself (logits equal to reuse off, nothing cached), and the shadow's matched pages are the
    pages reuse on matches on the same schedule."""
    shadow, on, off = node(W, reuse=PrefixReuse(model="toy@0", shadow=True)), node(W, reuse=REUSE), node(W)
    turn1 = list(range(1, 14))
    runs = {}
    for name, n in (("shadow", shadow), ("on", on), ("off", off)):
        a = serve(n, "a", turn1, 5)
        turn2 = turn1 + a[0] + [7, 8, 9]
        runs[name] = (a, serve(n, "b", turn2, 4), serve(n, "c", turn2[:9] + [99, 98], 2),
                      serve(n, "d", turn1, 1))  # 3 pages + 1 id: reuse leaves two rows, so it matches 2 pages
    for a, b in zip(runs["shadow"], runs["off"]):
        assert a[0] == b[0] and all_equal(a[1], b[1])
    assert shadow.kv.lifecycle(LABEL).stats(0, 0).pages_cached == 0 and shadow.kv.stats(LABEL).hit_tokens == 0
    s = shadow.kv.shadow_stats(LABEL)
    assert s.requests == 4 and s.matched_pages * P == on.kv.stats(LABEL).hit_tokens == 16 + 8 + 8


def test_the_resource_adds_at_most_three_attributes_to_what_mstar_sets():
    """M*'s own admit and plan look attributes and methods up on the resource once per request a step: an instance
    with more than about 28 attributes loses CPython's inline attribute values and every such lookup costs a tenth
    more (measured: ``_alloc`` of 256 streams 120 -> 135-139 us). M*'s ``KVManager`` sets 24; ``ReuseKVManager``
    keeps its own state in one object (``_ReuseState``) beside ``reuse`` and ``pool``."""
    ours, theirs = node(W, reuse=REUSE).kv, node(W, reuse=None, seam=False).kv
    assert type(theirs).__name__ == "KVManager"
    assert len(vars(ours)) - len(vars(theirs)) <= 3, sorted(set(vars(ours)) - set(vars(theirs)))
