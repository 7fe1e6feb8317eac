"""How M* encoder nodes split into keyed items (``NodeItems`` of ``mmcache.mstar.encoder_node``).

- ``WholeRequest``: one item per request, the node's whole output. Its digest is the one the data path carried
  (``mmcache.mstar.media_digests``: the bytes as sent plus the processor's parameters, in a graph input named
  ``<modality>_digest``); without one, a digest of the node's own input tensors (exact as well, but it hashes
  preprocessed tensors on the node and, on a GPU, copies them to the host first).
- ``Wan22TextItems``: the Wan 2.2 text encoder's prompt and CFG negative as two items keyed by their token ids
  (verified on every hit), so the negative shared by nearly every request is encoded once.

``items_for(node)`` picks the one for M*'s known encoder submodules.
"""

from __future__ import annotations

import dataclasses
import json

import torch

import digests
from digests.digest import compute
from mmcache.errors import InvalidRequest
from mmcache.mstar.encoder_node import Item

DIGEST_SUFFIX = "_digest"  # graph input ``<modality>_digest``: one uint8 [16] digest per media item of the request


def carried_digest(raw_inputs: dict, modality: str) -> bytes | None:
    """The digest the data path carried for this request's ``modality`` media (their digests joined in order), or
    None when the request has none."""
    found = raw_inputs.get(modality + DIGEST_SUFFIX)
    if not found:
        return None
    parts = [t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in found]
    if any(len(p) < 16 for p in parts):
        raise InvalidRequest(f"{modality}{DIGEST_SUFFIX} must hold 16-byte digests, got lengths "
                             f"{[len(p) for p in parts]}")
    return b"".join(parts)


def inputs_digest(node_inputs, modality: str) -> digests.Digest:
    """A 128-bit digest of a request's node inputs: every tensor's name, dtype, shape and bytes, and the non-tensor
    kwargs as canonical JSON. Equal digests mean equal inputs (up to a hash collision)."""
    meta, payload = [], []
    for name, t in sorted(node_inputs.tensor_inputs.items()):
        if t is None:
            meta.append([name, None])
            continue
        t = t.detach().cpu().contiguous()
        meta.append([name, str(t.dtype), list(t.shape)])
        payload.append(t.reshape(-1).view(torch.uint8).numpy())
    header = json.dumps({"node_inputs": meta, "modality": modality}, sort_keys=True).encode()
    return compute(header + digests.canonical(node_inputs.kwargs), payload)


def rows_digest(rows: torch.Tensor) -> bytes:
    """16 bytes naming an embeddings tensor exactly: its dtype, shape and bytes (equal digests, equal rows, up to a
    hash collision)."""
    rows = rows.detach().contiguous().cpu()
    header = json.dumps({"walk_rows": [str(rows.dtype), list(rows.shape)]}).encode()
    return bytes(compute(header, [rows.reshape(-1).view(torch.uint8).numpy()]))


@dataclasses.dataclass(frozen=True)
class WholeRequest:
    """One item per request: the node's whole output for the request's inputs."""

    modality: str
    walk_sensitive: bool = True

    def items(self, fwd_info, raw_inputs: dict, node_inputs) -> list[Item]:
        digest = carried_digest(raw_inputs, self.modality)
        if digest is None:
            return [Item(bytes(inputs_digest(node_inputs, self.modality)), node_inputs)]
        return [Item(digest, node_inputs, salted=True)]

    def assemble(self, node_inputs, values: list) -> dict:
        return values[0]


def _first_pos(outputs: dict) -> torch.Tensor:
    return outputs["text_embeds_pos"][0]


@dataclasses.dataclass(frozen=True)
class Wan22TextItems:
    """``Wan22TextEncoderSubmodule``: ``positive_ids`` and, with CFG on, ``negative_ids``, each its own item.

    Each item is computed as the node computes a prompt (one batch-1 umT5 forward on its first ``max_len`` ids; the
    negative runs through the same code as a positive), so a request's outputs equal the node's bit for bit. Keys are
    the truncated ids (what the forward reads), verified on every hit.
    """

    max_len: int
    modality: str = "text"
    walk_sensitive: bool = False  # the node ignores the walk: t2v and i2v share the prompt and the negative

    def items(self, fwd_info, raw_inputs: dict, node_inputs) -> list[Item]:
        out = []
        for name in ("positive_ids", "negative_ids"):
            ids = node_inputs.tensor_inputs.get(name)
            if ids is not None:
                used = ids.reshape(-1)[:self.max_len]
                out.append(Item(digests.prompt(used, {"wan22_text": {"max_len": self.max_len}}),
                                type(node_inputs)(tensor_inputs={"positive_ids": ids}), _first_pos, used))
        return out

    def assemble(self, node_inputs, values: list) -> dict:
        pos = values[0]
        neg = values[1] if len(values) > 1 else pos.new_zeros(1)  # the node's own CFG-off placeholder
        return {"text_embeds_pos": [pos], "text_embeds_neg": [neg]}


# M* 0.2.1's encoder nodes whose output is a function of the request's node inputs alone -> the modality they encode
_WHOLE_REQUEST = {"VisionEncoderSubmodule": "image", "AudioEncoderSubmodule": "audio",  # Qwen3-Omni
                  "WhisperEncoderSubmodule": "audio", "HiggsAudioEncoderSubmodule": "audio",
                  "Pi05ViTEncoderSubmodule": "image", "VJepa2EncoderSubmodule": "video",
                  "Wan22VaeEncoderSubmodule": "image",  # Wan 2.2 i2v: the first frame's latent
                  "Cosmos3VAEEncoderSubmodule": "video",  # Cosmos3: the conditioning image or clip
                  "ViTEncoderSubmodule": "image"}  # BAGEL's SigLIP2 ViT (understanding)

# M* 0.2.1's encoder nodes whose outputs must not be reused, and why
_NOT_REUSED = {"VAEEncoderSubmodule": "BAGEL's VAE encode samples its latent (DiagonalGaussian(sample=True) draws "
                                      "randn each call), so its output is not a function of its input"}


def items_for(node) -> WholeRequest | Wan22TextItems:
    """The ``NodeItems`` of an M* 0.2.1 encoder submodule: Wan 2.2's text encoder (prompt and negative), the nodes of
    ``_WHOLE_REQUEST`` (one item each); InvalidRequest for other nodes (give items yourself)."""
    name = type(node).__name__
    if name == "Wan22TextEncoderSubmodule":
        return Wan22TextItems(int(node.config.text_max_seq_len))
    modality = _WHOLE_REQUEST.get(name)
    if name in _NOT_REUSED:
        raise InvalidRequest(f"{name} is not reused: {_NOT_REUSED[name]}")
    if modality is None:
        raise InvalidRequest(f"no item split known for {name}: pass WholeRequest(modality) or your own NodeItems")
    return WholeRequest(modality)
