"""M*'s real Higgs Audio LLM forward (``HiggsAudioLLMSubmodule`` over ``HiggsAudioLLM``, weights through M*'s own
loader) under M*'s real ``Engine`` on CPU, reuse on (``enable_reuse`` with ``PrefixReuse(id_walks=("prefill_text",))``)
and off, on the same schedule: Higgs's three prefill walks (text, audio embeddings, text) then decode
(``workloads/peers/mstar_higgs.py``). Only flashinfer's and triton's kernels are torch stand-ins.

- fp32, the three walks and the decode are transformers' ``Qwen3ForCausalLM`` on the same weights fed the same rows
  (the text embedded, the audio as given): the stand-ins (plain RoPE included) and M*'s model agree end to end;
- bf16, a second request sharing the first's text walk (system and user prompt) gets that walk cut to its uncached
  suffix (``input_ids`` and ``input_embeds`` both, once), and every walk's logits are ``torch.equal`` to reuse off;
- the audio walk is named by nothing without a ``walk_media``: even a request sending the very same audio reuses no
  page at or after the audio, and the walk after it is computed in full;
- with ``mmcache.mstar.higgs.higgs_reuse`` (the audio walk named by its digest) the same audio is reused through the
  audio walk and the text after it when the first text walk ends at a page boundary, bit-exactly, and other audio
  never; a text walk ending mid-page stops the match there (a limit of continuing a match into a later walk).
"""

import pytest
import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from mmcache.mstar import PrefixReuse  # noqa: E402
from workloads.peers.mstar_higgs import (  # noqa: E402
    AUDIO_WALK,
    CFG,
    LABEL,
    TEXT_WALK,
    dense_reference,
    greedy,
    higgs_engine,
    higgs_reuse,
    save_weights,
    walk,
)

pytestmark = pytest.mark.usefixtures("one_thread")
P = 4  # page size


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_weights(tmp_path_factory.mktemp("higgs-llm"))


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def audio(n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """What the audio encoder node would hand the LLM: ``n`` rows in LLM space."""
    return torch.randn(n, CFG.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def serve(he, sampled, rid: str, pre, sound, post, new: int):
    """One Higgs request: its three prefill walks, ``new`` decode steps, removed. Returns (every step's logits,
    the rows each prefill walk computed, the generated ids)."""
    he.engine.add_request(rid, greedy())
    logits, fed = [], []
    for graph_walk, x, last in ((TEXT_WALK, pre, False), (AUDIO_WALK, sound, False), (TEXT_WALK, post, True)):
        got = walk(he, graph_walk, {rid: x}, sampled, last_prefill=last)[rid]
        logits.append(got[1])
        fed.append(he.fed[rid])
        if graph_walk == TEXT_WALK:
            assert he.rows[rid] == (he.fed[rid], he.fed[rid])  # ids and embeddings cut alike, each once
    out = []
    for _ in range(new):
        out.append(got[0])
        got = walk(he, "decode", {rid: torch.tensor([got[0]])}, sampled)[rid]
        logits.append(got[1])
    he.engine.remove_request(rid)
    return logits, fed, out



def test_the_forward_is_transformers_qwen3_on_the_same_weights(weights, sampled):
    he = higgs_engine(weights, dtype=torch.float32)
    pre, sound, post = ids(9, seed=1), audio(6, seed=2, dtype=torch.float32), ids(5, seed=3)
    logits, fed, out = serve(he, sampled, "a", pre, sound, post, new=3)
    assert fed == [9, 6, 5]
    dense = dense_reference(weights)
    with torch.no_grad():
        embed = dense.get_input_embeddings()
        rows = torch.cat((embed(pre), sound, embed(post), embed(torch.tensor(out))))[None]
        want = dense(inputs_embeds=rows).logits[0]
    ends = [8, 14, 19] + [20 + i for i in range(3)]  # each walk's last row, then each decode step's
    for got, at in zip(logits, ends, strict=True):
        torch.testing.assert_close(got, want[at], atol=1e-4, rtol=1e-4)


def test_a_shared_text_prefix_is_cut_to_the_suffix_bit_exactly(weights, sampled):
    on, off = higgs_engine(weights, reuse=higgs_reuse()), higgs_engine(weights)
    prompt = ids(18, seed=4)  # <|im_start|>user\n + the transcription prompt + <|audio_bos|>: the same for both
    post = ids(7, seed=5)
    first = (prompt, audio(5, seed=6), post)
    second = (prompt, audio(8, seed=7), post)  # other audio, same prompt
    for name, request in (("a", first), ("b", second)):
        got, want = serve(on, sampled, name, *request, new=3), serve(off, sampled, name, *request, new=3)
        assert all_equal(got[0], want[0]) and got[2] == want[2]
        assert want[1] == [18, request[1].shape[0], 7]
    assert got[1] == [18 - 4 * P, 8, 7]  # b's text walk: its 4 full pages were a's; the page of its last id is fed
    s = on.kv.stats(LABEL)
    assert s.hits == 1 and s.hit_tokens == 4 * P


def test_the_audio_walk_is_named_by_nothing_so_nothing_at_or_after_it_is_reused(weights, sampled):
    on, off = higgs_engine(weights, reuse=higgs_reuse()), higgs_engine(weights)
    request = (ids(10, seed=8), audio(9, seed=9), ids(6, seed=10))
    serve(on, sampled, "a", *request, new=2)
    got, want = serve(on, sampled, "b", *request, new=2), serve(off, sampled, "b", *request, new=2)
    assert all_equal(got[0], want[0])
    # the very same request: only the text walk's 2 full pages are reused (page 3 holds ids and audio rows), the
    # audio walk and the walk after it are computed in full
    assert got[1] == [10 - 2 * P, 9, 6]
    assert on.kv.stats(LABEL).hit_tokens == 2 * P


def test_without_id_walks_the_text_walk_is_named_by_nothing(weights, sampled):
    """The declaration is what turns it on: reuse on without ``id_walks`` reuses nothing of Higgs (its text walks
    feed embeddings), as before."""
    he = higgs_engine(weights, reuse=PrefixReuse(model="higgs-tiny@test"))
    request = (ids(18, seed=11), audio(4, seed=12), ids(5, seed=13))
    serve(he, sampled, "a", *request, new=1)
    assert serve(he, sampled, "b", *request, new=1)[1] == [18, 4, 5]
    assert he.kv.stats(LABEL).hits == 0


def test_the_audio_walk_named_by_its_digest_is_reused_when_the_walks_meet_at_a_page_boundary(weights, sampled):
    """``mmcache.mstar.higgs``: the audio walk named by a digest of its rows. A text walk of whole pages (16 ids)
    ends at a page boundary, where the match continues into the audio walk and the text walk after it; other audio
    is never served the first one's pages."""
    on, off = higgs_engine(weights, reuse=higgs_reuse(audio=True)), higgs_engine(weights)
    prompt, post = ids(16, seed=14), ids(7, seed=16)
    request = (prompt, audio(8, seed=15), post)
    serve(on, sampled, "a", *request, new=1)
    got, want = serve(on, sampled, "b", *request, new=2), serve(off, sampled, "b", *request, new=2)
    assert all_equal(got[0], want[0]) and got[2] == want[2]
    # each walk keeps the page of its last row to compute: 3 of 4 text pages, 1 of 2 audio pages, 1 of 2 text pages
    assert got[1] == [16 - 3 * P, 8 - P, 7 - P]
    assert on.kv.stats(LABEL).hit_tokens == 5 * P
    other = (prompt, audio(8, seed=17), post)
    got, want = serve(on, sampled, "c", *other, new=2), serve(off, sampled, "c", *other, new=2)
    assert all_equal(got[0], want[0]) and got[1] == [16 - 3 * P, 8, 7]


def test_a_walk_starting_mid_page_continues_the_match_through_the_audio(weights, sampled):
    """A match continues into a later walk that starts inside a page (``ReuseKVManager.feed``): after a text walk of
    18 ids the stream's own fifth page holds ids 16-17; the lookup covers that page from its start, and the cached
    page found for it stands in for the stream's own. The same audio and the text after it are then reused, leaving
    two rows of each walk to compute (a prefill is never cut to one row), logits equal to reuse off."""
    on, off = higgs_engine(weights, reuse=higgs_reuse(audio=True)), higgs_engine(weights)
    request = (ids(18, seed=18), audio(8, seed=19), ids(7, seed=20))
    serve(on, sampled, "a", *request, new=1)
    got, want = serve(on, sampled, "b", *request, new=1), serve(off, sampled, "b", *request, new=1)
    assert all_equal(got[0], want[0]) and got[1] == [18 - 4 * P, 2, 5]


def test_the_audio_walk_is_named_by_the_carried_digest_when_it_reaches_the_llm():
    """``audio_walk_media``: a carried ``audio_digest`` among the walk's inputs names the item; without one, the rows'
    digest (equal rows, equal digest); a text walk is not described by media."""
    from mstar.model.submodule_base import ARNodeInputs

    from mmcache.mstar.higgs import audio_walk_media, rows_digest
    rows = audio(5, seed=21)
    fed = ARNodeInputs(input_seq_len=5, input_embeds=rows)
    carried = torch.arange(16, dtype=torch.uint8)
    assert audio_walk_media(AUDIO_WALK, None, {"audio_digest": [carried]}, fed) == [(0, bytes(range(16)))]
    assert audio_walk_media(AUDIO_WALK, None, {}, fed) == [(0, rows_digest(rows.clone()))]
    assert rows_digest(rows) != rows_digest(audio(5, seed=22)) and len(rows_digest(rows)) == 16
    assert audio_walk_media(TEXT_WALK, None, {}, fed) is None
