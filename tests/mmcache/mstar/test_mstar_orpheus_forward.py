"""M*'s real Orpheus LLM forward (``OrpheusLLMSubmodule`` over ``OrpheusForCausalLM``, weights loaded by M*'s own
loader from a local safetensors folder) under M*'s real ``Engine`` on CPU, with reuse turned on by
``enable_reuse`` and off (M*'s own specs), on the same batch schedule (``workloads/peers/mstar_orpheus.py``).
Only flashinfer's and triton's kernels are torch stand-ins (``workloads/peers/mstar_cpu_kernels.py``): paged
attention reads K/V through the KV resource's own page table, so a reused prefix is attended from the pages another
request wrote.

- fp32, the forward is transformers' ``LlamaForCausalLM`` on the same weights (the stand-ins and M*'s model agree
  with a dense reference end to end);
- bf16 (M*'s default dtype), every step's logits with reuse on are ``torch.equal`` to reuse off, for a second turn
  that re-sends the first turn and its answer, and for a request admitted while another with the same prefix is
  still decoding (the two in flight share the committed pages); the prefill with reuse on computes only the
  uncached suffix (counted at the LM's embedding), and greedy tokens under Orpheus's repetition penalty agree.
"""

import pytest
import torch

from mstar_helpers import all_equal, require_mstar

require_mstar()
from workloads.peers.mstar_orpheus import CFG, LABEL, PrefixReuse, engine_step, greedy, orpheus_engine, save_weights  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
P = 4  # page size


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_weights(tmp_path_factory.mktemp("orpheus-llm"))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engines(weights, **kw):
    """(reuse on, reuse off): the same model, the same pool size."""
    return orpheus_engine(weights, reuse=PrefixReuse(model="orpheus-tiny@test"), **kw), orpheus_engine(weights, **kw)


def serve(oe, sampled, rid: str, prompt: list[int], new: int):
    """Prefill ``prompt``, ``new`` greedy decode steps, remove: (generated ids, logits of every step, tokens the
    prefill computed)."""
    oe.engine.add_request(rid, greedy())
    got = engine_step(oe, "prefill", {rid: prompt}, sampled)[rid]
    fed, out, logits = oe.embedded[-1], [], [got[1]]
    for _ in range(new):
        out.append(got[0])
        got = engine_step(oe, "decode", {rid: [got[0]]}, sampled)[rid]
        logits.append(got[1])
    oe.engine.remove_request(rid)
    return out, logits, fed



def test_the_forward_is_transformers_llama_on_the_same_weights(weights, sampled):
    from transformers import LlamaForCausalLM
    oe = orpheus_engine(weights, dtype=torch.float32)
    prompt = ids(21, seed=1)
    out, logits, fed = serve(oe, sampled, "a", prompt, new=4)
    assert fed == 21
    with torch.no_grad():
        dense = LlamaForCausalLM.from_pretrained(weights).eval()(torch.tensor([prompt + out])).logits[0]
    for step, got in enumerate(logits):  # the prefill's last position, then each decode step
        torch.testing.assert_close(got, dense[len(prompt) - 1 + step], atol=1e-4, rtol=1e-4)


def test_a_second_turn_reuses_the_first_turn_bit_exactly(weights, sampled):
    on, off = engines(weights)
    turn1 = ids(23, seed=2)
    got1, want1 = serve(on, sampled, "t1", turn1, new=3), serve(off, sampled, "t1", turn1, new=3)
    assert got1[0] == want1[0] and all_equal(got1[1], want1[1])
    turn2 = turn1 + got1[0] + ids(6, seed=3)  # the first turn, its answer, the next question: 32 tokens
    got2, want2 = serve(on, sampled, "t2", turn2, new=4), serve(off, sampled, "t2", turn2, new=4)
    assert got2[0] == want2[0] and all_equal(got2[1], want2[1])
    # turn 1 wrote 23 + 2 positions (its last token is sampled, never fed): 6 full pages, the last one part prompt
    # and part answer
    assert want2[2] == 32 and got2[2] == 32 - 6 * P
    s = on.kv.stats(LABEL)
    assert s.hits == 1 and s.hit_tokens == 6 * P


def test_a_request_admitted_while_another_decodes_shares_its_committed_pages(weights, sampled):
    on, off = engines(weights)
    a = ids(23, seed=4)
    b = a[:18] + ids(7, seed=5)  # a's first 4 pages, then its own
    runs = {}
    for name, oe in (("on", on), ("off", off)):
        oe.engine.add_request("a", greedy())
        steps = [engine_step(oe, "prefill", {"a": a}, sampled)]
        oe.engine.add_request("b", greedy())  # a's prefill has committed; a has not finished
        steps.append(engine_step(oe, "prefill", {"b": b}, sampled))
        fed_b = oe.embedded[-1]
        if name == "on":
            held_a, held_b = (oe.kv._streams[r][LABEL].page_indices for r in ("a", "b"))
            assert held_b[:4] == held_a[:4] and not set(held_b[4:]) & set(held_a)
            assert (oe.kv.pool.counts[held_a[:4]] >= 2).all()
        last = {"a": steps[0]["a"][0], "b": steps[1]["b"][0]}
        for _ in range(4):  # both decode in one batch
            steps.append(engine_step(oe, "decode", {rid: [tok] for rid, tok in last.items()}, sampled))
            last = {rid: got[0] for rid, got in steps[-1].items()}
        oe.engine.remove_request("a")
        oe.engine.remove_request("b")
        runs[name] = steps, fed_b
    (got, fed_on), (want, fed_off) = runs["on"], runs["off"]
    assert fed_off == 25 and fed_on == 25 - 4 * P
    for step_on, step_off in zip(got, want, strict=True):
        assert step_on.keys() == step_off.keys()
        for rid in step_on:
            assert step_on[rid][0] == step_off[rid][0] and torch.equal(step_on[rid][1], step_off[rid][1])
    assert on.kv.stats(LABEL).hit_tokens == 4 * P


def test_a_prompt_cached_but_its_last_token_is_cut_to_two_rows_not_one(weights, sampled):
    """The same 17-token prompt twice: 4 pages of 4 could be reused, leaving one row, but a prefill step of one row a
    request is what M*'s attention takes for a decode step, whose plan Orpheus's ``select_last_hidden`` cannot read
    (it raised). The cut leaves two rows: 3 pages reused, 5 tokens computed, logits equal to reuse off."""
    on, off = engines(weights)
    prompt = ids(4 * P + 1, seed=6)
    serve(on, sampled, "a", prompt, new=1)
    got, want = serve(on, sampled, "b", prompt, new=2), serve(off, sampled, "b", prompt, new=2)
    assert got[2] == P + 1 and want[2] == 4 * P + 1
    assert got[0] == want[0] and all_equal(got[1], want[1])
