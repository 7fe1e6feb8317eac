"""EventBuilder: what the prefix index and the encoder store tell their observers, as typed events.

One builder per stream, fed in the order the caches made the calls (it keeps the media items open across pages,
``mmcache.events.extra_keys``). KV events carry vLLM's current fields: ``group_idx`` 0 and ``kv_cache_spec_kind``
``"full_attention"`` (one KV group of full attention; Dynamo skips groups other than 0 and other kinds), no LoRA.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmcache.encoder_key import EncoderKey
from mmcache.events.extra_keys import DIGEST_BYTES, MediaSpans, media_identifier, salt_key
from mmcache.events.schema import AllBlocksCleared, BlockRemoved, BlockStored, EncoderOutputRemoved, EncoderOutputStored

KV_CACHE_SPEC_KIND = "full_attention"


def encoder_text(fingerprint) -> str:
    """An encoder fingerprint as the events write it: a str as is, anything else as its repr."""
    return fingerprint if isinstance(fingerprint, str) else repr(fingerprint)


class EventBuilder:
    """``block_size``: the page size. ``medium``: where the pages live ("GPU", "CPU"). ``digest_bytes``: the length of
    the media digests in the index's media blobs."""

    def __init__(self, block_size: int, medium: str | None = "GPU", digest_bytes: int = DIGEST_BYTES):
        self.block_size, self.medium = block_size, medium
        self.spans = MediaSpans(block_size, digest_bytes)

    def describe_media(self, digest, tokens: int) -> None:
        """The media item named ``digest`` has ``tokens`` placeholder tokens (its keys then ride on every page it
        overlaps); any thread may call it, before the pages holding the item are stored."""
        self.spans.describe(bytes(digest), tokens)

    def stored(self, names: Sequence[int], parent: int | None, tokens: np.ndarray, media: Sequence[bytes],
               salt: bytes, depth: int) -> BlockStored:
        names = [int(n) for n in names]
        extra = self.spans.keys(names, parent, media, salt_key(salt), depth)
        return BlockStored(names, parent, np.asarray(tokens).ravel().tolist(), self.block_size, None, self.medium,
                           None, extra, 0, KV_CACHE_SPEC_KIND)

    def removed(self, names: Sequence[int]) -> BlockRemoved:
        names = [int(n) for n in names]
        self.spans.removed(names)
        return BlockRemoved(names, self.medium, 0)

    def cleared(self) -> AllBlocksCleared:
        self.spans.cleared()
        return AllBlocksCleared()

    def encoder_stored(self, key: EncoderKey, nbytes: int) -> EncoderOutputStored:
        return EncoderOutputStored(media_identifier(key.digest), key.digest.hex(), encoder_text(key.fingerprint),
                                   key.modality, int(nbytes), salt_key(key.salt), self.medium)

    def encoder_removed(self, key: EncoderKey) -> EncoderOutputRemoved:
        return EncoderOutputRemoved(media_identifier(key.digest), key.digest.hex(), encoder_text(key.fingerprint),
                                    key.modality, salt_key(key.salt), self.medium)
