"""One encoder entry as a self-describing payload (host tier and shared store), verified in full before use.

    head ‖ stable name ‖ verify ids ‖ tree ‖ layout ‖ data [‖ keyed MAC]

The head holds the magic (keyless or keyed), the data's byte length, the encoder seconds the entry cost, an xxh3-64
checksum of the whole body (every byte but the checksum's own) and the lengths of the parts after it. The stable
name (``EncoderKey.stable_name``: digest, fingerprint, salt, modality in a process-independent form) and the
verifying ids are the key in full; the tree is the output's container structure (tuple/list/dict, str keys); the
layout names each tensor's dtype and shape and its byte offset. Entries live under ``entry_key(key)``, a 128-bit
hash of the stable name: a nomination only.

``decode`` returns the entry only if the MAC is the key's (with a key), the magic is the expected one, the name and
verifying ids equal the requesting key's, the tree and layout parse exactly, every dtype is one of ``DTYPES``, the
offsets are the ones ``entry_layout`` gives for those shapes and dtypes, the byte length matches and the checksum of
the body is the one stored; anything else is a miss. The checksum catches corruption, not a writer who recomputes it:
against writers outside the trust domain the MAC does (``mmcache.tiers.page_format``: the same key, the same trust
model).
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch
import xxhash

from mmcache.encoder_key import EncoderKey
from mmcache.encoder_layout import StoredBytes, entry_layout
from mmcache.tiers.page_format import MAC_BYTES, mac, unseal

_MAGIC = b"MMCE1\0"
_MAGIC_KEYED = b"MMCF1\0"  # the payload ends in a keyed MAC
_HEAD = struct.Struct("<6sQdQIqII")  # magic, data bytes, compute_s, checksum, name, ids (-1: None), tree, layout
_SUM_AT = struct.calcsize("<6sQd")  # where the checksum lies in the head (zero while the checksum is taken)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_MAX_DEPTH, _MAX_DIMS = 32, 16
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    *(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)))}


def entry_key(key: EncoderKey) -> str:
    """The store key of ``key``'s entry: the same in every process (``EncoderKey.stable_name``)."""
    return f"mmcache/e/{xxhash.xxh3_128_hexdigest(key.stable_name)}"


def encode(entry: StoredBytes, mac_key: bytes | None = None) -> bytearray | None:
    """``entry``'s payload (with ``mac_key``, sealed by a keyed MAC over all of it); None when its tree or a dtype has
    no byte form here (a dict key that is not a str, a dtype outside ``DTYPES``), so it stays on the device only."""
    tree, layout = [], []
    if not _tree_bytes(entry.tree, tree):
        return None
    for shape, dtype, off in entry.layout:
        name = str(dtype).removeprefix("torch.")
        if DTYPES.get(name) is not dtype or len(shape) > _MAX_DIMS:
            return None
        layout.append(bytes([len(name)]) + name.encode() + bytes([len(shape)])
                      + b"".join(_U64.pack(d) for d in shape) + _U64.pack(off))
    tree, layout = b"".join(tree), b"".join(layout)
    data = memoryview(entry.data.detach().cpu().contiguous().numpy()) if entry.nbytes else memoryview(b"")
    ids = entry.key.verify_ids
    name = entry.key.stable_name
    parts = (_HEAD.pack(_MAGIC if mac_key is None else _MAGIC_KEYED, entry.nbytes, float(entry.compute_s), 0,
                        len(name), -1 if ids is None else len(ids), len(tree), len(layout)),
             name, ids or b"", tree, layout, data)
    size = sum(map(len, parts))
    payload = bytearray(size + (0 if mac_key is None else MAC_BYTES))  # the data is copied once, into it
    view, at = memoryview(payload), 0
    for part in parts:
        view[at:at + len(part)] = part
        at += len(part)
    _U64.pack_into(view, _SUM_AT, xxhash.xxh3_64_intdigest(view[:size]))
    if mac_key is not None:
        view[size:] = mac(mac_key, view[:size])
    return payload


def decode(payload, key: EncoderKey, mac_key: bytes | None = None) -> StoredBytes | str:
    """The entry of ``payload`` as ``StoredBytes`` (its data a fresh CPU tensor) if it verifies as ``key``'s in full
    (the module docstring), else why not: ``"mac"`` (a keyed MAC that is not ``mac_key``'s, or a keyless entry for a
    keyed reader) or ``"rejected"`` (any other field)."""
    view = memoryview(payload).cast("B")
    if mac_key is not None:
        view = unseal(view, mac_key)
        if view is None:
            return "mac"
    if len(view) < _HEAD.size:
        return "rejected"
    magic, nbytes, compute_s, checksum, nname, nids, ntree, nlayout = _HEAD.unpack_from(view)
    if magic != (_MAGIC if mac_key is None else _MAGIC_KEYED) or not 0.0 <= compute_s < math.inf:
        return "rejected"
    ids = key.verify_ids
    at = _HEAD.size
    if (nids != (-1 if ids is None else len(ids)) or len(view) != at + nname + max(nids, 0) + ntree + nlayout + nbytes
            or view[at:at + nname] != key.stable_name):
        return "rejected"
    at += nname
    if ids is not None and view[at:at + nids] != ids:
        return "rejected"
    at += max(nids, 0)
    parsed = _parse_tree(view[at:at + ntree])
    layout = _parse_layout(view[at + ntree:at + ntree + nlayout])
    data = view[at + ntree + nlayout:]
    if parsed is None or layout is None or parsed[1] != len(layout):
        return "rejected"
    if entry_layout((s, d) for s, d, _ in layout) != (layout, nbytes) or _checksum(view) != checksum:
        return "rejected"
    fresh = torch.empty(nbytes, dtype=torch.uint8)  # aligned, writable, never aliasing the payload
    if nbytes:
        fresh.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
    return StoredBytes(key, parsed[0], layout, nbytes, compute_s, fresh)


def _checksum(body: memoryview) -> int:
    """xxh3-64 of ``body`` with its checksum field read as zero (as ``encode`` took it)."""
    h = xxhash.xxh3_64(body[:_SUM_AT])
    h.update(bytes(8))
    h.update(body[_SUM_AT + 8:])
    return h.intdigest()


def _tree_bytes(tree, out: list) -> bool:
    """Append the byte form of a tree spec (``mmcache.encoder_layout.flatten``'s) to ``out``; False if it has none."""
    if tree is None:
        out.append(b"T")
        return True
    kind, keys, children = tree
    if kind is dict:
        out.append(b"D" + _U32.pack(len(children)))
        for k, child in zip(keys, children):
            if not isinstance(k, str):
                return False
            k = k.encode("utf-8", "surrogatepass")
            out.append(_U32.pack(len(k)) + k)
            if not _tree_bytes(child, out):
                return False
        return True
    out.append((b"L" if kind is list else b"U") + _U32.pack(len(children)))
    return all(_tree_bytes(child, out) for child in children)


def _parse_tree(view: memoryview):
    """``(tree spec, leaves)`` from exactly ``view``'s bytes, or None."""
    def node(at: int, depth: int):
        if at >= len(view) or depth > _MAX_DEPTH:
            raise ValueError
        tag = bytes(view[at:at + 1])
        if tag == b"T":
            return None, at + 1, 1
        if tag not in (b"D", b"L", b"U") or at + 5 > len(view):
            raise ValueError
        (n,), at = _U32.unpack_from(view, at + 1), at + 5
        if n > len(view) - at:  # every child takes a byte at least
            raise ValueError
        keys, children, leaves = [], [], 0
        for _ in range(n):
            if tag == b"D":
                (k,), at = _U32.unpack_from(view, at), at + 4
                if at + k > len(view):
                    raise ValueError
                keys.append(bytes(view[at:at + k]).decode("utf-8", "surrogatepass"))
                at += k
            child, at, m = node(at, depth + 1)
            children.append(child)
            leaves += m
        kind = {b"D": dict, b"L": list, b"U": tuple}[tag]
        return (kind, tuple(keys) if kind is dict else None, tuple(children)), at, leaves

    try:
        tree, end, leaves = node(0, 0)
    except (ValueError, struct.error, UnicodeDecodeError):
        return None
    return (tree, leaves) if end == len(view) else None


def _parse_layout(view: memoryview) -> tuple | None:
    """``((shape, dtype, offset), ...)`` from exactly ``view``'s bytes, or None."""
    out, at = [], 0
    try:
        while at < len(view):
            n = view[at]
            dtype = DTYPES.get(bytes(view[at + 1:at + 1 + n]).decode("ascii"))
            at += 1 + n
            ndim = view[at]
            if dtype is None or ndim > _MAX_DIMS:
                return None
            shape = struct.unpack_from(f"<{ndim}Q", view, at + 1)
            (off,), at = _U64.unpack_from(view, at + 1 + 8 * ndim), at + 9 + 8 * ndim
            out.append((tuple(shape), dtype, off))
    except (IndexError, struct.error, UnicodeDecodeError):
        return None
    return tuple(out)
