"""``module_fingerprint``: the name of what a torch module computes, which roots the page names and encoder keys of
every integration (``mmcache.hf``, ``mmcache.mstar``, ``encoders``)."""

from __future__ import annotations

import torch
import xxhash
from torch import nn

import digests


def module_fingerprint(module: nn.Module) -> str:
    """``Class/hash/dtype/device type`` naming what ``module`` computes: equal fingerprints give equal outputs.

    The hash (xxh3-128) covers every tensor of the state dict (name, dtype, shape, bytes), the canonical config and
    the attention backend (``config._attn_implementation``: sdpa and eager differ in the last bits). All the bytes,
    not a sample: two checkpoints that differ in a single weight never share an entry. That is one pass over the
    weights at construction (about 0.1 s per GB on a CPU); pass a ``fingerprint`` string to the wrapper instead for
    weights on the meta device (sequential offload) or too large to read. Taken once: weights changed in place later
    keep the old fingerprint, so build a new wrapper after changing them. Configs that differ only in fields without
    effect (e.g. ``architectures``) give different fingerprints: a needless miss, never a wrong hit.
    """
    h = xxhash.xxh3_128()
    config = getattr(module, "config", None)
    h.update(digests.canonical({"config": config, "attn": getattr(config, "_attn_implementation", None)}))
    for name, t in module.state_dict().items():
        if t.device.type == "meta":
            raise ValueError(f"{name} of {type(module).__name__} is on the meta device (offloaded): its weights "
                             f"cannot be hashed, pass fingerprint= to the wrapper")
        t = t.detach().cpu().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # via uint8: bfloat16 has no numpy dtype
    p = next(module.parameters())
    return f"{type(module).__name__}/{h.hexdigest()}/{str(p.dtype).removeprefix('torch.')}/{p.device.type}"
