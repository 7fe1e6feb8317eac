"""M*'s real Qwen3-Omni thinker (``ThinkerSubmodule`` over ``Qwen3OmniThinkerModel``, weights through M*'s own
loader) under M*'s real ``Engine`` on CPU, reuse on (``mmcache.mstar.qwen3_omni.qwen3_omni_reuse``) and off, on the
same schedule of prefill walks (text, image or audio, text) then decode (``workloads/peers/mstar_qwen3_omni.py``).
Only flashinfer's paged attention and the sampler are torch stand-ins; the thinker's MRoPE is M*'s own torch.

- fp32, every walk's hidden states and logits are transformers' ``Qwen3OmniMoeThinkerTextModel`` on the same weights
  fed the same rows at the positions M* laid out (text one per row, an image on its grid, deepstack on the first
  layers): the stand-ins and M*'s thinker agree end to end;
- bf16, a second request sending the first's text, image and the text after it reuses the pages through all three
  walks (each cut, its ids, embeddings, positions, masks and deepstack rows together), and every row it computes,
  every logit and token, and the MRoPE counter after every walk are ``torch.equal`` to reuse off; a request with
  another image behind the same text shares only the text before it;
- the positions the cut walks compute are the cold run's, and a walk retried after ``AllocationFailed`` computes
  them again from the counter its walk started at;
- audio: the same audio item is reused through its walk, other audio is not;
- a request asking for audio output streams every row to the talker: nothing of it is cut, and its pages serve a
  later text-only request;
- batches of several requests (M*'s ``forward_batched``), cut and uncut side by side, equal reuse off;
- a media walk's name: the carried digest, else everything it is fed (rows, deepstack rows), and its grid;
- a next turn re-sending the generated reply as text reuses it (the decode walk is named by the token it embeds).
"""

import dataclasses

import pytest
import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar_qwen3_omni_helpers import edges_equal, fed, ids, image, rows, same, serve, spoken_same, system_turn  # noqa: E402
from workloads.peers import mstar_qwen3_omni as q  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
P = 4  # page size


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return q.save_weights(tmp_path_factory.mktemp("qwen3-omni-thinker"))


def test_the_thinker_is_transformers_qwen3_omni_on_the_same_weights(weights, sampled):
    te = q.thinker_engine(weights, dtype=torch.float32)
    pre, sound, picture, post = ids(10, 1), rows(5, 2, torch.float32), image(3, dtype=torch.float32), ids(5, 4)
    steps = serve(te, sampled, "a", [(q.TEXT, pre), (q.AUDIO, sound), (q.VISION, picture), (q.TEXT, post)], new=1)
    positions = torch.cat([s[4] for s in steps], dim=1).long()
    # M*'s layout: text and audio one position per row (the audio wrapped in its sentinels), the image's 2x4 merged
    # grid at (t, h, w) = (18, 18 + row, 18 + col) after its start sentinel at 17, its end sentinel one past the grid
    assert positions[:, :18].tolist() == [list(range(18))] * 3
    assert positions[:, 18:26].tolist() == [[18] * 8, [18] * 4 + [19] * 4, [18, 19, 20, 21] * 2]
    assert positions[:, 26:].tolist() == [list(range(22, 29))] * 3
    assert [s[5] for s in steps] == [10, 17, 23, 28, 29]  # the vision walk advanced 6 for its 10 rows
    text, head = q.dense_reference(weights)
    embed = text.embed_tokens
    with torch.no_grad():
        sentinel = {name: embed(torch.tensor([i])) for name, i in q.SPECIAL.items()}
        fed_rows = torch.cat([embed(pre), sentinel["audio_start_token_id"], sound, sentinel["audio_end_token_id"],
                              sentinel["vision_start_token_id"], picture[0], sentinel["vision_end_token_id"],
                              embed(post), embed(torch.tensor([steps[-2][0]]))])
        visual = torch.zeros(fed_rows.shape[0], dtype=torch.bool)
        visual[18:26] = True
        want = text(inputs_embeds=fed_rows[None], position_ids=positions[:, None, :], visual_pos_masks=visual[None],
                    deepstack_visual_embeds=picture[1]).last_hidden_state[0]
        torch.testing.assert_close(torch.cat([s[2] for s in steps]), want, atol=1e-5, rtol=1e-5)
        for s, at in ((steps[-2], 31), (steps[-1], 32)):  # the last prefill row, the decode row
            torch.testing.assert_close(s[1], head(want[at]), atol=1e-5, rtol=1e-5)


def test_the_same_text_and_image_are_reused_through_every_walk_bit_exactly(weights, sampled):
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    system, post = ids(14, 5), ids(10, 6)
    first = [(q.TEXT, system), (q.VISION, image(7)), (q.TEXT, post)]
    other_image = [(q.TEXT, system), (q.VISION, image(8)), (q.TEXT, post)]
    runs = {}
    for name, request in (("a", first), ("b", first), ("c", other_image)):
        runs[name] = serve(on, sampled, name, request), serve(off, sampled, name, request)
        assert same(*runs[name]), name
    assert fed(runs["a"][0]) == [14, 10, 10]
    # b: 3 of the text's 4 pages (page 4 holds its last ids and the image's first rows); the image walk from
    # inside that page through position 19 (a cut inside the item: its rows sit on its grid); the text after it
    # but its last page (a prefill is never cut to one row)
    assert fed(runs["b"][0]) == [2, 4, 2]
    # c: another image behind the same text: only the text before it
    assert fed(runs["c"][0]) == [2, 10, 10]
    s = on.kv.stats(q.LABEL)
    assert s.hits == 2 and s.hit_tokens == (12 + 6 + 8) + 12  # the rows not fed: b's 26 of 34, c's 12


def test_positions_after_a_hit_are_a_cold_runs(weights, sampled):
    """The MRoPE counter after every walk, and the 3D positions of every row a cut walk still computes, are those of
    a cold run of the same request (``same`` checks both); here the hit ends inside the image, whose positions are
    its grid's (not its row count), and the text after it continues from the grid's end."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    request = [(q.TEXT, ids(16, 9)), (q.VISION, image(10, grid=(1, 8, 4))), (q.TEXT, ids(3, 11))]
    serve(on, sampled, "a", request, new=1)
    got, want = serve(on, sampled, "b", request, new=1), serve(off, sampled, "b", request, new=1)
    assert same(got, want)
    # the image's 4x2 merged grid advances the counter 6 (its sentinels and max(4, 2)) for its 10 rows
    assert fed(got) == [16 - 3 * P, 10 - 8, 3] and [s[5] for s in got] == [16, 22, 25, 26]


def test_a_walk_retried_after_allocation_failed_computes_the_cold_positions(weights, sampled):
    """The seam moves the MRoPE counter past held rows at the walk's commit (``PrefixReuse.position_advance``), not
    before it: a walk whose admit fails (no page for it) and is retried reads the counter its walk started at, and
    computes the positions a cold run computes."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse(), pages=12), q.thinker_engine(weights, pages=12)
    request = [(q.TEXT, ids(14, 12)), (q.VISION, image(13)), (q.TEXT, ids(4, 14))]
    on.engine.add_request("a", q.greedy())  # a stays live: its 7 pages are indexed and held, none evictable
    for i, (graph_walk, x) in enumerate(request):
        q.walk(on, graph_walk, {"a": x}, sampled, last_prefill=i == len(request) - 1)
    want = serve(off, sampled, "b", request, new=0)
    on.engine.add_request("hog", q.greedy())  # holds every free page
    q.walk(on, q.TEXT, {"hog": ids(P * on.kv.pool.num_free, 15)}, sampled, last_prefill=True)
    assert on.kv.pool.num_free == 0
    on.engine.add_request("b", q.greedy())
    with pytest.raises(RuntimeError, match="AllocationFailed"):
        q.walk(on, q.TEXT, {"b": request[0][1]}, sampled)  # 3 pages held, none for its last 2 ids
    on.engine.remove_request("hog")
    got = []
    for i, (graph_walk, x) in enumerate(request):
        out = q.walk(on, graph_walk, {"b": x}, sampled, last_prefill=i == len(request) - 1)["b"]
        got.append((*out, int(on.fed["b"].input_seq_len), on.fed["b"].custom_pos_ids, on.pos.position("b", q.LABEL),
                    graph_walk))
    assert same(got, want) and fed(got) == [2, 4, 4]


def test_the_same_audio_is_reused_through_its_walk_and_other_audio_is_not(weights, sampled):
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    prompt, post = ids(12, 16), ids(6, 17)
    for name, sound in (("a", rows(9, 18)), ("b", rows(9, 18)), ("c", rows(9, 19))):
        request = [(q.TEXT, prompt), (q.AUDIO, sound), (q.TEXT, post)]
        got, want = serve(on, sampled, name, request), serve(off, sampled, name, request)
        assert same(got, want), name
        if name == "b":  # 2 of the text's 3 pages (a prefill is never cut to one row), 2 pages of audio rows, the
            assert fed(got) == [4, 3, 5]  # page of the audio's last rows and the text's first
    assert fed(got) == [12 - 2 * P, 11, 6]  # c: the text's 2 full pages, nothing from its audio on
    assert on.kv.stats(q.LABEL).hit_tokens == (8 + 8 + 1) + 8  # the rows not fed: b's 17 of 29, c's 8


def test_a_request_asking_for_audio_output_is_cut_and_its_talker_gets_every_rows_states(weights, sampled):
    """The walks of a request asking for audio output are cut like a text-only one's (the thinker's states of the
    rows its pages hold are kept beside them, ``thinker_row_outputs``), and the talker is handed exactly what reuse
    off hands it on every walk: every row's states and the whole walk's mask before M*'s postprocess, the rows it
    selects after; a later request with another image shares the text before it only, its talker edge exact too."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    request = [(q.TEXT, system_turn(13, 20)), (q.VISION, image(21)), (q.TEXT, ids(5, 22))]
    other = [request[0], (q.VISION, image(40)), request[2]]
    for name, walks in (("a", request), ("b", request), ("c", other)):
        got, want = serve(on, sampled, name, walks, audio_output=True), serve(off, sampled, name, walks,
                                                                               audio_output=True)
        assert spoken_same(got, want), name
        assert all(s[7] is not None and s[8][0].shape[0] == s[8][1].shape[1] for s in got[:3])
        assert [s[8][0].shape[0] for s in got[:3]] == [13, 10, 5]  # every row of every walk, cut or not
        if name == "b":
            assert fed(got) == [5, 3, 4]
    assert fed(got) == [5, 10, 5]  # c: the text's 2 full pages (its last page holds the image's first rows)
    assert not got[0][7][1].all()  # the system turn's rows are not sent on: the mask mattered
    assert on.kv.stats(q.LABEL).hits == 2


def test_pages_a_text_only_request_wrote_serve_a_spoken_one_and_back(weights, sampled):
    """Every thinker forward's states are kept, audio output asked or not: a text-only request's pages serve a
    spoken request exactly, and a spoken request's pages a text-only one."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    request = [(q.TEXT, system_turn(14, 41)), (q.AUDIO, rows(7, 42)), (q.TEXT, ids(6, 43))]
    for name, spoken in (("a", False), ("b", True), ("c", False)):
        got, want = (serve(te, sampled, name, request, audio_output=spoken) for te in (on, off))
        assert spoken_same(got, want), name
        assert (got[0][7] is not None) == spoken
        if name != "a":
            assert fed(got) == [14 - 3 * P, 9 - 6, 6 - 1]  # the last: one page, never cut to one row


def test_a_page_whose_states_were_not_kept_serves_text_only_requests_only(weights, sampled):
    """A request whose forwards no hook saw (a replayed CUDA graph runs none; here the recorder is switched off for
    it) leaves its pages' states unkept: a spoken request matching them is cut only before the first such page,
    with the talker's edge exact, while a text-only one is served them all. The pages it took had held a spoken
    request's states before (evicted, taken fresh): those stale rows are never served."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse(), pages=9), q.thinker_engine(weights, pages=9)
    spoken = [(q.TEXT, ids(13, 44)), (q.TEXT, ids(9, 45))]
    serve(on, sampled, "a", spoken, audio_output=True, new=0)
    a_pages = set(on.kv.lifecycle(q.LABEL).index._pages.values())
    on.kv._rows_to_write = lambda step: None  # b's steps commit as if no watched forward had run
    unwatched = [(q.TEXT, ids(14, 46)), (q.TEXT, ids(10, 47))]
    on.engine.add_request("b", q.greedy())
    for i, (graph_walk, x) in enumerate(unwatched):
        q.walk(on, graph_walk, {"b": x}, sampled, last_prefill=i == 1)
    b_pages = on.kv._streams["b"][q.LABEL].page_indices[:6]  # its 6 full pages: a's evicted, their ids taken
    on.engine.remove_request("b")
    del on.kv._rows_to_write
    assert set(a_pages) & set(b_pages) and not on.kv.side.valid[b_pages].any()
    for name, walks, talk in (("c", unwatched, False), ("d", unwatched, True)):
        got, want = (serve(te, sampled, name, walks, audio_output=talk, new=0) for te in (on, off))
        assert spoken_same(got, want), name
        assert fed(got) == ([14, 10] if talk else [14 - 3 * P, 10 - 6])


def test_the_talker_prefills_the_same_from_a_cut_request_as_from_reuse_off(weights, sampled):
    """M*'s talker node (``workloads/peers/mstar_qwen3_omni_talker.py``) run on the edges a cut spoken request's
    walks send it computes, walk by walk, the hidden states and K/V it computes from reuse off's."""
    from workloads.peers import mstar_qwen3_omni_talker as t

    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    request = [(q.TEXT, system_turn(13, 50)), (q.VISION, image(51)), (q.TEXT, ids(5, 52))]
    serve(on, sampled, "a", request, audio_output=True, new=0)
    got, want = (serve(te, sampled, "b", request, audio_output=True, new=0) for te in (on, off))
    assert fed(got) == [5, 3, 4] and spoken_same(got, want)
    talkers = t.talker_engine(weights), t.talker_engine(weights)
    for te in talkers:
        te.engine.add_request("b", t.configs())
    for g, w in zip(got, want, strict=True):
        assert torch.equal(t.prefill(talkers[0], "b", g[7]), t.prefill(talkers[1], "b", w[7]))
    assert torch.equal(t.kv_rows(talkers[0], "b"), t.kv_rows(talkers[1], "b"))
    assert t.kv_rows(talkers[0], "b").shape[2] == sum(w[7][0].shape[0] for w in want)


def test_row_outputs_refuse_a_lower_tier(weights, sampled):
    """A page copied up from a host tier or a shared store carries no row outputs: asking for both is refused when
    the KV resource is built."""
    from mmcache.errors import InvalidRequest

    reuse = dataclasses.replace(q.thinker_reuse(), tiers=lambda fingerprint, pool: None)
    with pytest.raises(InvalidRequest, match="tiers or row_outputs"):
        q.thinker_engine(weights, reuse=reuse)


def test_without_row_outputs_a_spoken_request_is_computed_in_full_and_tiers_are_allowed(weights, sampled):
    """``qwen3_omni_reuse`` without a hidden size keeps no states: a request asking for audio output is computed in
    full (``streams_rows_to_talker`` as ``needs_every_row``), its talker edge exact, its pages indexed for a
    text-only request; and a lower tier may be given."""
    from mmcache.mstar.qwen3_omni import qwen3_omni_reuse

    reuse = qwen3_omni_reuse("qwen3-omni-tiny@test")
    assert reuse.row_outputs is None
    on, off = q.thinker_engine(weights, reuse=reuse), q.thinker_engine(weights)
    request = [(q.TEXT, system_turn(13, 50)), (q.VISION, image(51)), (q.TEXT, ids(5, 52))]
    for name, spoken in (("a", True), ("b", True), ("c", False)):
        got, want = (serve(te, sampled, name, request, audio_output=spoken) for te in (on, off))
        assert spoken_same(got, want), name
        if name == "b":
            assert fed(got) == [13, 10, 5]  # a spoken request: every walk computed in full
    assert fed(got) == [5, 3, 4]            # a text-only one reuses what the spoken ones indexed
    tiered = dataclasses.replace(reuse, tiers=lambda fingerprint, pool: None)
    q.thinker_engine(weights, reuse=tiered)  # built: no row outputs, nothing a tier would lack


@pytest.mark.parametrize("spoken", [False, True], ids=["text-only", "audio-output"])
def test_batched_walks_with_cut_and_uncut_requests_equal_reuse_off(weights, sampled, spoken):
    """Several requests in one step take M*'s ``forward_batched`` (packed rows, ``select_last_hidden``, and the
    talker's states packed as ``__batched_thinker_states__``, sliced by each request's fed rows in
    ``unpack_packed_outputs``): a request cut to its suffix beside one computed in full, then decode together, bit
    for bit as reuse off on the same batches, the talker's edges too when audio output is asked (the vision walk is
    one request per step, as M* asserts)."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    system, picture, sound = ids(14, 23), image(24), rows(6, 25)
    schedule = [(q.TEXT, {"b": system, "c": ids(9, 26)}), (q.VISION, {"b": picture}), (q.AUDIO, {"c": sound}),
                (q.TEXT, {"b": ids(5, 27), "c": ids(3, 28)})]
    for te in (on, off):
        serve(te, sampled, "a", [(q.TEXT, system), (q.VISION, picture), (q.TEXT, ids(4, 29))], new=0,
              audio_output=spoken)
        for rid in "bc":
            te.engine.add_request(rid, q.greedy())
    got, want = [], []
    for i, (graph_walk, feeds) in enumerate(schedule):
        for te, out in ((on, got), (off, want)):
            out.append((q.walk(te, graph_walk, feeds, sampled, last_prefill=i == len(schedule) - 1,
                               audio_output=spoken),
                        {rid: int(x.input_seq_len) for rid, x in te.fed.items()}, dict(te.talker), dict(te.raw)))
    tokens = {rid: got[-1][0][rid][0] for rid in "bc"}
    for _ in range(2):
        for te, out in ((on, got), (off, want)):
            out.append((q.walk(te, q.DECODE, {rid: torch.tensor([t]) for rid, t in tokens.items()}, sampled,
                               audio_output=spoken), {}, dict(te.talker), dict(te.raw)))
        tokens = {rid: got[-1][0][rid][0] for rid in "bc"}
    for (g, _, g_talker, g_raw), (w, n, w_talker, w_raw) in zip(got, want, strict=True):
        assert g_talker.keys() == w_talker.keys() == (g.keys() if spoken else set()) and g_raw.keys() == w_raw.keys()
        assert all(edges_equal(g_talker[r], w_talker[r]) and edges_equal(g_raw[r], w_raw[r]) for r in g_talker)
        for rid, (token, logits, hidden) in g.items():
            assert token == w[rid][0] and (logits is None) == (w[rid][1] is None)
            assert logits is None or torch.equal(logits, w[rid][1])
            assert torch.equal(hidden, w[rid][2][w[rid][2].shape[0] - hidden.shape[0]:])
    assert [fed for _, fed, *_ in got[:4]] == [{"b": 2, "c": 9}, {"b": 4}, {"c": 8}, {"b": 5, "c": 3}]


def test_a_media_walk_is_named_by_the_carried_digest_or_everything_it_is_fed():
    """``thinker_walk_media``: a carried ``<modality>_digest`` among the walk's inputs names the item; without one, the
    digest of its rows and, for vision, its deepstack rows; a vision item's name also commits to its grid (which sets
    its positions); a text or decode walk is not described by media."""
    from mstar.model.submodule_base import ARNodeInputs

    from mmcache.mstar.qwen3_omni import thinker_walk_media as media

    picture = image(30)
    fed = ARNodeInputs(input_seq_len=10, input_embeds=picture[0], tensor_inputs={"deepstack": picture[1]})
    carried = torch.arange(16, dtype=torch.uint8)
    grid = {"image_grid_thw": [picture[2]]}
    assert media(q.AUDIO, None, {"audio_digest": [carried]}, fed) == [(0, bytes(range(16)))]
    named = media(q.VISION, None, grid, fed)
    other_grid = media(q.VISION, None, {"image_grid_thw": [torch.tensor([[1, 8, 4]])]}, fed)
    other_deepstack = ARNodeInputs(input_seq_len=10, input_embeds=picture[0],
                                   tensor_inputs={"deepstack": [picture[1][0], rows(8, 31)]})
    assert named == media(q.VISION, None, grid, fed) and len(named[0][1]) == 16
    assert named != other_grid and named != media(q.VISION, None, grid, other_deepstack)
    assert media(q.VISION, None, {**grid, "image_digest": [carried]}, fed) != named
    # a video walk (seconds per grid step given) is named by the video's carried digest, never an image's
    video = {**grid, "video_second_per_grid": [torch.tensor([2.0])], "image_digest": [carried]}
    assert media(q.VISION, None, video, fed) == media(q.VISION, None, {**video, "image_digest": []}, fed)
    assert media(q.VISION, None, {**video, "video_digest": [carried]}, fed) != media(q.VISION, None, video, fed)
    assert media(q.TEXT, None, {}, fed) is None and media(q.DECODE, None, {}, fed) is None


@pytest.mark.parametrize("spoken", [False, True], ids=["text-only", "audio-output"])
def test_a_next_turn_reuses_the_tokens_the_thinker_generated(weights, sampled, spoken):
    """``thinker_decode`` embeds the sampled token without feeding its id; named by the id it reads
    (``PrefixReuse.walk_ids``), its pages are indexed as they fill, so a next turn whose prompt re-sends the reply as
    text reuses it: 4 pages of 10 prompt ids and 8 generated ones, where the prompt alone would give 2. Asking for
    audio output, the decode rows' states were kept too (every thinker forward's are), and the talker's edges equal
    reuse off's."""
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse()), q.thinker_engine(weights)
    prompt = ids(10, 32)
    first = serve(on, sampled, "a", [(q.TEXT, prompt)], new=8, audio_output=spoken)
    assert spoken_same(first, serve(off, sampled, "a", [(q.TEXT, prompt)], new=8, audio_output=spoken))
    reply = torch.tensor([s[0] for s in first[:8]])  # the tokens fed back by the 8 decode steps
    turn = [(q.TEXT, torch.cat((prompt, reply, ids(6, 33))))]
    got, want = serve(on, sampled, "b", turn, audio_output=spoken), serve(off, sampled, "b", turn,
                                                                           audio_output=spoken)
    assert spoken_same(got, want) and fed(got) == [24 - 4 * P]


def test_a_continued_walk_retried_after_allocation_failed_is_cut_as_before(weights, sampled, monkeypatch):
    """A later walk's continued match takes cached pages in ``prepare_inputs``, before the admit; when the admit then
    fails (no page for the rows left), M*'s worker feeds the same walk again: the stream still holds those pages, so
    the same rows are cut (``ReuseKVManager.feed``), none looked up again from the wrong position, its rows are not
    hashed again (the marks the seam gave the walk stand), and everything equals a cold run."""
    from mmcache.mstar import qwen3_omni

    hashed = []
    monkeypatch.setattr(qwen3_omni, "rows_digest", lambda x, digest=qwen3_omni.rows_digest: hashed.append(1) or
                        digest(x))
    on, off = q.thinker_engine(weights, reuse=q.thinker_reuse(), pages=12), q.thinker_engine(weights, pages=12)
    request = [(q.TEXT, ids(12, 34)), (q.AUDIO, rows(7, 35)), (q.TEXT, ids(4, 36))]  # the audio walk: 9 rows
    on.engine.add_request("a", q.greedy())  # a stays live: its pages are indexed and held, none evictable
    for i, (graph_walk, x) in enumerate(request):
        q.walk(on, graph_walk, {"a": x}, sampled, last_prefill=i == len(request) - 1)
    want = serve(off, sampled, "b", request, new=0)
    on.engine.add_request("b", q.greedy())
    got = [(*q.walk(on, q.TEXT, {"b": request[0][1]}, sampled)["b"], int(on.fed["b"].input_seq_len),
            on.fed["b"].custom_pos_ids, on.pos.position("b", q.LABEL), q.TEXT)]
    on.engine.add_request("hog", q.greedy())
    q.walk(on, q.TEXT, {"hog": ids(P * on.kv.pool.num_free, 37)}, sampled, last_prefill=True)
    hashed.clear()
    with pytest.raises(RuntimeError, match="AllocationFailed"):
        q.walk(on, q.AUDIO, {"b": request[1][1]}, sampled)  # 1 cached page found, 2 pages for its 5 rows left
    on.engine.remove_request("hog")
    for i, (graph_walk, x) in enumerate(request[1:]):
        out = q.walk(on, graph_walk, {"b": x}, sampled, last_prefill=i == 1)["b"]
        got.append((*out, int(on.fed["b"].input_seq_len), on.fed["b"].custom_pos_ids, on.pos.position("b", q.LABEL),
                    graph_walk))
    assert same(got, want) and fed(got) == [4, 5, 4] and len(hashed) == 1  # the audio walk's rows, once
