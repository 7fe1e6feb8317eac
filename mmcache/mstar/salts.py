"""A request's tenant salt, from the request to the keys of M*'s encoder nodes (requests with different salts never
share an output).

The salt is ``model_kwargs["mmcache_salt"]`` (bytes or str) of the request as the API server hands it on. M* 0.2.1
sends ``model_kwargs`` to the data worker and to the conductor, never to the workers: a node sees only the
``step_metadata`` its model's schedule writes. So the salt reaches the keys two ways, each from outside M*'s code:

- media items (keyed by a digest the data worker carried, ``media_digests``): the data worker folds the salt into
  the digest it sends (``salted_digest``), so the key needs nothing else and the decode-skip oracle, which asks with
  the same digest, agrees with the node by construction;
- every other item (Wan 2.2's prompt ids, a digest of the node's own inputs): ``route_salt(model)`` on the
  conductor's model instance copies the salt into each forward pass's ``step_metadata``, where the node reads it.
"""

from __future__ import annotations

import functools

import digests
from mmcache.errors import InvalidRequest

SALT_KEY = "mmcache_salt"


def request_salt(entries, where: str) -> bytes:
    """The tenant salt under ``SALT_KEY`` in ``entries`` (model_kwargs or step_metadata; may be None) as bytes;
    InvalidRequest for another type."""
    salt = (entries or {}).get(SALT_KEY, b"")
    if isinstance(salt, str):
        salt = salt.encode()
    if not isinstance(salt, (bytes, bytearray)):
        raise InvalidRequest(f"{where}[{SALT_KEY!r}] must be bytes or str, got {type(salt).__name__}")
    return bytes(salt)


def salted_digest(digest: bytes, salt: bytes) -> bytes:
    """The 16 bytes that travel for a media item: ``digest`` itself without a salt, else a 128-bit digest of the salt
    and the digest (distinct salts give unrelated values)."""
    if not salt:
        return bytes(digest)[:16]
    return bytes(digests.digest.compute(b"mmcache-tenant-salt\0" + salt, [bytes(digest)]))[:16]


def route_salt(model) -> None:
    """Make M* model instance ``model`` (the conductor's) put the request's salt into every forward pass's
    ``step_metadata``: the first pass reads it from ``model_kwargs``, later passes from the partition's metadata
    (the conductor merges each pass's ``step_metadata`` into it). Idempotent; the class is untouched."""
    if getattr(model, "_mmcache_routes_salt", False):
        return
    initial, later = model.get_initial_forward_pass_args, model.get_partition_forward_pass_args

    @functools.wraps(initial)
    def get_initial_forward_pass_args(*args, model_kwargs=None, **kwargs):
        salt = request_salt(model_kwargs, "model_kwargs")
        out = initial(*args, model_kwargs=model_kwargs, **kwargs)
        if salt:
            out.step_metadata[SALT_KEY] = salt
        return out

    @functools.wraps(later)
    def get_partition_forward_pass_args(partition_name, partition_metadata, *args, **kwargs):
        salt = request_salt(partition_metadata.kwargs, "partition metadata")
        out = later(partition_name, partition_metadata, *args, **kwargs)
        if salt:
            out.step_metadata[SALT_KEY] = salt
        return out

    model.get_initial_forward_pass_args = get_initial_forward_pass_args
    model.get_partition_forward_pass_args = get_partition_forward_pass_args
    model._mmcache_routes_salt = True
