"""The base of every cached encoder wrapper: one media reader, the fingerprint that names what a module computes, and
the lookup through an ``EncoderStore``.

A wrapper turns media into an encoder output. The base holds the store, the fingerprint, the modality, the device
and dtype outputs come back in, and the lookup: ``read`` the media once (a path is read exactly once, so the same
bytes are digested and decoded), ``digest`` it (or take a digest the caller already computed for the page names,
so media is hashed once per request), and ``get_or_compute`` under ``EncoderKey(digest, fingerprint, modality,
salt)``. The salt is per call (a tenant's), defaulting to the one given at construction.

Subclasses define ``digest(data)`` and ``compute(data)`` (the uncached pipeline on read media), and may accept more
than bytes and paths in ``read`` (a PIL image, a waveform) and add verifying ids to the key (``verify_ids``).
"""

from __future__ import annotations

import os

import torch
import xxhash
from torch import nn

import digests
from mmcache.encoder_key import EncoderKey, stable_bytes
from mmcache.encoder_store import EncoderStore, Lookup
from mmcache.errors import InvalidMedia, InvalidRequest


def module_fingerprint(module: nn.Module) -> str:
    """``Class/hash/dtype/device type`` naming what ``module`` computes: equal fingerprints give equal outputs.

    The hash (xxh3-128) covers every tensor of the state dict (name, dtype, shape, bytes), the canonical config and
    the attention backend (``config._attn_implementation``: sdpa and eager differ in the last bits). All the bytes,
    not a sample: two checkpoints that differ in a single weight never share an entry. That is one pass over the
    weights at construction (about 0.1 s per GB on a CPU); pass a ``fingerprint`` string to the wrapper instead for
    weights on the meta device (sequential offload) or too large to read. Taken once: weights changed in place later
    keep the old fingerprint, so build a new wrapper after changing them. Configs that differ only in fields without
    effect (e.g. ``architectures``) give different fingerprints: a needless miss, never a wrong hit.
    """
    h = xxhash.xxh3_128()
    config = getattr(module, "config", None)
    h.update(digests.canonical({"config": config, "attn": getattr(config, "_attn_implementation", None)}))
    for name, t in module.state_dict().items():
        if t.device.type == "meta":
            raise ValueError(f"{name} of {type(module).__name__} is on the meta device (offloaded): its weights "
                             f"cannot be hashed, pass fingerprint= to the wrapper")
        t = t.detach().cpu().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # via uint8: bfloat16 has no numpy dtype
    p = next(module.parameters())
    return f"{type(module).__name__}/{h.hexdigest()}/{str(p.dtype).removeprefix('torch.')}/{p.device.type}"


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
