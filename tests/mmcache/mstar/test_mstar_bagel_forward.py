"""M*'s real BAGEL LLM forward (``LLMSubmodule`` over the mixture-of-transformers ``BagelForCausalLM``, weights through
M*'s own loader) under M*'s real ``Engine`` on CPU, reuse on (``mmcache.mstar.bagel.bagel_reuse``) and off, on the same
schedule (``workloads/peers/mstar_bagel.py``). Only flashinfer's and triton's kernels are torch stand-ins.

- every parameter is loaded from the file (the generation experts' fused ones too);
- an image chat, text -> image (ViT) -> text -> decode: a request repeating the first one's text and image reuses
  through the image and the text after it, one sending another image behind the same text reuses only the text
  before it; every walk's logits and the tokens are ``torch.equal`` to reuse off, and the position counter after
  each walk is the cold run's (an image's rows share one position, so a text walk after it does not start at the
  token count);
- a text walk after an image retried after ``AllocationFailed`` computes the cold positions and logits;
- a second turn re-sending the image and the answer is held through the answer's indexed pages;
- batched text, ViT and decode steps (``forward_batched``) with a cut request beside an uncut one;
- a guided request (``requires_cfg``, an image edit's VAE -> ViT -> text, in think mode after a text walk) whose VAE
  rows repeat an earlier one's: its VAE walk (the generation experts, routed row by row by ``text_mask``) and its
  ViT walk are cut inside, its guided text walks are computed in full (they write ``cfg_img`` from the same rows),
  and all three labels' KV bytes and counters and the logits equal reuse off;
- the image walk's name: the walk kind, its rows or (ViT only) the carried digest; text and latents name nothing;
- a request removed after a hit on its last walk leaves nothing in the seam;
- why ids alone do not do for BAGEL: a plain ``PrefixReuse`` cuts a guided text walk and leaves ``cfg_text`` and
  ``cfg_img`` wrong.
"""

import pytest
import torch

from mstar_helpers import require_mstar

require_mstar()
from workloads.peers import mstar_bagel as b  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
P = 4  # page size


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return b.save_checkpoint(tmp_path_factory.mktemp("bagel-llm"))


def reuse():
    from mmcache.mstar import bagel_reuse

    return bagel_reuse("bagel-tiny@test")


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, b.BOI, (n,), generator=torch.Generator().manual_seed(seed))


def image(n: int, seed: int) -> torch.Tensor:
    """What an encoder node hands the LLM for one image: ``n`` rows in LLM space (bf16, as M* serves)."""
    return torch.randn(n, b.LLM_CFG["hidden_size"], generator=torch.Generator().manual_seed(seed)).bfloat16()


def serve(be, sampled, rid: str, request, new: int = 2, keep: bool = False, **metadata):
    """One request: its prefill walks (``(walk, rows)`` in order), ``new`` decode steps, removed unless ``keep``.
    Returns per step (walk, token, logits, rows computed, the main counter after it)."""
    be.engine.add_request(rid, b.greedy())
    out, token = [], None
    for graph_walk, x in request:
        got = b.walk(be, graph_walk, {rid: x}, sampled, **metadata).get(rid)
        token = got[0] if got else token
        out.append((graph_walk, *(got or (None, None)), be.fed[rid], be.rope.position(rid, b.LABEL)))
    for _ in range(new):
        got = b.walk(be, "decode", {rid: torch.tensor([token])}, sampled, **metadata)[rid]
        token = got[0]
        out.append(("decode", *got, be.fed[rid], be.rope.position(rid, b.LABEL)))
    if not keep:
        be.engine.remove_request(rid)
    return out


def same(got, want) -> bool:
    """Equal walks, tokens, logits (``torch.equal``) and counters; rows computed may differ (the cut)."""
    return len(got) == len(want) and all(
        g[0] == w[0] and g[1] == w[1] and g[4] == w[4]
        and ((g[2] is None and w[2] is None) or torch.equal(g[2], w[2])) for g, w in zip(got, want))


def fed(out) -> list[int]:
    return [step[3] for step in out if step[0] != "decode"]


def test_every_weight_is_loaded_from_the_checkpoint(repo, sampled):
    """M*'s loader (``_load_into`` with ``LLAMA_STACKED_PARAMS``: q/k/v and gate/up fused, the generation experts'
    ``*_moe_gen`` ones too) filled every parameter of the node from the file, none left as ``to_empty``'s memory."""
    from safetensors.torch import load_file

    from workloads.peers.mstar_checkpoint import hub_parts

    saved, sub = load_file(str(repo / "ema.safetensors")), b.bagel_engine(repo).sub
    params = dict(sub.named_parameters())
    assert len(params) == 49  # 2 MoT layers of 18, embeddings, 2 final norms, the head, the image-gen projections
    assert sum(1 for n in params if "_moe_gen" in n) == 2 * 9 + 1  # half of each layer, and norm_moe_gen
    for name, param in params.items():
        want = torch.cat([saved[n] for n in hub_parts(name)])
        assert torch.equal(param.detach(), want.to(param.dtype)), name


def test_an_image_chat_is_reused_through_the_same_image_and_up_to_another(repo, sampled):
    on, off = b.bagel_engine(repo, reuse=reuse()), b.bagel_engine(repo)
    system, question = ids(18, seed=1), ids(7, seed=2)
    first = [(b.TEXT_WALK, system), (b.VIT_WALK, image(10, seed=3)), (b.TEXT_WALK, question)]
    other = [first[0], (b.VIT_WALK, image(10, seed=4)), first[2]]
    for rid, request in (("a", first), ("b", first), ("c", other)):
        got, want = serve(on, sampled, rid, request), serve(off, sampled, rid, request)
        assert same(got, want), rid
        assert fed(want) == [18, 12, 7]  # the image walk: <|vision_start|>, 10 rows, <|vision_end|>
        # one position for the image's 12 rows: the counter reads 18, 19, 26, then one a decode step
        assert [s[4] for s in want] == [18, 19, 26, 27, 28]
        if rid == "b":
            # a walk is never cut to fewer than 2 rows: 4 of the text's 5 pages, then the image's 12 rows (stream
            # positions 18-29) but the 2 on page 7, then the question (30-36) from inside page 7: its page 8 would
            # leave 1 row, so 2 of its ids are held
            assert fed(got) == [18 - 4 * P, 2, 5]
    assert fed(got) == [18 - 4 * P, 12, 7]  # c: the text's 4 full pages; nothing at or after the other image
    s = on.kv.stats(b.LABEL)
    assert s.hits == 2 and s.hit_tokens == (16 + 10 + 2) + 16


def test_a_text_walk_after_an_image_retried_after_allocation_failed_computes_the_cold_positions(repo, sampled):
    on, off = b.bagel_engine(repo, reuse=reuse(), pages=16), b.bagel_engine(repo, pages=16)
    # the image walk ends on a page's end (stream positions 14-23), so b's question (24-32) holds a cached page
    # and its last 5 ids need 2 new pages
    request = [(b.TEXT_WALK, ids(14, seed=5)), (b.VIT_WALK, image(8, seed=6)), (b.TEXT_WALK, ids(9, seed=7))]
    serve(on, sampled, "a", request, new=0, keep=True)  # a stays live: its pages are indexed and held
    want = serve(off, sampled, "b", request, new=1)
    on.engine.add_request("b", b.greedy())
    got = []
    for graph_walk, x in request[:2]:
        token, logits = b.walk(on, graph_walk, {"b": x}, sampled)["b"]
        got.append((graph_walk, token, logits, on.fed["b"], on.rope.position("b", b.LABEL)))
    on.engine.add_request("hog", b.greedy())  # holds every free page
    b.walk(on, b.TEXT_WALK, {"hog": ids(P * on.kv.pool.num_free, seed=8)}, sampled)
    assert on.kv.pool.num_free == 0
    with pytest.raises(RuntimeError, match="AllocationFailed"):
        b.walk(on, b.TEXT_WALK, {"b": request[2][1]}, sampled)  # the question's last rows need a page
    on.engine.remove_request("hog")
    token, logits = b.walk(on, b.TEXT_WALK, {"b": request[2][1]}, sampled)["b"]
    got.append((b.TEXT_WALK, token, logits, on.fed["b"], on.rope.position("b", b.LABEL)))
    token, logits = b.walk(on, "decode", {"b": torch.tensor([token])}, sampled)["b"]
    got.append(("decode", token, logits, on.fed["b"], on.rope.position("b", b.LABEL)))
    assert same(got, want) and fed(got) == [2, 4, 5] and [s[4] for s in got] == [14, 15, 24, 25]


def test_a_second_turn_re_sending_the_image_and_the_answer_reuses_through_the_answer(repo, sampled):
    """A multi-turn image chat: turn 2 re-sends turn 1's system text, image, question and generated answer, then asks
    again. The answer's pages were indexed as turn 1 decoded them, so turn 2's last text walk is held through them."""
    on, off = b.bagel_engine(repo, reuse=reuse()), b.bagel_engine(repo)
    system, picture, question = ids(10, seed=20), image(7, seed=21), ids(6, seed=22)
    turn1 = [(b.TEXT_WALK, system), (b.VIT_WALK, picture), (b.TEXT_WALK, question)]
    answer = [step[1] for step in serve(on, sampled, "t1", turn1, new=8)][2:-1]  # what turn 1's decode fed
    assert answer == [step[1] for step in serve(off, sampled, "t1", turn1, new=8)][2:-1]
    follow_up = torch.cat((question, torch.tensor(answer), ids(5, seed=23)))
    turn2 = [turn1[0], turn1[1], (b.TEXT_WALK, follow_up)]
    got, want = serve(on, sampled, "t2", turn2), serve(off, sampled, "t2", turn2)
    assert same(got, want)
    # the stream: system 0-9, image 10-18, then question, answer and the new ask at 19-37. Turn 1 wrote through 32
    # (its last sampled token was never fed), so its pages 4-7 (through 31, the answer's 7th id) were indexed:
    # 13 of the 19 ids held, 6 fed
    assert fed(want) == [10, 9, 19] and fed(got) == [2, 3, 6]


def test_batched_walks_with_a_cut_and_an_uncut_request_equal_reuse_off(repo, sampled):
    """Two requests in each step take M*'s ``forward_batched`` (text, ViT, decode): one repeating an earlier request
    (cut, its counter moved past held rows) beside one computed in full, bit for bit as reuse off on the same
    batches."""
    on, off = b.bagel_engine(repo, reuse=reuse()), b.bagel_engine(repo)
    system, picture, question = ids(13, seed=24), image(8, seed=25), ids(6, seed=26)
    schedule = [(b.TEXT_WALK, {"b": system, "c": ids(9, seed=27)}),
                (b.VIT_WALK, {"b": picture, "c": image(5, seed=28)}),
                (b.TEXT_WALK, {"b": question, "c": ids(4, seed=29)})]
    for be in (on, off):
        serve(be, sampled, "a", [(b.TEXT_WALK, system), (b.VIT_WALK, picture), (b.TEXT_WALK, question)], new=0)
        for rid in "bc":
            be.engine.add_request(rid, b.greedy())
    got, want = [], []
    for graph_walk, feeds in schedule:
        for be, out in ((on, got), (off, want)):
            out.append((b.walk(be, graph_walk, feeds, sampled), dict(be.fed),
                        {rid: be.rope.position(rid, b.LABEL) for rid in "bc"}))
    for _ in range(2):
        tokens = {rid: torch.tensor([got[-1][0][rid][0]]) for rid in "bc"}
        for be, out in ((on, got), (off, want)):
            out.append((b.walk(be, "decode", tokens, sampled), dict(be.fed),
                        {rid: be.rope.position(rid, b.LABEL) for rid in "bc"}))
    for (g, _, gp), (w, _, wp) in zip(got, want, strict=True):
        assert gp == wp and g.keys() == w.keys()
        for rid in g:
            assert g[rid][0] == w[rid][0] and torch.equal(g[rid][1], w[rid][1]), rid
    # b: 2 of the text's 3 full pages (a walk keeps 2 rows), the image (13-22) through page 4, the question (23-28)
    # through page 5, which it shares with the image's last rows; c computes everything
    assert [step[1]["b"] for step in got[:3]] == [13 - 2 * P, 3, 5] and [step[1]["c"] for step in got[:3]] == [9, 7, 4]


def test_a_request_removed_after_a_hit_on_its_last_walk_leaves_nothing_in_the_seam(repo, sampled):
    """A hit on a request's last walk (here its only one: a prompt answered by the prefill's token, no decode) keeps
    where that walk started for a retry; M*'s ``remove_request`` (``cleanup_request`` on every submodule) drops it."""
    on = b.bagel_engine(repo, reuse=reuse())
    prompt = [(b.TEXT_WALK, ids(13, seed=30))]
    serve(on, sampled, "a", prompt, new=0)
    serve(on, sampled, "b", prompt, new=0, keep=True)
    seam = on.sub.cleanup_request.__self__  # the node's NodeSeam
    assert on.fed["b"] == 5 and seam.requests["b"].walk_start is not None
    on.engine.remove_request("b")
    assert "b" not in seam.requests


def stream_kv(be, rid: str, label: str) -> torch.Tensor:
    """The KV bytes (``rid``, ``label``)'s stream holds, every layer, in position order."""
    stream = be.kv._streams[rid][label]
    tensor = be.kv.kv_cache.tensor  # [layers, pages, 2, page_size, heads, head_dim]
    held = tensor[:, stream.page_indices].transpose(1, 2).flatten(2, 3)
    return held[:, :, :stream.stored_len]


@pytest.mark.parametrize("think", [False, True], ids=["edit", "think-mode edit"])
def test_a_guided_edit_repeating_the_vae_rows_cuts_its_image_walks_and_keeps_every_branch_exact(repo, sampled, think):
    """An image edit's schedule, VAE -> ViT -> text (think mode: a text walk before them, which a guided request
    computes in full and the VAE walk's match continues after)."""
    on, off = b.bagel_engine(repo, reuse=reuse()), b.bagel_engine(repo)
    latent, picture = image(9, seed=9), image(6, seed=10)
    request = [(b.VAE_WALK, latent), (b.VIT_WALK, picture), (b.TEXT_WALK, ids(6, seed=11))]
    if think:
        request.insert(0, (b.TEXT_WALK, ids(9, seed=31)))
    serve(on, sampled, "a", request, new=0, requires_cfg=True)
    got = serve(on, sampled, "b", request, new=0, keep=True, requires_cfg=True)
    want = serve(off, sampled, "b", request, new=0, keep=True, requires_cfg=True)
    assert same(got, want)
    if think:  # the text 0-8; the VAE walk (9-19) from inside page 2 through page 3; the ViT walk (20-27) page 5
        assert fed(want) == [9, 11, 8, 6] and fed(got) == [9, 4, 4, 6]
    else:  # the VAE walk (0-10) holds its 2 full pages, cut inside the image with the expert mask; the ViT walk
        assert fed(want) == [11, 8, 6] and fed(got) == [3, 3, 6]  # (11-18) from inside page 2 through page 3
    # the guided text walks are not cut: they write cfg_img too
    for label in ("main", "cfg_text", "cfg_img"):
        assert torch.equal(stream_kv(on, "b", label), stream_kv(off, "b", label)), label
    assert [on.rope.position("b", label) for label in ("main", "cfg_text", "cfg_img")] == \
        [off.rope.position("b", label) for label in ("main", "cfg_text", "cfg_img")]


def test_ids_alone_would_cut_a_guided_text_walk_and_leave_its_branches_wrong(repo, sampled):
    """Why BAGEL needs ``bagel_reuse`` even for its text: with a plain ``PrefixReuse`` (every walk of ids named and
    cut) a guided text-to-image request repeating a prompt has its text walk cut for ``main``, but the step writes
    ``cfg_img`` from the same cut rows (5 of its 13 ids), and the fork onto ``cfg_text`` before the step copies
    ``main``'s hit (8 ids where a cold run has none). ``writes_guidance_branch`` keeps that walk whole."""
    from mmcache.mstar import PrefixReuse

    prompt = [(b.TEXT_WALK, ids(13, seed=32))]
    off = b.bagel_engine(repo)
    serve(off, sampled, "b", prompt, new=0, keep=True, requires_cfg=True)
    for knob, want in ((PrefixReuse(model="bagel-tiny@test"), False), (reuse(), True)):
        on = b.bagel_engine(repo, reuse=knob)
        serve(on, sampled, "a", prompt, new=0, requires_cfg=True)
        serve(on, sampled, "b", prompt, new=0, keep=True, requires_cfg=True)
        lengths = [(on.kv.stored("b", label), off.kv._streams["b"][label].stored_len)
                   for label in ("cfg_text", "cfg_img")]
        assert (lengths == [(0, 0), (13, 13)]) is want, lengths
        if want:
            assert on.fed["b"] == 13 and torch.equal(stream_kv(on, "b", "cfg_img"), stream_kv(off, "b", "cfg_img"))
        else:
            assert on.fed["b"] == 5 and lengths == [(8, 0), (5, 13)]


def test_an_image_walk_is_named_by_its_kind_and_rows_or_a_carried_digest():
    from mstar.model.submodule_base import ARNodeInputs

    from mmcache.mstar.bagel import cut_image_walk, image_walk_media

    rows = image(6, seed=12)
    fed_rows = ARNodeInputs(input_seq_len=6, input_embeds=rows)
    vit, vae = image_walk_media(b.VIT_WALK, None, {}, fed_rows), image_walk_media(b.VAE_WALK, None, {}, fed_rows)
    assert vit[0][0] == 0 and vit != vae  # the experts differ: the same rows name two items
    assert vit == image_walk_media(b.VIT_WALK, None, {}, ARNodeInputs(input_seq_len=6, input_embeds=rows.clone()))
    assert vit != image_walk_media(b.VIT_WALK, None, {}, ARNodeInputs(input_seq_len=6, input_embeds=image(6, 13)))
    carried = {"image_digest": [torch.arange(16, dtype=torch.uint8)]}
    assert image_walk_media(b.VIT_WALK, None, carried, fed_rows) not in (vit, None)
    assert image_walk_media(b.VAE_WALK, None, carried, fed_rows) == vae  # a VAE latent is a sample: its rows name it
    assert image_walk_media(b.TEXT_WALK, None, {}, fed_rows) is None
    assert image_walk_media("image_gen", None, {}, fed_rows) is None
    mask = torch.tensor([True, False, False, False, False, True])
    walk = ARNodeInputs(input_seq_len=6, input_embeds=rows, custom_pos_ids={"main": torch.full((6,), 9)},
                        tensor_inputs={"text_mask": mask, "text_indexes": torch.tensor([0, 5]),
                                       "vae_token_indexes": torch.arange(1, 5)})
    cut_image_walk(walk, 4)
    assert walk.input_seq_len == 2 and torch.equal(walk.input_embeds, rows[4:])
    assert torch.equal(walk.custom_pos_ids["main"], torch.full((2,), 9))
    assert walk.tensor_inputs["text_mask"].tolist() == [False, True]
    assert walk.tensor_inputs["text_indexes"].tolist() == [1]
    assert walk.tensor_inputs["vae_token_indexes"].tolist() == [0]
