"""The torch stand-ins for flashinfer's kernels (``workloads/peers/mstar_cpu_kernels.py``) against dense references,
called the way M*'s Orpheus path calls them: paged attention through M*'s own ``FlashInferPrefillWrapper`` /
``FlashInferDecodeWrapper`` with page tables from M*'s ``build_paged_indptrs`` (two requests sharing prefix pages, in
scattered page order) vs plain causal softmax attention over each unpaged sequence; RoPE through M*'s
``mstar::rope_apply_qk_inplace`` op with Orpheus's llama3.1 parameters vs transformers' llama3 RoPE; the greedy
sampler vs the penalty rule written out."""

import math

import pytest
import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar.engine.resources.kv.plan import SequenceView, build_paged_indptrs  # noqa: E402

from workloads.peers import mstar_cpu_kernels as kernels  # noqa: E402

HQ, HKV, D, P = 4, 2, 8, 4  # query heads, KV heads (GQA, groups of 2), head dim, page size


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of the last ``n`` positions of an unpaged sequence: ``q`` [n, HQ, D], ``keys`` /
    ``values`` [L, HKV, D]; query ``j`` sits at position ``L - n + j``."""
    n, length = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [HQ, L, D]
    v = values.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(D)  # [HQ, n, L]
    visible = torch.arange(length)[None, :] <= (length - n + torch.arange(n))[:, None]
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ v).transpose(0, 1)  # [n, HQ, D]


def paged(sequences: dict[str, torch.Tensor], pages_of: dict[str, list[int]], num_pages: int = 16) -> torch.Tensor:
    """A layer tensor [pages, 2, P, HKV, D] (NHD) holding each sequence's K/V [L, 2, HKV, D] on its pages; a page
    two sequences list holds the same bytes for both (it is written twice with them)."""
    layer = torch.randn(num_pages, 2, P, HKV, D)  # noise wherever no sequence lives
    for rid, kv in sequences.items():
        for i, page in enumerate(pages_of[rid]):
            chunk = kv[i * P:(i + 1) * P]
            layer[page, :, :chunk.shape[0]] = chunk.transpose(0, 1)
    return layer


def two_requests_sharing_a_prefix():
    """``a``: 9 tokens on pages [11, 3, 6]; ``b``: ``a``'s first 8 tokens (pages 11 and 3, shared) and 5 of its own
    on [14, 2]; ``c``: 3 tokens on [7]."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(9, 2, HKV, D, generator=g)
    b = torch.cat((a[:8], torch.randn(5, 2, HKV, D, generator=g)))
    c = torch.randn(3, 2, HKV, D, generator=g)
    return {"a": a, "b": b, "c": c}, {"a": [11, 3, 6], "b": [11, 3, 14, 2], "c": [7]}


def test_paged_prefill_matches_dense_causal_attention(sampled):
    from mstar.engine.resources.attn.wrappers import FlashInferPrefillWrapper
    seqs, pages_of = two_requests_sharing_a_prefix()
    layer = paged(seqs, pages_of)
    # a and c prefill cold; b computes only its 5 new positions, reading the shared prefix from a's pages
    computed = {"a": 9, "b": 5, "c": 3}
    views = [SequenceView(rid, "main", pages_of[rid], len(seqs[rid]), computed[rid]) for rid in seqs]
    q = {rid: torch.randn(n, HQ, D, generator=torch.Generator().manual_seed(7)) for rid, n in computed.items()}
    wrapper = FlashInferPrefillWrapper(torch.empty(0), HQ, HKV, D, P, device=torch.device("cpu"))
    wrapper.plan(causal=True, dtype=torch.float32, **build_paged_indptrs(views, P).to_kwargs_dict())
    out = wrapper.run(torch.cat(list(q.values())), layer)
    at = 0
    for rid, n in computed.items():
        want = dense_attention(q[rid], seqs[rid][:, 0], seqs[rid][:, 1])
        torch.testing.assert_close(out[at:at + n], want, atol=1e-5, rtol=1e-5)
        at += n


def test_paged_decode_matches_dense_attention_over_every_key(sampled):
    from mstar.engine.resources.attn.wrappers import FlashInferDecodeWrapper
    seqs, pages_of = two_requests_sharing_a_prefix()
    layer = paged(seqs, pages_of)
    views = [SequenceView(rid, "main", pages_of[rid], len(seqs[rid]), 1) for rid in seqs]
    q = torch.randn(len(seqs), HQ, D, generator=torch.Generator().manual_seed(8))
    wrapper = FlashInferDecodeWrapper(torch.empty(0), HQ, HKV, D, P, device=torch.device("cpu"))
    wrapper.plan(dtype=torch.float32, **build_paged_indptrs(views, P).to_kwargs_dict())
    out = wrapper.run(q, layer)
    for i, rid in enumerate(seqs):
        want = dense_attention(q[i:i + 1], seqs[rid][:, 0], seqs[rid][:, 1])
        torch.testing.assert_close(out[i:i + 1], want, atol=1e-5, rtol=1e-5)


def test_a_query_row_does_not_depend_on_the_rest_of_the_batch(sampled):
    """What lets reuse on and off compare bit for bit: ``b``'s last position attended alone equals it attended in
    a 5-row prefill beside two other requests."""
    from mstar.engine.resources.attn.wrappers import FlashInferPrefillWrapper
    seqs, pages_of = two_requests_sharing_a_prefix()
    layer = paged(seqs, pages_of).to(torch.bfloat16)
    q = torch.randn(5, HQ, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    batch = [SequenceView("a", "main", pages_of["a"], 9, 9), SequenceView("b", "main", pages_of["b"], 13, 5)]
    alone = [SequenceView("b", "main", pages_of["b"], 13, 1)]
    wrapper = FlashInferPrefillWrapper(torch.empty(0), HQ, HKV, D, P, device=torch.device("cpu"))
    wrapper.plan(causal=True, dtype=torch.bfloat16, **build_paged_indptrs(batch, P).to_kwargs_dict())
    full = wrapper.run(torch.cat((torch.zeros(9, HQ, D, dtype=torch.bfloat16), q)), layer)
    wrapper.plan(causal=True, dtype=torch.bfloat16, **build_paged_indptrs(alone, P).to_kwargs_dict())
    assert torch.equal(wrapper.run(q[-1:], layer), full[-1:])


def llama3_rope_reference(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor):
    """transformers' llama3 RoPE (``ROPE_INIT_FUNCTIONS["llama3"]``, ``apply_rotary_pos_emb``) with Orpheus's
    parameters, on ``q`` [n, H, D] / ``k``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from workloads.peers.mstar_orpheus import llama_config
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](llama_config(), "cpu")
    angle = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((angle, angle), dim=-1)[None]
    rq, rk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos(), emb.sin())
    return rq[0].transpose(0, 1), rk[0].transpose(0, 1)


def test_rope_through_m_star_s_op_matches_transformers_llama3_rope(sampled):
    from mstar.engine.resources.position import rope  # noqa: F401  (registers the op)

    from workloads.peers.mstar_orpheus import CFG
    pos = torch.tensor([0, 1, 5, 37, 1000, 8191, 8192, 20000, 100000])
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(len(pos), HQ, D, generator=g), torch.randn(len(pos), HKV, D, generator=g)
    got_q, got_k = q.clone(), k.clone()
    s = CFG.rope_scaling
    torch.ops.mstar.rope_apply_qk_inplace(got_q, got_k, pos, None, None, False, s["factor"], CFG.rope_theta,
                                          low_freq_factor=s["low_freq_factor"],
                                          high_freq_factor=s["high_freq_factor"],
                                          old_context_len=s["original_max_position_embeddings"])
    want_q, want_k = llama3_rope_reference(q, k, pos)
    torch.testing.assert_close(got_q, want_q, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_k, want_k, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got_q, q)


@pytest.mark.parametrize("llama31", [{}, dict(low_freq_factor=1.0, high_freq_factor=1.0, old_context_len=8192)],
                         ids=["plain", "llama31-unscaled"])
def test_plain_rope_through_m_star_s_op_matches_transformers_default_rope(sampled, llama31):
    """Qwen3's RoPE (theta 1e6, no scaling) as M*'s op reaches FlashInfer: plain, and as M*'s Higgs Audio LLM sends
    it (``ParallelAttention``'s default llama3.1 factors, low = high = 1, which the kernel's clamp makes plain)."""
    from mstar.engine.resources.position import rope  # noqa: F401  (registers the op)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    theta, pos = 1e6, torch.tensor([0, 1, 5, 37, 1000, 4095])
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(len(pos), HQ, D, generator=g), torch.randn(len(pos), HKV, D, generator=g)
    got_q, got_k = q.clone(), k.clone()
    torch.ops.mstar.rope_apply_qk_inplace(got_q, got_k, pos, None, None, False, 1.0, theta, **llama31)
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # transformers' "default" RoPE
    angle = pos[:, None].float() * inv_freq[None, :]
    emb = torch.cat((angle, angle), dim=-1)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos(), emb.sin())
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got_q, q)


def test_m_star_s_rope_op_raises_on_cpu_without_the_standins():
    from mstar.engine.resources.position import rope  # noqa: F401
    kernels._register_rope_on_cpu()
    x = torch.zeros(1, 1, D)
    with pytest.raises(NotImplementedError, match="only implemented for CUDA"):
        torch.ops.mstar.rope_apply_qk_inplace(x, x.clone(), torch.zeros(1, dtype=torch.long), None, None, False,
                                              1.0, 1e4)


def test_greedy_sampler_applies_the_penalty_then_takes_the_argmax(sampled):
    from mstar.engine.resources.sampler import utils
    logits = torch.tensor([[2.0, 1.9, -1.0], [-0.5, -0.6, -3.0]])
    seen = torch.tensor([[True, False, False], [True, False, False]])
    got = utils.sample_tokens(logits, temperature=torch.zeros(2), repetition_penalty=torch.tensor([1.3, 1.3]),
                              seen_token_mask=seen)
    assert got.tolist() == [1, 1] and got.dtype == torch.int32  # 2/1.3 < 1.9; -0.5*1.3 < -0.6
    assert utils.sample_tokens(logits, temperature=torch.zeros(2)).tolist() == [0, 0]
    assert torch.equal(sampled.logits[-1], logits)
    with pytest.raises(NotImplementedError, match="greedy only"):
        utils.sample_tokens(logits, temperature=torch.tensor([0.0, 0.6]))
