"""Each media file of a request read once: the bytes that are digested are the bytes M*'s loaders decode.

M*'s loaders (``Model.load_image``/``load_audio``/``load_video``) take a path and read the file themselves; a digest
taken from a second read of that path could name bytes other than the ones decoded (a file rewritten between the two
reads would store one input's output under another's digest). ``read_request_files`` reads each file once;
``decode_from(loader, data, device)`` runs the model's own loader on exactly those bytes:

- M*'s base loaders decode from memory, with the same code they run on a path: ``torchvision.io.decode_image``
  takes a uint8 byte tensor as it takes a path (a path is read into that tensor first), and torchcodec's
  ``AudioDecoder``/``VideoDecoder`` take bytes as they take a path;
- any other loader (a model's override, e.g. Qwen3-Omni's ``load_video``) gets a private snapshot of the bytes: a
  file only this process writes, removed after the call.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

_BASE_SOURCE = {  # M*'s base loader -> how its decoder takes the bytes instead of the path
    "load_image": lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8),
    "load_audio": bytes,
    "load_video": bytes,
}


def read_request_files(file_paths: dict[str, list] | None) -> dict[tuple[str, str], bytes]:
    """``{(modality, path): bytes}``: every file of a request read once (a path given twice is read once)."""
    out = {}
    for modality, paths in (file_paths or {}).items():
        for path in paths:
            key = (modality, os.fspath(path))
            if key not in out:
                out[key] = Path(path).read_bytes()
    return out


def _base_loader(loader) -> str | None:
    """The name of the M* base ``Model`` loader ``loader`` is (bound to a model that does not override it), else
    None."""
    from mstar.model.base import Model
    func = getattr(loader, "__func__", None)
    name = getattr(func, "__name__", None)
    return name if name in _BASE_SOURCE and func is getattr(Model, name) else None


def decode_from(loader, data: bytes, device, suffix: str = ""):
    """``loader``'s result (a ``TensorAndMetadata``) for a file holding ``data``, without reading any file that
    another process could change: from memory for M*'s base loaders, else from a private snapshot (``suffix`` keeps
    the extension, which some decoders use to pick a format)."""
    name = _base_loader(loader)
    if name is not None:
        return loader(_BASE_SOURCE[name](data), device)
    fd, path = tempfile.mkstemp(suffix=suffix, prefix="mmcache-media-")  # mode 0600, a name no one else holds
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return loader(path, device)
    finally:
        os.unlink(path)
