"""The Digest value and the hash functions behind it.

Every digest is ``H(len(header) as u64-le ‖ header ‖ payload)``: the header is canonical JSON (modality, params,
and for decoded inputs their shape), the payload the raw bytes. The length prefix makes the split unambiguous, so
two different (header, payload) pairs can only meet by a hash collision.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import xxhash

from digests.errors import InvalidMedia, InvalidRequest

CHUNK = 1 << 20
DEFAULT = "xxh3_128"
# blake2b at 32 bytes: the cryptographic option exists for adversarial tenants, and a 16-byte output would give
# only 2^64 collision resistance (birthday bound); 32 bytes costs nothing extra, blake2b's speed is size-independent.
_HASHERS = {
    "xxh3_128": xxhash.xxh3_128,
    "blake2b": partial(hashlib.blake2b, digest_size=32),
    "sha256": hashlib.sha256,
}
ALGORITHMS = tuple(_HASHERS)


@dataclass(frozen=True, slots=True)
class Digest:
    """An immutable media digest; equal only to a digest of the same algorithm with the same bytes."""

    algorithm: str
    value: bytes

    def __bytes__(self) -> bytes:
        return self.value

    def __int__(self) -> int:
        return int.from_bytes(self.value, "big")

    def hex(self) -> str:
        return self.value.hex()

    def __repr__(self) -> str:
        return f"Digest({self.algorithm!r}, {self.value.hex()!r})"


def hasher(algorithm: str = DEFAULT):
    """A fresh streaming hasher (``update``/``digest``) for one of ``ALGORITHMS``."""
    try:
        return _HASHERS[algorithm]()
    except (KeyError, TypeError):
        raise InvalidRequest(f"unknown digest algorithm {algorithm!r}; expected one of {ALGORITHMS}") from None


def update_from_file(h, path: str | os.PathLike) -> None:
    """Feed a file into ``h`` in CHUNK-sized reads through one reused buffer: memory stays O(CHUNK)."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        f = open(path, "rb")
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise InvalidMedia(f"cannot read media file {os.fspath(path)!r}: {getattr(e, 'strerror', None) or e}") from e
    with f:
        while n := f.readinto(buf):
            h.update(view[:n])


def compute(header: bytes, payload: Iterable, algorithm: str = DEFAULT) -> Digest:
    """Hash ``header`` (length-prefixed) then each payload part: a bytes-like object or an ``os.PathLike`` to stream."""
    h = hasher(algorithm)
    h.update(len(header).to_bytes(8, "little"))
    h.update(header)
    for part in payload:
        if isinstance(part, os.PathLike):
            update_from_file(h, part)
        else:
            h.update(part)
    return Digest(algorithm, h.digest())
