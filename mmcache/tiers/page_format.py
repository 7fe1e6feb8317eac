"""The wire format of a page in a store shared by instances: its key, its self-describing payload and the check of
every field against what the reading instance expects (``mmcache.tiers.store``: the ``StoreTier`` that moves them).

    head ‖ fingerprint ‖ salt ‖ layout ‖ token ids (int32) ‖ page bytes [‖ keyed MAC]

The head (``HEAD``) holds the magic (keyless or keyed), the page's chain name, depth and size, the lengths of the
parts after it, the lineage of its parent (``mmcache.tiers.lineage``), its 128-bit media id and an xxh3-64 checksum of
the page bytes. A keyed payload ends in a BLAKE2b MAC (``MAC_BYTES``) over all of it, under a deployment key
(``check_key``); ``mmcache.tiers.encoder_entry`` seals encoder entries with the same ``mac`` and ``unseal``.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import xxhash

from mmcache.errors import InvalidRequest
from mmcache.names import Fingerprint

_MAGIC = b"MMCP1\0"
_MAGIC_KEYED = b"MMCA1\0"  # the payload ends in a keyed MAC
MAC_BYTES = 32
HEAD = struct.Struct("<6sQIIIII16s16sQ")  # magic, name, depth, page_size, fp, salt, layout lengths, plin, media, sum


def page_key(name: int) -> str:
    """Where the page of chain name ``name`` lies in the store: a nomination only (``verify_page`` decides)."""
    return f"mmcache/{int(name):016x}"


def layout_of(page_shape, dtype) -> bytes:
    """The page layout a payload carries (dtype and shape): a reader serves only pages laid out as its own."""
    return f"{str(dtype).removeprefix('torch.')}{tuple(page_shape)}".encode()


def check_key(key: bytes | None) -> bytes | None:
    """A deployment key for the MAC: None, or 16 to 64 bytes (BLAKE2b's key range, a floor against guessable keys)."""
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or not 16 <= len(key) <= 64:
        raise InvalidRequest("a store key must be 16 to 64 bytes")
    return bytes(key)


def mac(key: bytes, body) -> bytes:
    """The keyed BLAKE2b MAC of ``body`` (``MAC_BYTES`` bytes), what a keyed payload ends in."""
    return hashlib.blake2b(body, key=key, digest_size=MAC_BYTES).digest()


def encode_page(fp_bytes: bytes, salt: bytes, layout: bytes, name: int, depth: int, tokens: np.ndarray,
                media: np.ndarray, parent_lineage: bytes, data: bytes, key: bytes | None = None) -> bytes:
    """One page's payload: header, fingerprint, salt, layout, token ids (int32), the page bytes, then with ``key``
    a keyed MAC over all of that."""
    head = HEAD.pack(_MAGIC if key is None else _MAGIC_KEYED, int(name), depth, tokens.size, len(fp_bytes),
                      len(salt), len(layout), parent_lineage, media.astype(np.uint64).tobytes(),
                      xxhash.xxh3_64_intdigest(data))
    body = b"".join((head, fp_bytes, salt, layout, tokens.astype(np.int32).tobytes(), data))
    return body if key is None else body + mac(key, body)


def unseal(payload: bytes, key: bytes) -> memoryview | None:
    """The body of a keyed ``payload`` if its MAC is the key's (compared in constant time), else None."""
    if len(payload) < HEAD.size + MAC_BYTES:
        return None
    view = memoryview(payload)
    body = view[:-MAC_BYTES]
    return body if hmac.compare_digest(mac(key, body), view[-MAC_BYTES:]) else None


class Expected:
    """What an instance expects of every page it reads: its fingerprint, salt, layout and page bytes."""

    def __init__(self, fingerprint: Fingerprint, salt: bytes, page_shape, dtype, page_bytes: int):
        self.fp_bytes = repr(fingerprint).encode()
        self.salt, self.layout, self.page_bytes = bytes(salt), layout_of(page_shape, dtype), page_bytes
        self.page_size = fingerprint.page_size


def verify_page(payload, want: Expected, name: int, depth: int, tokens: np.ndarray, media: np.ndarray,
                parent_lineage: bytes, keyed: bool = False) -> memoryview | None:
    """The page bytes of ``payload`` (a keyed entry's body once ``unseal`` passed it: ``keyed``) if every verifying
    field equals the request's, else None (a miss)."""
    if len(payload) < HEAD.size:
        return None
    magic, pname, pdepth, psize, nfp, nsalt, nlay, plin, pmedia, checksum = HEAD.unpack_from(payload)
    if (magic != (_MAGIC_KEYED if keyed else _MAGIC) or pname != int(name) or pdepth != depth
            or psize != want.page_size or plin != parent_lineage or pmedia != media.astype(np.uint64).tobytes()):
        return None
    view = memoryview(payload)
    a = HEAD.size
    parts = []
    for n in (nfp, nsalt, nlay, psize * 4):
        parts.append(view[a:a + n])
        a += n
    fp, salt, layout, toks = parts
    data = view[a:]
    if (bytes(fp) != want.fp_bytes or bytes(salt) != want.salt or bytes(layout) != want.layout
            or len(data) != want.page_bytes or bytes(toks) != tokens.astype(np.int32).tobytes()
            or xxhash.xxh3_64_intdigest(data) != checksum):
        return None
    return data
