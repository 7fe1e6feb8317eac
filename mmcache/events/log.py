"""EventLog: the publisher's messages, made in the caller's thread and kept in a list instead of sent.

The same builder, encoding and framing as ``KVEventPublisher``, so what ``take()`` returns is byte for byte what the
publisher would have sent for the same calls (ts aside). For replays and tests that route from decoded events with no
socket and no thread in between: the caller decides when a router sees them.
"""

from __future__ import annotations

from mmcache.events.builder import EventBuilder
from mmcache.events.extra_keys import DIGEST_BYTES
from mmcache.events.wire import DEFAULT_ENCODER_TOPIC, Framer, encode_batch


class EventLog:
    """An ``IndexObserver`` and ``EncoderObserver`` that keeps one message per call (arguments as the publisher's)."""

    def __init__(self, block_size: int, *, topic: str = "", encoder_topic: str = DEFAULT_ENCODER_TOPIC,
                 medium: str = "GPU", encoding: str = "map", data_parallel_rank: int | None = 0,
                 digest_bytes: int = DIGEST_BYTES):
        self.topic, self.encoder_topic = topic.encode(), encoder_topic.encode()
        self.encoding, self.rank = encoding, data_parallel_rank
        self._builder = EventBuilder(block_size, medium, digest_bytes)
        self._framer = Framer()
        self._messages: list[tuple[bytes, bytes, bytes]] = []

    def describe_media(self, digest, tokens: int) -> None:
        self._builder.describe_media(digest, tokens)

    def _keep(self, topic: bytes, event) -> None:
        self._messages.append(self._framer.frames(topic, encode_batch([event], self.encoding, self.rank, ts=0.0)))

    def stored(self, names, parent, tokens, media, salt: bytes, depth: int) -> None:
        self._keep(self.topic, self._builder.stored(names, parent, tokens, media, salt, depth))

    def removed(self, names) -> None:
        self._keep(self.topic, self._builder.removed(names))

    def cleared(self) -> None:
        self._keep(self.topic, self._builder.cleared())

    def encoder_stored(self, key, nbytes: int) -> None:
        self._keep(self.encoder_topic, self._builder.encoder_stored(key, nbytes))

    def encoder_removed(self, keys) -> None:
        for key in keys:
            self._keep(self.encoder_topic, self._builder.encoder_removed(key))

    def take(self) -> list[tuple[bytes, bytes, bytes]]:
        """The messages made since the last ``take``, in order: ``(topic, seq, payload)`` frames."""
        out, self._messages = self._messages, []
        return out
