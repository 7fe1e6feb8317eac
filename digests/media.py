"""Digests of media and prompts: H(modality ‖ canonical params ‖ raw input), never decoding anything.

Invariants: equal inputs and params give equal digests on any machine and run; a changed parameter, a different
modality or a different algorithm gives a different digest; a file, its path and its bytes digest the same; a
decoded input (PIL image, array, waveform) carries a ``decoded`` entry in the header, so it never equals the digest
of any file, even one whose bytes happen to match its pixel buffer.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from digests.canonical import canonical
from digests.digest import DEFAULT, Digest, compute
from digests.errors import InvalidMedia

_VERSION = 1


def image(data, params=None, *, algorithm: str = DEFAULT) -> Digest:
    """Digest of an image file (bytes or path), or of a decoded PIL image (mode, size, pixels) or array."""
    return _media("image", data, params, algorithm)


def audio(data, params=None, *, algorithm: str = DEFAULT) -> Digest:
    """Digest of an audio file (bytes or path), or of a waveform: a torch/numpy array with its sample rate, given as
    ``(waveform, sample_rate)`` or as ``sampling_rate`` in ``params``; dtype, shape and rate enter the digest."""
    return _media("audio", data, params, algorithm)


def video(data, params=None, *, algorithm: str = DEFAULT) -> Digest:
    """Digest of a video file (bytes or path) or decoded frames (an array), with the frame sampling params."""
    return _media("video", data, params, algorithm)


def prompt(token_ids, params=None, *, algorithm: str = DEFAULT) -> Digest:
    """Digest of a 1-D sequence of integer token ids as little-endian int64, plus params (e.g. a tokenizer, or a
    mapping holding one and settings such as ``max_length``). The same ids as a list, numpy or torch digest equal."""
    ids = _token_array(token_ids)
    if ids.ndim != 1:
        raise InvalidMedia(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise InvalidMedia(f"token ids must be integers, got dtype {ids.dtype}")
    if ids.dtype.kind == "u" and ids.size and ids.max() > np.iinfo(np.int64).max:
        raise InvalidMedia("token ids do not fit in int64")
    return compute(_header("prompt", canonical(params)), [ids.astype("<i8")], algorithm)


def _media(modality: str, data, params, algorithm: str) -> Digest:
    params = canonical(params)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return compute(_header(modality, params), [_contiguous(data)], algorithm)
    if isinstance(data, (str, os.PathLike)):
        return compute(_header(modality, params), [Path(data)], algorithm)
    pil = sys.modules.get("PIL.Image")  # a PIL image implies PIL is imported; digesting bytes never imports it
    if modality == "image" and pil is not None and isinstance(data, pil.Image):
        return _pil_image(data, params, algorithm)
    if modality == "audio":
        data, rate = _waveform_and_rate(data, params)
        meta, buf = _array(data)
        return compute(_header(modality, params, {**meta, "sampling_rate": rate}), [buf], algorithm)
    if _is_array(data):
        meta, buf = _array(data)
        return compute(_header(modality, params, meta), [buf], algorithm)
    raise InvalidMedia(f"cannot digest {type(data).__qualname__} as {modality}: expected bytes, a path"
                       f"{', a PIL image' if modality == 'image' else ''} or an array")


def _header(modality: str, params: bytes, decoded: dict | None = None) -> bytes:
    # params is already canonical JSON: splice it in rather than parse and re-serialise it
    head = {"v": _VERSION, "modality": modality} | ({"decoded": decoded} if decoded is not None else {})
    return json.dumps(head, sort_keys=True, separators=(",", ":"))[:-1].encode() + b',"params":' + params + b"}"


def _contiguous(data) -> memoryview:
    """The buffer's bytes in C order, without a copy unless the view is strided."""
    view = memoryview(data)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _pil_image(img, params: bytes, algorithm: str) -> Digest:
    meta = {"kind": "pil", "mode": img.mode, "size": list(img.size)}
    if img.mode in ("P", "PA"):
        meta["palette"] = img.getpalette()
    if "transparency" in img.info:
        meta["transparency"] = json.loads(canonical(img.info["transparency"]))
    try:
        pixels = img.tobytes()
    except (OSError, ValueError) as e:
        raise InvalidMedia(f"PIL image cannot be read: {e}") from e
    return compute(_header("image", params, meta), [pixels], algorithm)


def _waveform_and_rate(data, params: bytes):
    if isinstance(data, tuple) and len(data) == 2:
        data, rate = data
    else:
        rate = json.loads(params).get("sampling_rate") if params.startswith(b"{") else None
    if not _is_array(data):
        raise InvalidMedia(
            f"cannot digest {type(data).__qualname__} as audio: expected bytes, a path, or a waveform array")
    if rate is None:
        raise InvalidMedia("a waveform needs its sample rate: pass (waveform, rate) or params with sampling_rate")
    if isinstance(rate, float) and rate.is_integer():
        rate = int(rate)
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate <= 0:
        raise InvalidMedia(f"sample rate must be a positive integer, got {rate!r}")
    return data, int(rate)


def _is_array(x) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(x, np.ndarray) or (torch is not None and isinstance(x, torch.Tensor))


def _token_array(x) -> np.ndarray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise InvalidMedia(f"token ids must be integers, got {x.dtype}")
        return x.numpy()
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidMedia(f"token ids must be integers: {e}") from None
    if arr.size == 0:
        return arr.astype(np.int64)
    return arr


def _array(x) -> tuple[dict, np.ndarray]:
    """(dtype and shape, contiguous little-endian bytes) of a numpy array or torch tensor; equal values in numpy and
    torch of the same dtype give the same pair."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        meta = {"kind": "array", "dtype": str(x.dtype).removeprefix("torch."), "shape": list(x.shape)}
        return meta, x.reshape(-1).view(torch.uint8).numpy()  # via uint8: bfloat16 has no numpy dtype
    if x.dtype.kind not in "biufc":
        raise InvalidMedia(f"cannot digest an array of dtype {x.dtype}")
    x = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<"))
    return {"kind": "array", "dtype": x.dtype.name, "shape": list(x.shape)}, x.reshape(-1).view(np.uint8)


def media_bytes(data, kind: str) -> bytes | None:
    """``data`` as immutable bytes, a path read exactly once (the same bytes are then digested and decoded, so a file
    rewritten in between can never store one input's output under another's digest); None if it is neither."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    if isinstance(data, (str, os.PathLike)):
        try:
            with open(data, "rb") as f:
                return f.read()
        except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
            raise InvalidMedia(f"cannot read {kind} file {os.fspath(data)!r}: {e}") from e
    return None
