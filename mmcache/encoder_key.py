"""EncoderKey: the exact name of one encoder output."""

from __future__ import annotations

import dataclasses
from typing import Hashable

import numpy as np

from mmcache.errors import InvalidRequest


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
