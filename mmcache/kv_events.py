"""KV and encoder-output events for external routers, in the format vLLM's consumers decode (``mmcache.events``).

Transport (vLLM ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``): ZMQ PUB; each message is three frames
``(topic, seq as 8 bytes big-endian, payload)``, ``seq`` counting 0, 1, 2, ... per topic. KV events go out on the
socket bound to ``endpoint``, encoder-output events on a socket of their own (``encoder_endpoint``), so a consumer
that subscribes to every topic on the KV endpoint never receives an encoder message. The payload is msgpack
``[ts, events, data_parallel_rank]`` (rank 0 unless given: vLLM always sends it and Dynamo requires it).

KV events, under ``topic`` (default ""), in vLLM's ``encoding``: ``"map"`` (default; vLLM since PR #42892, each event
``{"type": tag, field: value}`` with defaulted fields left out while at their default) or ``"array"`` (vLLM before
it, ``[tag, field, ...]`` with trailing defaults left out). Fields in vLLM's order:

    BlockStored   block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
                  extra_keys, group_idx (0), kv_cache_spec_kind ("full_attention")
    BlockRemoved  block_hashes, medium, group_idx (0)
    AllBlocksCleared

``block_hashes`` are page names (unsigned 64-bit), ``token_ids`` the pages' ids concatenated, ``lora_id`` and
``lora_name`` null. ``extra_keys`` has one entry per page (vLLM ``kv_cache_utils.generate_block_hash_extra_keys``):
null, or a list of ``[identifier, offset]`` for every media item whose placeholders overlap the page, ``offset`` the
item's first placeholder relative to the page's first token (negative on the pages after the item's first), in prompt
order, then on a chain's first page the tenant salt as a bare string. ``identifier`` is the media digest in hex,
zero-padded to 64 hex digits (``media_identifier``); the salt is its UTF-8 text, or ``"hex:<hex>"``. An item's
length is told with ``KVEventPublisher.describe_media(digest, tokens)`` before its pages are stored; an item never
described rides on its first page only (``unsized_media`` counts them).

Encoder-output events, on the publisher's ``encoder_endpoint`` (default: beside ``endpoint``, a TCP port of its own,
read back from ``KVEventPublisher.encoder_endpoint``) under ``encoder_topic`` (default ``"mmcache-encoder"``), same
batch and encoding, for a router that routes by the media an instance already encoded:

    EncoderOutputStored   identifier, digest, encoder, modality, nbytes, cache_salt (null), medium
    EncoderOutputRemoved  identifier, digest, encoder, modality, cache_salt (null), medium

``identifier`` as in ``extra_keys``, ``digest`` the digest's hex, ``encoder`` the encoder fingerprint as text (a str
as is, else its repr), ``cache_salt`` as in ``extra_keys``. They come when an ``EncoderStore`` reports to the
publisher (``EncoderStore(observer=publisher)``).

Consumers: vLLM's ``KVEventBatch`` decodes both encodings (the one its version speaks); Dynamo's ``zmq_wire`` reads
both and takes media from 64-hex identifiers; llm-d reads ``[identifier, offset]`` keys as media and parses the topic
as ``kv@<pod>@<model>`` (set ``topic`` so). ``mmcache.events.CacheView`` rebuilds an instance from the messages.

Off the request path: the caches call under the pool's lock and the calls only queue; a publisher thread builds,
encodes and sends. A call that does not fit the queue is dropped and counted (``counters["dropped"]``).
"""

from mmcache.events.extra_keys import media_identifier, salt_key
from mmcache.events.publisher import KVEventPublisher
from mmcache.events.wire import DEFAULT_ENCODER_TOPIC

__all__ = ["DEFAULT_ENCODER_TOPIC", "KVEventPublisher", "media_identifier", "salt_key"]
