"""The requests of the Qwen3-Omni thinker tests (``test_mstar_qwen3_omni_forward.py`` and
``test_mstar_qwen3_omni_row_schedules.py``): ids, rows and images as the encoder nodes hand them, one request served
walk by walk under M*'s real ``Engine`` (``workloads/peers/mstar_qwen3_omni.py``), and the checks that reuse on
computed what reuse off did."""

import torch

from mstar_helpers import require_mstar

require_mstar()
from workloads.peers import mstar_qwen3_omni as q  # noqa: E402

H = q.TEXT_SIZES["hidden_size"]


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed))


def rows(n: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """What an encoder node would hand the thinker: ``n`` rows in its hidden space."""
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def image(seed: int, grid=(1, 4, 8), dtype=torch.bfloat16):
    """A vision item as the vision encoder's edges bring it: rows (one per merged 2x2 patch), deepstack rows for
    each deepstack layer, the grid."""
    n = grid[0] * grid[1] * grid[2] // 4
    return rows(n, seed, dtype), [rows(n, seed + 1000 + i, dtype) for i in range(q.DEEPSTACK)], torch.tensor([grid])


def serve(te, sampled, rid: str, walks, new: int = 2, audio_output: bool = False):
    """One thinker request: its prefill walks (the last samples the first token), ``new`` decode steps, removed.
    Returns per step (prefill walks, then decode): the token, the logits, the computed rows' hidden states, the
    rows fed (after any cut), their 3D positions, the MRoPE counter after the step, the walk, and with audio output
    its ``(thinker_states, thinker_mask)`` as sent to the talker and as M*'s postprocess was handed them."""
    te.engine.add_request(rid, q.greedy())
    steps, token = [], None
    schedule = list(walks) + [(q.DECODE, None)] * new
    for i, (graph_walk, x) in enumerate(schedule):
        x = torch.tensor([token]) if graph_walk == q.DECODE else x
        got = q.walk(te, graph_walk, {rid: x}, sampled, last_prefill=i == len(walks) - 1,
                     audio_output=audio_output)[rid]
        fed = te.fed[rid]
        steps.append((*got, int(fed.input_seq_len), fed.custom_pos_ids, te.pos.position(rid, q.LABEL), graph_walk,
                      te.talker.get(rid), te.raw.get(rid)))
        token = got[0] if got[0] is not None else token
    te.engine.remove_request(rid)
    return steps


def same(got, want) -> bool:
    """Reuse on (``got``) computed the suffix of what reuse off computed (``want``), bit for bit: the same tokens and
    logits, its rows' hidden states and positions the last rows of the cold run's, the same counter."""
    for g, w in zip(got, want, strict=True):
        n = g[3]
        if g[0] != w[0] or (g[1] is None) != (w[1] is None) or (g[1] is not None and not torch.equal(g[1], w[1])):
            return False
        if not (torch.equal(g[2], w[2][w[3] - n:]) and torch.equal(g[4], w[4][:, w[3] - n:]) and g[5] == w[5]):
            return False
    return True


def edges_equal(a, b) -> bool:
    """Two talker edges (``(thinker_states, thinker_mask)`` or None) the same, dtypes too."""
    if a is None or b is None:
        return a is b
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def spoken_same(got, want) -> bool:
    """``same``, and every step handed the talker exactly what reuse off handed it: the states and masks M*'s
    postprocess was given (every row of the walk) and those it sent on (its selection)."""
    return same(got, want) and all(edges_equal(g[7], w[7]) and edges_equal(g[8], w[8])
                                   for g, w in zip(got, want, strict=True))


def fed(steps) -> list[int]:
    """The rows each prefill walk computed."""
    return [s[3] for s in steps if s[6] != q.DECODE]


def system_turn(n: int, seed: int) -> torch.Tensor:
    """A system turn then the start of a user turn (``n`` ids): the talker skips the system turn's rows, a mask M*
    computes from the whole walk (a row is skipped once the next ``<|im_start|>`` shows its turn ends)."""
    r = q.ROLES
    body = ids(n - 6, seed)
    return torch.cat((torch.tensor([r["im_start_token_id"], r["system_token_id"]]), body,
                      torch.tensor([r["im_end_token_id"], r["im_start_token_id"], r["user_token_id"]]), ids(1, seed)))
