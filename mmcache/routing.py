"""Replica affinity (RFC phase 3b): pick a data-parallel replica from a request's prefix or its media, with no cache
state.

Two keys, chosen per router (``AffinityRouter(key=...)``):

- ``"text"``: ``affinity_key(names)`` is the page name of the request's ``key_pages``-th full page (or its last, if
  shorter): a chain name commits to every token before it, so two requests get the same key exactly when their first
  ``key_pages`` pages are equal. Names fold the tenant salt in at their root, so tenants never share a text key.
- ``"media"``: ``media_key(media, salt)`` stands for the request's FIRST media item (in prompt order) under its
  tenant salt; a request without media falls back to the text key. The same image (reference voice, conditioning
  image) then meets the replica that holds its encoder output, whatever text surrounds it, and, since every later turn
  of a chat re-sends it, the KV of the session's history too. Why the first item alone: an encoder output is keyed by
  digest x encoder x salt, not by its text, so keying on the page before it (a shared system prompt, a user's own
  preamble) would scatter the users of one image; keying on every item would part two requests that share the first
  image but not the second. The price: requests that share only a text prefix and differ in their image are spread,
  so such a prefix (a system prompt) is prefilled once per replica rather than once.
  Why the salt: the router holds no cache state, so a shared key can never serve anything wrong; but two tenants
  sending one popular image cannot share its encoder output (keys carry the salt) or its KV (names carry it), so one
  key for both would only pile their load on one replica for nothing. The salt is therefore folded into the media key
  (pass it even when the digests already fold it in, as M*'s carried digests do: folding twice is harmless).

``AffinityRouter.choose`` ranks the replicas by rendezvous (highest random weight) hashing of the key: every router
computes the same ranking with no shared state, and a replica joining or leaving moves only the keys whose top choice
it is or was. The top replica is taken while its queue is below ``threshold``; past it, or for a prompt with no key
(no full page and no media), the choice is today's uniform random one.

Nothing here holds cache contents, so nothing it holds can go stale; the load it reads is the caller's live count.
The core imports no engine: the M* conductor adapter is ``mmcache.mstar.conductor``.
"""

from __future__ import annotations

import random
from typing import Hashable, Sequence

import xxhash

from mmcache.errors import InvalidRequest
from mmcache.names import digest_as_bytes

DEFAULT_KEY_PAGES = 1
DEFAULT_THRESHOLD = 16
KEYS = ("text", "media")
_MEDIA_DOMAIN = b"mmcache-route-media\0"  # media keys are a namespace apart from page names


def affinity_key(names: Sequence[int], key_pages: int = DEFAULT_KEY_PAGES) -> int | None:
    """The chain name that stands for the request's first ``key_pages`` pages; None when it has no full page."""
    if key_pages < 1:
        raise InvalidRequest(f"key_pages must be >= 1, got {key_pages}")
    if not len(names):
        return None
    return int(names[min(key_pages, len(names)) - 1])


def media_key(media: Sequence, salt: bytes = b"") -> int | None:
    """The 64-bit key that stands for the first of ``media`` (the request's media digests in prompt order: bytes-like
    or ints, as page names take them) under tenant ``salt``; None without media. Every digest is checked
    (``InvalidRequest`` for one that is not a digest, or for a single digest passed in place of the sequence)."""
    if isinstance(media, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest("media must be a sequence of digests (in prompt order), not one digest or a string")
    if not isinstance(salt, (bytes, bytearray)):
        raise InvalidRequest(f"salt must be bytes, got {type(salt).__name__}")
    found = [digest_as_bytes(d) for d in media]
    if not found:
        return None
    return xxhash.xxh64_intdigest(found[0], seed=xxhash.xxh64_intdigest(_MEDIA_DOMAIN + bytes(salt)))


def _replica_seed(replica: Hashable) -> int:
    return xxhash.xxh64_intdigest(repr(replica).encode())


def rendezvous_order(key: int, replicas: Sequence[Hashable]) -> list[int]:
    """Indices into ``replicas``, best first, by the weight ``xxh64(key, seed=xxh64(repr(replica)))``.

    The weight of a (key, replica) pair depends on nothing else, so removing a replica changes the top choice only of
    the keys it topped, and adding one takes only the keys it now tops (about 1/R of them)."""
    kb = int(key).to_bytes(8, "little")
    weights = [xxhash.xxh64_intdigest(kb, seed=_replica_seed(r)) for r in replicas]
    return sorted(range(len(replicas)), key=lambda i: (-weights[i], i))


class AffinityRouter:
    """Rendezvous-hash affinity below a queue threshold, today's random choice above it.

    ``replicas``: stable identifiers (e.g. each replica's worker ranks); the ranking depends on them, not on their
    order. ``threshold``: the preferred replica is taken while its queue (live requests) is below this.
    ``key``: ``"text"`` (the first ``key_pages`` page names) or ``"media"`` (the first media digest with the salt,
    the text key for a request without media); see the module doc. ``rng``: the random fallback's generator
    (``random.Random``), seedable for replays.
    """

    def __init__(self, replicas: Sequence[Hashable], threshold: int = DEFAULT_THRESHOLD,
                 key_pages: int = DEFAULT_KEY_PAGES, rng: random.Random | None = None, key: str = "text"):
        if not len(replicas):
            raise InvalidRequest("a router needs at least one replica")
        if threshold < 1:
            raise InvalidRequest(f"threshold must be >= 1, got {threshold}")
        if key_pages < 1:
            raise InvalidRequest(f"key_pages must be >= 1, got {key_pages}")
        if key not in KEYS:
            raise InvalidRequest(f"key must be one of {', '.join(KEYS)}, got {key!r}")
        self.replicas = list(replicas)
        self.threshold = int(threshold)
        self.key_pages = int(key_pages)
        self.key = key
        self.rng = rng or random.Random()
        self.preferred = self.fallbacks = 0  # how many choices went each way

    def route_key(self, names: Sequence[int], media: Sequence = (), salt: bytes = b"") -> int | None:
        """The key a request is placed by (None: no key, the random choice); checks ``media`` and ``salt`` under
        either key, so bad input is refused whichever key is configured."""
        by_media = media_key(media, salt)
        if self.key == "media" and by_media is not None:
            return by_media
        return affinity_key(names, self.key_pages)

    def choose(self, names: Sequence[int], loads: Sequence[int], media: Sequence = (), salt: bytes = b"") -> int:
        """The index of the replica for a request whose page names are ``names`` and whose media digests (prompt
        order) are ``media``, under tenant ``salt``, given each replica's queue."""
        if len(loads) != len(self.replicas):
            raise InvalidRequest(f"{len(loads)} loads for {len(self.replicas)} replicas")
        key = self.route_key(names, media, salt)
        if key is not None:
            top = rendezvous_order(key, self.replicas)[0]
            if loads[top] < self.threshold:
                self.preferred += 1
                return top
        self.fallbacks += 1
        return self.rng.randrange(len(self.replicas))
