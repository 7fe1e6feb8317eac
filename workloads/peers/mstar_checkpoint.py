"""Random tensors for an M* module under a hub checkpoint's names: what the M* harnesses whose checkpoints are not
written by transformers (Qwen3-TTS, Pi0.5) save, for M*'s own loader (``load_hf_weights`` with
``LLAMA_STACKED_PARAMS``) to read back.

M* fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; a hub checkpoint holds them apart, so those are
split back: q/k/v by head counts, gate/up in halves. A fused name is matched as M*'s ``StackedParamRule`` matches it
(the suffix anywhere in the name), so a fused expert beside the first (BAGEL's ``qkv_proj_moe_gen``) splits into
``q_proj_moe_gen``, ... the same way. Every other parameter keeps its name and shape.
"""

from __future__ import annotations

import torch

UNFUSED = {".qkv_proj": (".q_proj", ".k_proj", ".v_proj"), ".gate_up_proj": (".gate_proj", ".up_proj")}


def hub_parts(name: str) -> list[str]:
    """The hub names an M* parameter ``name`` is loaded from, in the order M* stacks them."""
    fused = next((f for f in UNFUSED if f in name), None)
    return [name.replace(fused, part) for part in UNFUSED[fused]] if fused else [name]


def random_hub_tensors(module: torch.nn.Module, heads: tuple[int, int, int], g: torch.Generator,
                       norm_offset: float = 1.0) -> dict[str, torch.Tensor]:
    """Every parameter of ``module`` (built on any device, meta included) as hub-named random tensors: q/k/v split
    by ``heads`` = (query heads, KV heads, head dim), gate/up in halves. Weights N(0, 0.2), norm scales
    ``norm_offset`` + N(0, 0.1) (0 for Gemma's norms, which scale by 1 + w), biases N(0, 0.02)."""
    hq, hkv, d = heads
    out = {}
    for name, p in module.named_parameters():
        parts = hub_parts(name)
        if len(parts) == 3:
            rows = (hq * d, hkv * d, hkv * d)
        else:
            rows = (p.shape[0] // len(parts),) * len(parts)
        for part, r in zip(parts, rows, strict=True):
            shape = (r, *p.shape[1:])
            if part.endswith("norm.weight"):
                value = norm_offset + 0.1 * torch.randn(shape, generator=g)
            elif part.endswith(".bias"):
                value = 0.02 * torch.randn(shape, generator=g)
            else:
                value = 0.2 * torch.randn(shape, generator=g)
            out[part] = value.contiguous()
    return out
