"""Batches and ZMQ frames, as vLLM's publisher sends them.

A message is three frames ``(topic, sequence number as 8 bytes big-endian, payload)``; the payload is the msgpack
array ``[ts, events, data_parallel_rank]`` (vLLM's ``EventBatch``, positional in every vLLM version), each event in
the chosen encoding (``mmcache.events.schema``). vLLM's publisher always fills in its data-parallel rank (0 without
data parallelism), and Dynamo's decoder requires the third element, so it is always sent.
Invariant: each topic's sequence numbers count 0, 1, 2, ... with no gap, one per message of that topic.
"""

from __future__ import annotations

import dataclasses
import time
from itertools import count

import msgpack

from mmcache.events.schema import Event, WireError, decode_event, encode_event

DEFAULT_ENCODER_TOPIC = "mmcache-encoder"  # encoder-output events' topic, apart from the KV topic


@dataclasses.dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


def encode_batch(events: list[Event], encoding: str, rank: int | None, ts: float | None = None) -> bytes:
    """The payload of one message: ``[ts, events, rank]`` in msgpack."""
    body = [time.time() if ts is None else float(ts), [encode_event(e, encoding) for e in events], rank]
    return msgpack.packb(body)


def decode_batch(payload: bytes) -> EventBatch:
    """A payload back into typed events, either encoding (both may mix in one batch); ``WireError`` if malformed."""
    try:
        body = msgpack.unpackb(payload)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"not msgpack: {e}") from None
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[1], list):
        raise WireError("a batch is [ts, events, data_parallel_rank]")
    rank = body[2] if len(body) > 2 else None
    return EventBatch(float(body[0]), [decode_event(e) for e in body[1]], rank)


class Framer:
    """Numbers messages per topic: ``frames(topic, payload)`` gives the three frames of the topic's next message."""

    def __init__(self):
        self._seqs: dict[bytes, count] = {}

    def frames(self, topic: bytes, payload: bytes) -> tuple[bytes, bytes, bytes]:
        seq = self._seqs.setdefault(topic, count())
        return topic, next(seq).to_bytes(8, "big"), payload
