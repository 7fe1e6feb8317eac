"""EncoderKey: the exact name of one encoder output, and the process-independent bytes that name it outside the
process (the key a shared store files it under, and what a tier entry is verified against)."""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Hashable

import numpy as np

from mmcache.errors import InvalidRequest

_LEN = struct.Struct("<Q")


def stable_bytes(value) -> bytes | None:
    """A byte form of ``value`` that every process gives alike, or None when it has none.

    Defined for str, bytes, int, bool, float, None and tuples of them (what fingerprints are: ``module_fingerprint``
    strings, M*'s ``(fingerprint, split)`` tuples): each part tagged with its type and length-prefixed, so two
    distinct values never share bytes. Anything else (an object whose hash is its id, a class instance) is None:
    its ``hash`` names it only inside this process."""
    if isinstance(value, bool):
        return b"?1" if value else b"?0"
    if isinstance(value, str):
        value = value.encode("utf-8", "surrogatepass")
        return b"s" + _LEN.pack(len(value)) + value
    if isinstance(value, bytes):
        return b"b" + _LEN.pack(len(value)) + value
    if isinstance(value, int):
        text = str(value).encode()
        return b"i" + _LEN.pack(len(text)) + text
    if isinstance(value, float):
        return b"f" + struct.pack("<d", value)
    if value is None:
        return b"n"
    if isinstance(value, tuple):
        parts = [stable_bytes(v) for v in value]
        if any(p is None for p in parts):
            return None
        return b"t" + _LEN.pack(len(parts)) + b"".join(parts)
    return None


@dataclasses.dataclass(frozen=True)
class EncoderKey:
    """One encoder output: media digest × encoder fingerprint × tenant salt × modality, plus optional verifying ids.

    ``digest`` is anything ``bytes()`` accepts (bytes, a ``digests.Digest``); ``fingerprint`` is any hashable that
    identifies the encoder exactly (weights, dtype, device type). The store indexes entries by ``name``; ``verify_ids``
    (e.g. a text encoder's token ids; kept as int64 bytes, and bytes given are taken as already encoded) travel with
    the entry and are compared on every hit, so a digest collision costs a miss, never a wrong answer.
    """

    digest: bytes
    fingerprint: Hashable
    modality: str
    salt: bytes = b""
    verify_ids: bytes | None = None

    def __post_init__(self):
        try:
            digest = None if isinstance(self.digest, (int, str)) else bytes(self.digest)
        except TypeError:
            digest = None
        if not digest:
            raise InvalidRequest(f"a digest must be non-empty bytes-like, got {type(self.digest).__name__}")
        if not isinstance(self.salt, (bytes, bytearray)):
            raise InvalidRequest(f"salt must be bytes, got {type(self.salt).__name__}")
        if not isinstance(self.modality, str) or not self.modality:
            raise InvalidRequest(f"modality must be a non-empty string, got {self.modality!r}")
        try:
            hash(self.fingerprint)
        except TypeError:
            raise InvalidRequest(f"fingerprint must be hashable, got {type(self.fingerprint).__name__}") from None
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "salt", bytes(self.salt))
        if self.verify_ids is not None and not isinstance(self.verify_ids, bytes):
            ids = self.verify_ids
            ids = np.asarray(ids.detach().cpu() if hasattr(ids, "detach") else ids).reshape(-1)
            if ids.size and ids.dtype.kind not in "iu":
                raise InvalidRequest(f"verify_ids must be integers, got dtype {ids.dtype}")
            object.__setattr__(self, "verify_ids", ids.astype(np.int64).tobytes())

    @property
    def name(self) -> tuple:
        """What the store indexes by: everything but the verifying ids."""
        return self.digest, self.fingerprint, self.salt, self.modality

    @functools.cached_property
    def stable_name(self) -> bytes:
        """``name`` as bytes every process gives alike (``stable_bytes`` of digest, fingerprint, salt, modality): what
        a tier files the entry under and verifies it by. ``InvalidRequest`` when the fingerprint has no stable form,
        so it cannot name an output outside this process."""
        fp = stable_bytes(self.fingerprint)
        if fp is None:
            raise InvalidRequest(f"a tiered encoder store needs fingerprints of str, bytes, int, float, bool, None or "
                                 f"tuples of them (their bytes are the same in every process), got "
                                 f"{type(self.fingerprint).__name__}")
        return stable_bytes((self.digest, self.salt, self.modality)) + fp
