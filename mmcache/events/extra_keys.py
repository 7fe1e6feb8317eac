"""Per-page extra keys as vLLM defines them (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``):
for a block of tokens ``[start, end)``, one ``(identifier, offset - start)`` per media item whose placeholders
``[offset, offset + length)`` overlap the block, in prompt order (so an item spanning five pages rides on all five,
its offset negative on the four after its first), then the request's cache salt as a bare string on the block that
starts at token 0. mmcache has no LoRA and no prompt embeddings, so no key of those kinds.

The index tells its observer only where each item starts (the media blob of the page holding its first placeholder:
``offset ‖ digest`` per item, ``mmcache.names.media_by_page``). How many placeholders an item has is told here
(``MediaSpans.describe``: its digest commits to the preprocessed item, so the count is a function of the digest); an
item never described is taken to end with its first page (counted in ``unsized``). Items still open at a page's end
are remembered by that page's name until it leaves the index, so a run stored later under it continues them.

Identifiers: ``media_identifier(digest)``, the digest in hex padded with zeros to vLLM's 64 hex digits (a 32-byte
digest is its hex as is): Dynamo reads a media key only from a 64-digit hex identifier. Salts: ``salt_key(salt)``,
the salt as UTF-8 text (vLLM's ``cache_salt`` is a string), or ``"hex:"`` and its hex when it is not UTF-8.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Sequence

IDENTIFIER_HEX = 64
DIGEST_BYTES = 16  # xxh3-128 digests, the default (``digests``); 32 for blake2b or sha256


def media_identifier(digest: bytes) -> str:
    """The identifier a media item's keys and encoder events carry: its digest in hex, zero-padded to 64 digits."""
    h = bytes(digest).hex()
    return h + "0" * (IDENTIFIER_HEX - len(h)) if len(h) < IDENTIFIER_HEX else h


def salt_key(salt: bytes) -> str | None:
    """The salt as the events write it (None for no salt)."""
    if not salt:
        return None
    try:
        return bytes(salt).decode("utf-8")
    except UnicodeDecodeError:
        return "hex:" + bytes(salt).hex()


class _Item(NamedTuple):
    start: int       # absolute token position of the first placeholder
    end: int         # one past the last placeholder
    identifier: str


class MediaSpans:
    """Extra keys for runs of stored pages (see the module docstring). ``describe`` may be called from any thread; the
    rest from the one thread that turns index calls into events, in the order the index made them.

    ``max_described``: digests whose placeholder counts are kept (least recently described dropped first).
    Invariant: ``open`` holds, for each indexed page some item runs past, the items that do (none for other pages)."""

    def __init__(self, page_size: int, digest_bytes: int = DIGEST_BYTES, max_described: int = 1 << 16):
        self.page_size, self.digest_bytes, self.max_described = page_size, digest_bytes, max_described
        self._lengths: OrderedDict[bytes, int] = OrderedDict()
        self._lock = threading.Lock()
        self.open: dict[int, tuple[_Item, ...]] = {}
        self.unsized = 0  # items whose length was never described: keyed on their first page only

    def describe(self, digest: bytes, tokens: int) -> None:
        """The item with ``digest`` has ``tokens`` placeholders."""
        with self._lock:
            self._lengths[bytes(digest)] = int(tokens)
            self._lengths.move_to_end(bytes(digest))
            if len(self._lengths) > self.max_described:
                self._lengths.popitem(last=False)

    def _items(self, blob: bytes, page_start: int) -> list[_Item]:
        step, out = 8 + self.digest_bytes, []
        for k in range(0, len(blob) - step + 1, step):
            start = int.from_bytes(blob[k:k + 8], "little")
            digest = blob[k + 8:k + step]
            with self._lock:
                length = self._lengths.get(digest)
            if length is None:
                self.unsized += 1
                length = max(1, page_start + self.page_size - start)
            out.append(_Item(start, start + max(1, length), media_identifier(digest)))
        return out

    def keys(self, names: Sequence[int], parent: int | None, media: Sequence[bytes], salt: str | None,
             depth: int) -> list[tuple | None]:
        """The extra keys of pages ``names`` (chain positions ``depth, depth + 1, ...`` under ``parent``), each page's
        media blob in ``media``; remembers the items still open after each page."""
        P, out = self.page_size, []
        carry = self.open.get(parent, ()) if parent is not None else ()
        for i, name in enumerate(names):
            start = (depth + i) * P
            end = start + P
            items = [*carry, *self._items(media[i], start)] if media[i] else list(carry)
            keys: list = [(it.identifier, it.start - start) for it in items if it.start < end and it.end > start]
            if salt is not None and start == 0:
                keys.append(salt)
            out.append(tuple(keys) if keys else None)
            carry = tuple(it for it in items if it.end > end)
            if carry:
                self.open[name] = carry
        return out

    def removed(self, names: Sequence[int]) -> None:
        for name in names:
            self.open.pop(name, None)

    def cleared(self) -> None:
        self.open.clear()
