"""The base of every cached encoder wrapper: one media reader (``digests.media.media_bytes``), the fingerprint that
names what a module computes (``mmcache.module_fingerprint``), and the lookup through an ``EncoderStore``.

A wrapper turns media into an encoder output. The base holds the store, the fingerprint, the modality, the device
and dtype outputs come back in, and the lookup: ``read`` the media once (a path is read exactly once, so the same
bytes are digested and decoded), ``digest`` it (or take a digest the caller already computed for the page names,
so media is hashed once per request), and ``get_or_compute`` under ``EncoderKey(digest, fingerprint, modality,
salt)``. The salt is per call (a tenant's), defaulting to the one given at construction.

Subclasses define ``digest(data)`` and ``compute(data)`` (the uncached pipeline on read media), and may accept more
than bytes and paths in ``read`` (a PIL image, a waveform) and add verifying ids to the key (``verify_ids``).
"""

from __future__ import annotations

import torch

import digests
from digests.media import media_bytes
from mmcache.encoder_key import EncoderKey, stable_bytes
from mmcache.encoder_pin import Lookup
from mmcache.encoder_store import EncoderStore
from mmcache.errors import InvalidMedia, InvalidRequest


class CachedEncoder:
    """``encoder(media)``: the output for ``media``, through ``store`` when given (``store=None``: the uncached
    pipeline on every call); ``encoder.lookup(media)``: the same as a ``Lookup`` that says whether it hit.

    Invariants: a hit equals the miss that stored it bit for bit; media that cannot be read or decoded raises
    ``InvalidMedia`` and stores nothing; outputs come back on ``device`` whether computed or gathered. On a store
    with tiers the fingerprint must have a process-independent form (``mmcache.encoder_key.stable_bytes``), else
    ``InvalidRequest`` here, at construction.
    """

    modality: str
    media_kind: str = "media"  # how errors name the media ("image", "WAV", ...)

    def __init__(self, store: EncoderStore | None, fingerprint: str, *, salt: bytes = b"",
                 device: torch.device | str, dtype: torch.dtype):
        if store is not None and store.tiers is not None and stable_bytes(fingerprint) is None:
            raise InvalidRequest(f"a store with tiers names outputs outside this process: the fingerprint must be a "
                                 f"str (or bytes, int, tuple of them), got {type(fingerprint).__name__}")
        self.store, self.fingerprint, self.salt = store, fingerprint, salt
        self.device, self.dtype = torch.device(device), dtype

    # -- what subclasses define
    def digest(self, data) -> digests.Digest:
        """The media digest of read media (raw input plus the canonical preprocessing params)."""
        raise NotImplementedError

    def compute(self, data):
        """The uncached pipeline on read media."""
        raise NotImplementedError

    def verify_ids(self, data):
        """Ids the store compares on a hit, beyond the digest (None: the digest alone)."""
        return None

    def read(self, media):
        """``media`` as bytes (a path read once) or a decoded form the subclass accepts; InvalidMedia otherwise."""
        data = media_bytes(media, self.media_kind)
        if data is None:
            raise InvalidMedia(f"cannot encode {type(media).__qualname__} as {self.media_kind}: expected bytes or a "
                               f"path")
        return data

    # -- the lookup, the same for every wrapper
    def key(self, media, *, digest: digests.Digest | None = None, salt: bytes | None = None) -> EncoderKey:
        """The store key of ``media`` (for ``store.pin``); reads and hashes it unless ``digest`` is given, decodes
        nothing."""
        return self._key(self.read(media), digest, salt)

    def lookup(self, media, *, digest: digests.Digest | None = None, salt: bytes | None = None) -> Lookup:
        """The output for ``media`` and where it came from (``"computed"`` with no store). ``digest``: the one the
        caller already took of these bytes (so they are hashed once); ``salt``: the tenant's (default: the
        wrapper's)."""
        data = self.read(media)
        if self.store is None:
            return Lookup(self.compute(data), "computed")
        found = self.store.get_or_compute(self._key(data, digest, salt), lambda: self.compute(data))
        return Lookup(found.value.to(self.device), found.source)

    def __call__(self, media, *, digest: digests.Digest | None = None, salt: bytes | None = None):
        return self.lookup(media, digest=digest, salt=salt).value

    def _key(self, data, digest, salt) -> EncoderKey:
        return EncoderKey(self.digest(data) if digest is None else digest, self.fingerprint, self.modality,
                          self.salt if salt is None else salt, verify_ids=self.verify_ids(data))
