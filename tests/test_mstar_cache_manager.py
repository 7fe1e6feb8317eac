"""M*'s real cache manager (``create_cache_manager`` -> ``FlashInferCacheManager``: plan_attention, plan_rope,
apply_rope, run_attention, advance_seq_lens) over the drop-in, several requests per batch, later requests reusing
earlier ones' pages: outputs equal (torch.equal) to reuse off on the same batch/chunk schedule, the RFC's gate under
continuous batching. The flashinfer stand-in (tests/flashinfer_standin.py) is checked against dense attention."""

import pytest
import torch

import flashinfer_standin
from mstar_helpers import assert_same_steps, config, dropin_manager, kv_tensor, require_mstar

require_mstar()

from mstar_tiny_ar import TinyAR, H, L, D, P  # noqa: E402


@pytest.fixture(autouse=True)
def flashinfer(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", flashinfer_standin.module())


def serve_batch(model, alloc, prompts, decode, chunks=None, reuse=True):
    """Add the requests, match their prefixes (0 with reuse off), prefill (reuse off: in ``chunks``, token cut
    points per request), decode greedily, remove. Returns (matched, logits of every step, tokens)."""
    for rid in prompts:
        alloc.add_request(rid, ["main"])
    matched = {rid: alloc.match_prefix(rid, "main", ids) for rid, ids in prompts.items()}
    cuts = {rid: ([] if reuse else list((chunks or {}).get(rid, []))) + [len(ids)] for rid, ids in prompts.items()}
    done = {rid: matched[rid] for rid in prompts}
    logits = []
    for i in range(max(len(c) for c in cuts.values())):
        batch = {rid: prompts[rid][done[rid]:cuts[rid][i]] for rid in prompts
                 if i < len(cuts[rid]) and cuts[rid][i] > done[rid]}  # an empty chunk sits the step out
        out = model.step(alloc, batch)
        done.update({rid: cuts[rid][i] for rid in batch})
        logits.append(out)
    tokens = {rid: list(ids) for rid, ids in prompts.items()}
    for _ in range(decode):
        nxt = {rid: [int(logits[-1][rid].argmax())] if rid in logits[-1] else [] for rid in prompts}
        for rid, t in nxt.items():
            tokens[rid] += t
            alloc.append_tokens(rid, "main", t)
        logits.append(model.step(alloc, nxt))
    for rid in prompts:
        alloc.remove_request(rid)
    return matched, logits, tokens


def manager(reuse):
    cfg = config(max_num_pages=64, page_size=P, num_layers=L, num_kv_heads=H, head_dim=D)
    return dropin_manager(cfg, kv_tensor(cfg), reuse=reuse)


def test_standin_matches_dense_attention():
    model, alloc = TinyAR(), manager(False)
    prompts = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [2, 7, 1, 8, 2, 8, 1]}
    _, logits, tokens = serve_batch(model, alloc, prompts, decode=4)
    for rid in prompts:
        dense = model.dense(tokens[rid])
        n = len(prompts[rid])
        got = torch.stack([step[rid] for step in logits if rid in step])
        torch.testing.assert_close(got, dense[n - 1:n - 1 + got.shape[0]], rtol=1e-5, atol=1e-5)


def test_reuse_gives_bit_equal_outputs_on_the_same_schedule():
    model = TinyAR()
    first = {"a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], "b": [2, 7, 1, 8, 2, 8, 1, 8, 2]}
    runs = {}
    for reuse in (True, False):
        alloc = manager(reuse)
        _, _, toks = serve_batch(model, alloc, first, decode=3)
        later = {"c": toks["a"][:12] + [11, 12, 13], "d": first["b"][:8] + [40, 41, 42, 43], "e": [5, 5, 5, 5, 5]}
        if reuse:
            matched, logits, _ = serve_batch(model, alloc, later, decode=3)
        else:
            # Recompute what the cached run skipped in the chunks it was first computed in: c's 12 tokens were a's
            # 10-token prefill then two decode steps; d's 8 were part of b's prefill. e sits those steps out.
            matched = runs[True][0]
            chunks = {"c": [10, 11, 12], "d": [8, 8, 8], "e": [0, 0, 0]}  # cut points per step
            _, logits, _ = serve_batch(model, alloc, later, decode=3, chunks=chunks, reuse=False)
            logits = logits[3:]  # the extra chunks' steps have no counterpart in the cached run
        runs[reuse] = (matched, logits)
        assert alloc.pool.num_free + sum(len(i) for i in alloc.indexes.values()) == 64
    matched = runs[True][0]
    assert matched == {"c": 12, "d": 8, "e": 0}  # generated pages of "a" are reused too
    assert_same_steps(runs[True][1], runs[False][1], steps=4)
