"""Consumers of KV events, written from their documented formats (never their code), for the tests to decode with.

- ``vllm_structs(array_like)``: vLLM's event structs (``vllm/distributed/kv_events.py``) as msgspec structs: the batch
  positional, events tagged by class name with ``omit_defaults``, positional (``array_like``, vLLM before PR #42892)
  or maps (after it); unknown fields refused, stricter than vLLM.
- ``vllm_strict(payload)``: the same structs checked by hand on plain msgpack (no msgspec needed).
- ``dynamo_decode(payload, block_size)``: Dynamo's ``zmq_wire``: the batch a 3-tuple ``(f64, events, Option<i32>)``,
  events as tagged maps or sequences, each extra key one of an untagged union (string, [string, int], bytes, int,
  float, bool) or the whole batch fails; media read only from 64-hex-digit identifiers (first 16 digits as u64);
  group_idx other than 0 or a kind other than full/MLA/sink attention ignored; blocks of another size not published.
- ``llmd_decode(payload)``: llm-d's vLLM adapter: the batch positional, a map event normalized to vLLM's positional
  layout (llm-d-kv-cache #661), extra keys parsed as ``[hash, offset]`` tuples (other entries skipped, a tuple whose
  offset is not an integer an error).
Each returns per event ``(tag, fields)`` with what that consumer keeps, or raises ``Rejected``.
"""


from typing import Any

import msgpack


class Rejected(Exception):
    pass


def _is_int(x, lo=-(1 << 63), hi=(1 << 64) - 1) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _opt(x, check) -> bool:
    return x is None or check(x)


# ----------------------------------------------------------------- vLLM, msgspec
def vllm_structs(array_like: bool):
    import msgspec

    class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, array_like=array_like,
                       forbid_unknown_fields=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return msgspec.msgpack.Decoder(KVEventBatch)


# ----------------------------------------------------------------- vLLM, by hand
_STORED = (("block_hashes", None), ("parent_block_hash", None), ("token_ids", None), ("block_size", None),
           ("lora_id", None), ("medium", None), ("lora_name", None), ("extra_keys", 0), ("group_idx", 0),
           ("kv_cache_spec_kind", 0), ("kv_cache_spec_sliding_window", 0))  # 0: has a default (None)
_REMOVED = (("block_hashes", None), ("medium", None), ("group_idx", 0))
_VLLM = {"BlockStored": _STORED, "BlockRemoved": _REMOVED, "AllBlocksCleared": ()}


def _vllm_fields(raw) -> tuple[str, dict]:
    if isinstance(raw, list) and raw and isinstance(raw[0], str) and raw[0] in _VLLM:
        spec = _VLLM[raw[0]]
        if len(raw) - 1 > len(spec) or len(raw) - 1 < sum(d is None for _, d in spec):
            raise Rejected(f"{raw[0]} has {len(raw) - 1} fields")
        return raw[0], {name: (raw[k + 1] if k + 1 < len(raw) else None) for k, (name, _) in enumerate(spec)}
    if isinstance(raw, dict) and raw.get("type") in _VLLM:
        spec = _VLLM[raw["type"]]
        if set(raw) - {"type"} - {n for n, _ in spec}:
            raise Rejected(f"unknown fields {set(raw) - {'type'} - {n for n, _ in spec}}")
        if any(d is None and n not in raw for n, d in spec):
            raise Rejected(f"{raw['type']} lacks a required field")
        return raw["type"], {n: raw.get(n) for n, _ in spec}
    raise Rejected(f"not a vLLM event: {raw!r:.60}")


def vllm_strict(payload: bytes) -> list[tuple[str, dict]]:
    body = msgpack.unpackb(payload)
    if not (isinstance(body, list) and 2 <= len(body) <= 3 and isinstance(body[0], float)
            and isinstance(body[1], list) and _opt(body[2] if len(body) == 3 else None, _is_int)):
        raise Rejected("batch is not [ts, events, data_parallel_rank]")
    out = []
    for raw in body[1]:
        tag, f = _vllm_fields(raw)
        if tag == "BlockStored":
            ok = (isinstance(f["block_hashes"], list) and all(map(_is_int, f["block_hashes"]))
                  and _opt(f["parent_block_hash"], _is_int) and isinstance(f["token_ids"], list)
                  and all(map(_is_int, f["token_ids"])) and _is_int(f["block_size"]) and _opt(f["lora_id"], _is_int)
                  and _opt(f["medium"], lambda m: isinstance(m, str)) and _opt(f["lora_name"], lambda m: isinstance(
                      m, str)) and _opt(f["group_idx"], _is_int) and _opt(f["kv_cache_spec_kind"], lambda m: isinstance(
                          m, str)) and _opt(f["extra_keys"], lambda e: isinstance(e, list) and len(e) == len(
                              f["block_hashes"]) and all(_opt(k, lambda k: isinstance(k, list)) for k in e)))
            if not ok:
                raise Rejected(f"BlockStored fields of the wrong type: {f!r:.200}")
        elif tag == "BlockRemoved":
            if not (isinstance(f["block_hashes"], list) and all(map(_is_int, f["block_hashes"]))
                    and _opt(f["medium"], lambda m: isinstance(m, str)) and _opt(f["group_idx"], _is_int)):
                raise Rejected("BlockRemoved fields of the wrong type")
        out.append((tag, f))
    return out


# ----------------------------------------------------------------- Dynamo
_MAIN_KINDS = {"full_attention", "mla_attention", "sink_full_attention"}


def _dynamo_extra_item(x) -> str | None:
    """One ``ExtraKeyItem`` (untagged: the first variant that fits); the media identifier it carries, if any."""
    if isinstance(x, str):
        ident = x
    elif isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _is_int(x[1]):
        ident = x[0]
    elif isinstance(x, bytes) or (isinstance(x, list) and all(_is_int(b, 0, 255) for b in x)):
        return None
    elif isinstance(x, (int, float, bool)):
        return None
    else:
        raise Rejected(f"extra key {x!r:.60} fits no ExtraKeyItem variant")
    if len(ident) == 64 and all(c in "0123456789abcdefABCDEF" for c in ident):
        return ident
    return None


def dynamo_decode(payload: bytes, kv_block_size: int) -> list[tuple[str, dict]]:
    body = msgpack.unpackb(payload)
    if not (isinstance(body, list) and len(body) == 3):
        raise Rejected("a batch is the 3-tuple (ts, events, data_parallel_rank)")
    ts, events, rank = body
    if not isinstance(ts, float) or not isinstance(events, list) or not _opt(rank, lambda r: _is_int(r, -(1 << 31),
                                                                                                    (1 << 31) - 1)):
        raise Rejected("batch fields of the wrong type")
    out = []
    for raw in events:
        if isinstance(raw, dict):
            tag, f = raw.get("type"), raw
            trailing = {"group_idx": raw.get("group_idx"), "kind": raw.get("kv_cache_spec_kind")}
        elif isinstance(raw, list) and raw and isinstance(raw[0], str):
            tag = raw[0]
            names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                     "extra_keys") if tag == "BlockStored" else ("block_hashes", "medium")
            f = dict(zip(names, raw[1:]))
            trailing = {"group_idx": None, "kind": None}
            for t in raw[1 + len(names):1 + len(names) + 3]:
                if _is_int(t, 0, (1 << 32) - 1):
                    trailing["group_idx"] = t
                elif isinstance(t, str):
                    trailing["kind"] = t
                elif t is not None and not isinstance(t, list):
                    raise Rejected("a trailing field fits no variant")
        else:
            raise Rejected("an event is a tagged map or sequence")
        if tag not in ("BlockStored", "BlockRemoved", "AllBlocksCleared", "Ignored"):
            raise Rejected(f"unknown variant {tag!r}")
        ignored = (trailing["kind"] is not None and trailing["kind"] not in _MAIN_KINDS) or \
            trailing["group_idx"] not in (None, 0)
        if tag == "BlockStored":
            for need in ("block_hashes", "token_ids", "block_size"):
                if need not in f:
                    raise Rejected(f"missing {need}")
            hashes, tokens = f["block_hashes"], f["token_ids"]
            if not all(map(_is_int, hashes)) or not _opt(f.get("parent_block_hash"), _is_int):
                raise Rejected("block hashes are i64 or u64")
            if not all(_is_int(t, 0, (1 << 32) - 1) for t in tokens):
                raise Rejected("token ids are u32")
            extra = f.get("extra_keys")
            mm = [None] * len(hashes)
            if extra is not None:
                if not isinstance(extra, list):
                    raise Rejected("extra_keys is a list")
                for b, keys in enumerate(extra):
                    if keys is not None:
                        if not isinstance(keys, list):
                            raise Rejected("a block's extra keys are a list")
                        found = [i for i in (_dynamo_extra_item(k) for k in keys) if i is not None]
                        if b < len(mm) and found:
                            mm[b] = [int(i[:16], 16) for i in found]
            published = len(hashes) if f["block_size"] == kv_block_size and len(tokens) >= len(hashes) * kv_block_size \
                else 0
            out.append(("Ignored" if ignored else tag, {"block_hashes": hashes[:published],
                                                        "parent": f.get("parent_block_hash"), "mm": mm[:published]}))
        elif tag == "BlockRemoved":
            if "block_hashes" not in f or not all(map(_is_int, f["block_hashes"])):
                raise Rejected("BlockRemoved needs block_hashes")
            out.append(("Ignored" if ignored else tag, {"block_hashes": f["block_hashes"]}))
        else:
            out.append((tag, {}))
    return out


# ----------------------------------------------------------------- llm-d
_LLMD_STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                "extra_keys")


def llmd_decode(payload: bytes) -> list[tuple[str, dict]]:
    body = msgpack.unpackb(payload)
    if not (isinstance(body, list) and len(body) >= 2 and isinstance(body[1], list)):
        raise Rejected("the batch is a positional array")
    out = []
    for raw in body[1]:
        if isinstance(raw, dict):  # #661: a map is normalized to the positional layout
            tag = raw.get("type")
            if not isinstance(tag, str):
                raise Rejected("map event without a string tag")
            names = _LLMD_STORED if tag == "BlockStored" else ("block_hashes", "medium")
            raw = [tag, *(raw.get(n) for n in names)] if tag != "AllBlocksCleared" else [tag]
        if not (isinstance(raw, list) and raw and isinstance(raw[0], str)):
            raise Rejected("failed to decode tagged union")
        tag = raw[0]
        if tag == "BlockStored":
            f = dict(zip(_LLMD_STORED, raw[1:]))
            if not all(map(_is_int, f["block_hashes"])) or not all(_is_int(t, 0, (1 << 32) - 1)
                                                                    for t in f["token_ids"]):
                raise Rejected("BlockStored fields")
            features = []
            for keys in f.get("extra_keys") or [None] * len(f["block_hashes"]):
                mm = []
                for entry in keys or ():
                    if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str):
                        continue  # LoRA names, cache salts
                    if not _is_int(entry[1]):
                        raise Rejected(f"extra key offset {entry[1]!r} is not an integer")
                    mm.append((entry[0], entry[1]))
                features.append(mm or None)
            out.append((tag, {"block_hashes": f["block_hashes"], "parent": f["parent_block_hash"],
                              "tier": (f.get("medium") or "gpu").lower(), "mm": features}))
        elif tag == "BlockRemoved":
            out.append((tag, {"block_hashes": raw[1]}))
        elif tag == "AllBlocksCleared":
            out.append((tag, {}))
        else:
            raise Rejected(f"unknown vLLM event tag: {tag}")
    return out
