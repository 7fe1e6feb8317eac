"""Canonical JSON for preprocessor parameters: equal settings give equal bytes on every machine and run."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
from collections.abc import Mapping

import numpy as np

from digests.errors import InvalidMedia

# init_kwargs entries that describe where and how a tokenizer was loaded, not what it does; they differ per machine.
_LOCAL_KWARGS = frozenset({"name_or_path", "is_local", "local_files_only", "cache_dir", "token", "use_auth_token"})


class Canonical(bytes):
    """Parameters already in canonical form; passed as ``params`` they are used verbatim (skips ``to_dict()``)."""


def canonical(params) -> Canonical:
    """Canonical JSON of ``params``: sorted keys, compact separators, keys starting with "_" dropped at every level.

    ``params`` may be None, a Mapping, an object with ``to_dict()`` (an HF processor or feature extractor), a
    tokenizer, or any nesting of these with JSON-like values. Enums become their value (``resample=3`` and
    ``Resampling.BICUBIC`` are the same setting), numpy/torch scalars and arrays become Python numbers and lists,
    dtypes become strings. Anything else raises InvalidMedia rather than being silently left out.
    """
    if isinstance(params, Canonical):
        return params
    try:
        plain = _plain(params)
    except TypeError as e:
        raise InvalidMedia(f"params cannot be canonicalised: {e}") from None
    return Canonical(json.dumps(plain, sort_keys=True, separators=(",", ":")).encode())


def _plain(x):
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, enum.Enum):  # before int: IntEnum's str() differs between Python 3.10 and 3.11
        return _plain(x.value)
    if isinstance(x, (int, float)):
        return x
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted((_plain(v) for v in x), key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(x, (np.generic, np.ndarray)):
        return _plain(x.tolist()) if x.dtype.kind in "biuf" else _unsupported(x)
    if isinstance(x, np.dtype):
        return str(x)
    if isinstance(x, (bytes, bytearray)):
        return x.hex()
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(x, torch.Tensor):
            return _plain(x.tolist())
        if isinstance(x, torch.dtype):
            return str(x)
    if callable(getattr(x, "to_dict", None)):
        return _plain(x.to_dict())
    if hasattr(x, "init_kwargs") and hasattr(x, "name_or_path"):
        return _tokenizer(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _plain({f.name: getattr(x, f.name) for f in dataclasses.fields(x)})
    return _unsupported(x)


def _unsupported(x):
    raise TypeError(f"{type(x).__module__}.{type(x).__qualname__} is not JSON-able: {x!r:.80}")


def _tokenizer(tok) -> dict:
    """A tokenizer's identity: class, name_or_path, vocabulary sizes and the JSON-able part of its init_kwargs."""
    kwargs = {}
    for k, v in tok.init_kwargs.items():
        if k in _LOCAL_KWARGS or k.endswith(("_file", "_files")):  # resolved file paths are machine-local
            continue
        try:
            kwargs[k] = _plain(v)
        except TypeError:  # e.g. AddedToken objects; their effect shows in len(tok)
            pass
    return {
        "class": type(tok).__name__,
        "name_or_path": str(tok.name_or_path),
        "vocab_size": getattr(tok, "vocab_size", None),
        "len": len(tok) if hasattr(tok, "__len__") else None,
        "init_kwargs": kwargs,
    }
