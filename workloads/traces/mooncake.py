"""Mooncake trace loader (kvcache-ai/Mooncake FAST'25 traces): JSONL of ``timestamp`` (ms), ``input_length``,
``output_length`` and ``hash_ids``, one id per 512-token prefix block, equal ids meaning equal prefixes.

The trace has no text, so the loader synthesizes what the cache needs from the block ids:
- names: ``name_j = xxh64(id_j, seed=name_{j-1})`` from a fixed root, for the prompt's full blocks only. Chaining
  keeps "equal name = equal prefix" even if a trace reused an id at another position, and maps ids away from small
  integers;
- tokens: block ``j`` holds 512 tokens derived from its id alone (the id's low and high 31 bits, then a fixed
  ramp), the last block cut to ``input_length``. Equal ids give equal tokens, different ids different tokens, so the
  cache's token verification confirms exactly the matches the ids promise;
- no output tokens: the output is grown (it occupies live memory) but gets no names, so it is never reused.

Page size is fixed at 512 by the block ids. Every request is its own session (the trace names none). The file is
read with the shared JSONL policy (``workloads.traces.jsonl``: blank lines skipped, the first malformed line raises
``TraceError`` with its file and 1-based line). Malformed: not a JSON object, a missing field, a timestamp that is
negative or not a finite number, lengths that are not integers (input >= 1, output >= 0), hash ids that are not
integers in [0, 2**63), or ``len(hash_ids) != ceil(input_length / 512)``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import xxhash

from workloads.traces.jsonl import load_jsonl
from workloads.traces.text_trace import CallInfo, TextRequest, TextTrace

BLOCK_TOKENS = 512
_NAME_ROOT = xxhash.xxh64_intdigest(b"mmcache/mooncake-hash-ids")
_RAMP = np.arange(BLOCK_TOKENS, dtype=np.int32) + 1000  # fixed filler after the two id tokens
_MASK31 = (1 << 31) - 1


def block_names(hash_ids, full_blocks: int) -> list[int]:
    """Chained 64-bit names of the first ``full_blocks`` block ids."""
    names, parent = [], _NAME_ROOT
    for h in hash_ids[:full_blocks]:
        parent = xxhash.xxh64_intdigest(int(h).to_bytes(8, "little"), parent)
        names.append(parent)
    return names


def block_tokens(hash_ids, length: int) -> np.ndarray:
    """``length`` int32 tokens, 512 per block, each block a function of its id only."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    tokens = np.broadcast_to(_RAMP, (ids.size, BLOCK_TOKENS)).copy()
    tokens[:, 0] = ids & _MASK31
    tokens[:, 1] = (ids >> 31) & _MASK31
    return tokens.reshape(-1)[:length]


@dataclasses.dataclass(slots=True)
class MooncakeRequest:
    """One trace line; a session of one call."""

    name: str
    calls: tuple[CallInfo]
    hash_ids: tuple[int, ...]

    def build(self, i: int) -> TextRequest:
        if i != 0:
            raise IndexError(f"{self.name} has one call, asked for call {i}")
        c = self.calls[0]
        return TextRequest(rid=self.name, session=self.name, arrival_s=c.arrival_s,
                           token_ids=block_tokens(self.hash_ids, c.prompt_len),
                           names=block_names(self.hash_ids, c.prompt_len // BLOCK_TOKENS),
                           output_ids=None, output_len=c.output_len)


def _parse(row, lineno: int) -> MooncakeRequest:
    """One line's request, or ValueError naming what is wrong."""
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    ts, n_in, n_out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a finite number >= 0 (ms), got {ts!r}")
    for key, v, low in (("input_length", n_in, 1), ("output_length", n_out, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{key} must be an integer >= {low}, got {v!r}")
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise ValueError("hash_ids must be a list of integers")
    if bad := [h for h in ids if not 0 <= h < 1 << 63]:
        raise ValueError(f"hash_ids must be in [0, 2**63), got {bad[0]}")
    want = -(-n_in // BLOCK_TOKENS)
    if len(ids) != want:
        raise ValueError(f"len(hash_ids) = {len(ids)} but ceil(input_length / {BLOCK_TOKENS}) = {want}")
    return MooncakeRequest(f"mc-{lineno}", (CallInfo(float(ts) / 1000.0, n_in, n_out),), tuple(ids))


def load_mooncake(path: str | Path, limit: int | None = None) -> TextTrace:
    """Read a Mooncake JSONL trace: one request per non-blank line, at most ``limit``; ``TraceError`` (file and line)
    for a missing file or the first malformed line. Request ids are ``mc-<line>`` (1-based, stable under limits)."""
    sessions = load_jsonl(path, _parse, limit)
    return TextTrace(source=str(path), kind="mooncake", sessions=sessions, page_size=BLOCK_TOKENS)
