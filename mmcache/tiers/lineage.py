"""Lineage: a 128-bit digest of a page's whole prefix, the verifying id that links a page in a lower tier to its parent.

On the device the parent of an indexed page is a page id, which is exact. A page that left the device (host tier,
shared store) has no parent page any more, and its chain name is only 64 bits and can be forced by the caller, so a
tier entry carries the lineage of its parent instead:

    lineage_{-1} = xxh3_128(fingerprint root ‖ salt)        lineage_j = xxh3_128(lineage_{j-1} ‖ tokens_j ‖ media_j)

A tier hit on page j requires the entry's tokens and media to equal the request's page j (compared exactly) and the
entry's parent lineage to equal the lineage of the request's own pages 0..j-1, computed from the request's tokens.
Serving a wrong page would need a 128-bit collision of xxh3_128 between two different prefixes, the same bar the
project sets for media digests (which have no tokens to verify them); forced 64-bit name collisions cost a miss.
"""

from __future__ import annotations

import numpy as np
import xxhash

from mmcache.names import Fingerprint


def root_lineage(fingerprint: Fingerprint, salt: bytes) -> bytes:
    """The lineage before page 0: commits to the process fingerprint and the tenant salt."""
    return xxhash.xxh3_128_digest(fingerprint.root.to_bytes(8, "little") + bytes(salt))


def link(parent: bytes, page_tokens: np.ndarray, media_id: np.ndarray) -> bytes:
    """The lineage of a page from its parent's lineage, its token ids (int32) and its 128-bit media id."""
    return xxhash.xxh3_128_digest(parent + page_tokens.tobytes() + media_id.tobytes())


class RequestLineage:
    """The lineages of one request's pages, computed from its own tokens on demand and kept (page j needs 0..j-1)."""

    def __init__(self, root: bytes, tokens: np.ndarray, mids: np.ndarray, page_size: int):
        self._tokens, self._mids, self._P = tokens, mids, page_size
        self._lin = [root]  # _lin[j] = lineage of pages 0..j-1

    def before(self, j: int) -> bytes:
        """The lineage of pages ``0..j-1`` (the root for ``j == 0``): what page j's entry must name as its parent."""
        P = self._P
        while len(self._lin) <= j:
            i = len(self._lin) - 1
            self._lin.append(link(self._lin[-1], self._tokens[i * P:(i + 1) * P], self._mids[i]))
        return self._lin[j]
