"""M*'s real ``Engine`` (``load_model`` with the node's specs, ``warmup``, ``add_request``, ``prepare_inputs``,
``exec_and_postprocess``, ``finalize_batch``, ``remove_request``) over mmcache's KV resource and M*'s ``RopeManager``,
a toy AR node whose only stand-in is attention (``tests/mstar_toy_ar.py``). Several requests per batch, a second turn
reusing the first turn's prompt and generated pages: every step's logits ``torch.equal`` to reuse off on the same
batch schedule."""

import torch

from mstar_helpers import require_mstar

require_mstar()
from mstar_toy_ar import LABEL, PrefixReuse, engine_node, engine_step, weights  # noqa: E402


def conversation(engine, prompts: dict[str, list[int]], new: int):
    """Prefill every prompt in one batch, then ``new`` greedy decode steps for all of them in one batch each;
    returns (rid -> output ids, the logits of every step in order)."""
    for rid in prompts:
        engine.add_request(rid)
    logits = [engine_step(engine, "prefill", prompts)]
    out = {rid: [] for rid in prompts}
    for _ in range(new):
        for rid in prompts:
            out[rid].append(int(logits[-1][rid].argmax()))
        logits.append(engine_step(engine, "decode", {rid: out[rid][-1:] for rid in prompts}))
    for rid in prompts:
        engine.remove_request(rid)
    return out, logits


def test_reuse_on_equals_reuse_off_under_m_star_s_engine():
    w = weights()
    (on, node), (off, _) = engine_node(w, reuse=PrefixReuse(model="toy@0")), engine_node(w)
    turn1 = {f"q{i}": [7 + i] * 3 + list(range(20, 30)) for i in range(3)}
    got, want = conversation(on, turn1, 4), conversation(off, turn1, 4)
    assert got[0] == want[0]
    turn2 = {f"{rid}-2": turn1[rid] + got[0][rid] + [40 + i, 41, 42] for i, rid in enumerate(turn1)}
    got2, want2 = conversation(on, turn2, 3), conversation(off, turn2, 3)
    assert got2[0] == want2[0]
    for a, b in zip(got[1] + got2[1], want[1] + want2[1]):
        assert a.keys() == b.keys() and all(torch.equal(a[r], b[r]) for r in a)
    s = node.node_resources["kv"].stats(LABEL)          # the resources the engine bound to the node
    assert s.hits == 3 and s.hit_tokens == 3 * 16     # each second turn reused 4 pages: 13 prompt + 3 generated
