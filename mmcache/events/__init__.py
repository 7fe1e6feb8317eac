"""Events for external routers: what an instance's prefix index and encoder store hold, in the formats vLLM's,
Dynamo's and llm-d's consumers decode.

Modules, one job each: ``schema`` (the typed events and their array/map encodings), ``wire`` (batches, ZMQ frames,
sequence numbers), ``extra_keys`` (vLLM's per-page media and salt keys), ``builder`` (cache calls -> events),
``publisher`` (ZMQ PUB socket and its thread), ``log`` (the same messages kept in a list), ``view`` (a router's
picture of one instance rebuilt from decoded events). The wire format is documented in ``mmcache.kv_events``.
Only ``KVEventPublisher`` needs ZMQ (the ``events`` extra): it is imported on first use, so replays that keep their
events in an ``EventLog`` run without it.
"""

from mmcache.events.builder import EventBuilder
from mmcache.events.extra_keys import media_identifier, salt_key
from mmcache.events.log import EventLog
from mmcache.events.schema import (
    ENCODINGS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EncoderOutputRemoved,
    EncoderOutputStored,
    WireError,
    decode_event,
    encode_event,
)
from mmcache.events.view import CacheView
from mmcache.events.wire import DEFAULT_ENCODER_TOPIC, EventBatch, decode_batch, encode_batch

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "CacheView", "DEFAULT_ENCODER_TOPIC", "ENCODINGS",
           "EncoderOutputRemoved", "EncoderOutputStored", "EventBatch", "EventBuilder", "EventLog",
           "KVEventPublisher", "WireError", "decode_batch", "decode_event", "encode_batch", "encode_event",
           "media_identifier", "salt_key"]


def __getattr__(name: str):
    if name == "KVEventPublisher":
        from mmcache.events.publisher import KVEventPublisher
        return KVEventPublisher
    raise AttributeError(f"module 'mmcache.events' has no attribute {name!r}")
