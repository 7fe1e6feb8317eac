"""``module_fingerprint``: the name of what a torch module computes, from every byte of its weights. It roots the
page names and encoder keys of an integration given neither a ``fingerprint`` nor a checkpoint folder to take one
from (``mmcache.weights_fingerprint``, the default of ``mmcache.hf`` and ``mmcache.mstar``, falls back to it), and
of the ``encoders`` wrappers."""

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
    weights, after a copy to host for weights on an accelerator (about 0.1 s per GB on a CPU, 0.95 s per GiB from a
    GPU); ``mmcache.weights_fingerprint`` names weights loaded from a checkpoint folder without reading them, or pass
    a ``fingerprint`` string to the wrapper instead for weights on the meta device (sequential offload). Taken once:
    weights changed in place later keep the old fingerprint, so build a new wrapper after changing them. Configs
    that differ only in fields without effect (e.g. ``architectures``) give different fingerprints: a needless miss,
    never a wrong hit.
    """
    h = xxhash.xxh3_128()
    h.update(config_bytes(module))
    for name, t in module.state_dict().items():
        update_with_tensor(h, name, t, module)
    return label(module, h.hexdigest())


def config_bytes(module: nn.Module) -> bytes:
    """The canonical config and attention backend of ``module``: the part of every fingerprint that is not weights."""
    config = getattr(module, "config", None)
    return digests.canonical({"config": config, "attn": getattr(config, "_attn_implementation", None)})


def update_with_tensor(h, name: str, t: torch.Tensor, module: nn.Module) -> None:
    """Feed state-dict entry ``name`` (its dtype, shape and every byte, copied to host) into hasher ``h``; a tensor on
    the meta device raises ValueError (its bytes do not exist)."""
    check_materialized(name, t, module)
    t = t.detach().cpu().contiguous()
    h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())  # via uint8: bfloat16 has no numpy dtype


def check_materialized(name: str, t: torch.Tensor, module: nn.Module) -> None:
    """ValueError for a tensor on the meta device (offloaded): nothing can name weights that are not there."""
    if t.device.type == "meta":
        raise ValueError(f"{name} of {type(module).__name__} is on the meta device (offloaded): its weights "
                         f"cannot be hashed, pass fingerprint= to the wrapper")


def label(module: nn.Module, hexdigest: str) -> str:
    """The fingerprint string: ``Class/hash/dtype/device type`` of ``module``'s first parameter."""
    p = next(module.parameters())
    return f"{type(module).__name__}/{hexdigest}/{str(p.dtype).removeprefix('torch.')}/{p.device.type}"
