"""The events mmcache publishes, as typed structs, and their two encodings on the wire.

KV events are vLLM's (``vllm/distributed/kv_events.py``): msgspec structs tagged by class name, ``omit_defaults``.
vLLM encoded them as positional arrays (``array_like``) until its PR #42892 made each event a map keyed by field name
with the tag under ``"type"``; the batch around them stays a positional array in both. Field order and defaults here
are vLLM's, so one description gives both encodings:

- ``"array"``: ``[tag, field_1, ..., field_n]`` with the trailing fields that equal their default left off;
- ``"map"``: ``{"type": tag, field: value, ...}`` with every field that has no default, and each defaulted field only
  when it differs from its default.

Encoder-output events are mmcache's own (no engine defines them), encoded the same two ways; they travel under their
own topic (``mmcache.events.publisher``), so a KV consumer that filters by topic never meets them.
Invariant: ``decode_event(encode_event(e, enc)) == e`` for every event and both encodings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

ENCODINGS = ("map", "array")
_NO_DEFAULT = dataclasses.MISSING


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStored:
    """Pages ``block_hashes`` (a chain: each the child of the one before, the first a child of ``parent_block_hash``)
    entered the cache: their token ids concatenated, the page size, and per page its extra keys (vLLM's: media
    ``(identifier, offset of the item's first placeholder relative to the page's first token)`` for every item the
    page overlaps, then the tenant salt as a bare string on a chain's first page; None for a page with neither)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    TAG: ClassVar[str] = "BlockStored"


@dataclasses.dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Pages ``block_hashes`` left the cache (evicted or discarded)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    TAG: ClassVar[str] = "BlockRemoved"


@dataclasses.dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every page left the cache."""

    TAG: ClassVar[str] = "AllBlocksCleared"


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderOutputStored:
    """An encoder's output for one media item entered the encoder store: ``identifier`` is the item's media identifier
    as it rides in ``BlockStored.extra_keys``, ``digest`` the media digest in hex, ``encoder`` the encoder fingerprint
    as text, ``cache_salt`` the tenant salt as the KV events write it (None: unsalted), ``nbytes`` the output's size."""

    identifier: str
    digest: str
    encoder: str
    modality: str
    nbytes: int
    cache_salt: str | None = None
    medium: str | None = None
    TAG: ClassVar[str] = "EncoderOutputStored"


@dataclasses.dataclass(frozen=True, slots=True)
class EncoderOutputRemoved:
    """The encoder output stored under (``identifier``/``digest``, ``encoder``, ``modality``, ``cache_salt``) left the
    encoder store (evicted, replaced or cleared)."""

    identifier: str
    digest: str
    encoder: str
    modality: str
    cache_salt: str | None = None
    medium: str | None = None
    TAG: ClassVar[str] = "EncoderOutputRemoved"


KV_EVENTS = (BlockStored, BlockRemoved, AllBlocksCleared)
ENCODER_EVENTS = (EncoderOutputStored, EncoderOutputRemoved)
Event = BlockStored | BlockRemoved | AllBlocksCleared | EncoderOutputStored | EncoderOutputRemoved
_BY_TAG = {cls.TAG: cls for cls in KV_EVENTS + ENCODER_EVENTS}
_FIELDS = {cls: tuple((f.name, f.default) for f in dataclasses.fields(cls)) for cls in _BY_TAG.values()}


class WireError(ValueError):
    """A payload that is not a batch of these events."""


def encode_event(event: Event, encoding: str) -> list | dict:
    """``event`` as the msgpack-ready array or map of ``encoding`` (see the module docstring)."""
    fields = _FIELDS[type(event)]
    values = [getattr(event, name) for name, _ in fields]
    if encoding == "array":
        n = len(values)
        while n and fields[n - 1][1] is not _NO_DEFAULT and values[n - 1] == fields[n - 1][1]:
            n -= 1
        return [event.TAG, *values[:n]]
    if encoding == "map":
        out: dict[str, Any] = {"type": event.TAG}
        for (name, default), value in zip(fields, values):
            if default is _NO_DEFAULT or value != default:
                out[name] = value
        return out
    raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")


def decode_event(raw: Any) -> Event:
    """An event from its array or map form: fields by position or by name, trailing or absent defaulted fields at
    their defaults, unknown keys and extra trailing elements ignored (as msgspec does); ``WireError`` otherwise."""
    if isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        tag, values = raw[0], list(raw[1:])
        cls = _BY_TAG.get(tag)
        if cls is None:
            raise WireError(f"unknown event tag {tag!r}")
        fields = _FIELDS[cls]
        kwargs = dict(zip((name for name, _ in fields), values))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        cls = _BY_TAG.get(raw["type"])
        if cls is None:
            raise WireError(f"unknown event tag {raw['type']!r}")
        fields = _FIELDS[cls]
        kwargs = {name: raw[name] for name, _ in fields if name in raw}
    else:
        raise WireError(f"not a tagged event: {raw!r:.80}")
    missing = [name for name, default in fields if default is _NO_DEFAULT and name not in kwargs]
    if missing:
        raise WireError(f"{cls.TAG} lacks {', '.join(missing)}")
    if "extra_keys" in kwargs and kwargs["extra_keys"] is not None:  # msgpack gives lists; the struct says tuples
        kwargs["extra_keys"] = [None if k is None else tuple(tuple(x) if isinstance(x, list) else x for x in k)
                                for k in kwargs["extra_keys"]]
    return cls(**kwargs)
