"""CacheView: what a router knows of one instance's caches, rebuilt from the events it decoded and nothing else.

Pages by hash (each with its parent and extra keys) from the KV events, encoder outputs from the encoder-output
events. ``apply`` takes the frames of messages in the order they were sent and checks each topic's sequence numbers:
a gap (a message lost) is counted in ``gaps``, and the view is exact only while that stays 0.
Invariant: ``blocks`` is closed under parents while no message was lost (the index stores parents first).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

from mmcache.events.extra_keys import media_identifier
from mmcache.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, EncoderOutputRemoved, EncoderOutputStored
from mmcache.events.wire import decode_batch


class CacheView:
    def __init__(self):
        self.blocks: dict[int, tuple[int | None, tuple | None]] = {}  # hash -> (parent hash, extra keys)
        self.outputs: set[tuple[str, str, str, str | None]] = set()   # (identifier, encoder, modality, salt)
        self.events = self.gaps = 0
        self._media: Counter[str] = Counter()  # identifier -> outputs held for it
        self._next: dict[bytes, int] = {}

    def apply(self, messages: Iterable[Sequence[bytes]]) -> None:
        """Decode and apply ``(topic, seq, payload)`` frames."""
        for topic, seq, payload in messages:
            n = int.from_bytes(seq, "big")
            self.gaps += n != self._next.get(topic, 0)
            self._next[topic] = n + 1
            for event in decode_batch(payload).events:
                self.apply_event(event)

    def apply_event(self, event) -> None:
        self.events += 1
        if isinstance(event, BlockStored):
            extra = event.extra_keys or [None] * len(event.block_hashes)
            up = event.parent_block_hash
            for h, keys in zip(event.block_hashes, extra):
                self.blocks[h] = (up, keys)
                up = h
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                self.blocks.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif isinstance(event, EncoderOutputStored):
            key = (event.identifier, event.encoder, event.modality, event.cache_salt)
            if key not in self.outputs:
                self.outputs.add(key)
                self._media[event.identifier] += 1
        elif isinstance(event, EncoderOutputRemoved):
            key = (event.identifier, event.encoder, event.modality, event.cache_salt)
            if key in self.outputs:
                self.outputs.remove(key)
                self._media[event.identifier] -= 1

    def matched_pages(self, names: Sequence[int]) -> int:
        """How many leading pages of a chain named ``names`` the instance holds."""
        k = 0
        while k < len(names) and int(names[k]) in self.blocks:
            k += 1
        return k

    def holds_output(self, digest: bytes, encoder: str, modality: str, salt: str | None = None) -> bool:
        """Whether the instance's encoder store holds the output of ``encoder`` for the media named ``digest``."""
        return (media_identifier(digest), encoder, modality, salt) in self.outputs

    def holds_media(self, digest: bytes) -> bool:
        """Whether the instance's encoder store holds any output for the media named ``digest``."""
        return self._media[media_identifier(digest)] > 0
