"""Shadow mode of M*'s KV resource (phase 1, ``PrefixReuse(shadow=True)``): a label's streams are named and looked up
in its ``ShadowIndex`` (``mmcache.shadow``: every finished request's pages, unbounded) to measure what reuse would
match, and nothing is cut, shared or indexed. ``ReuseState`` (``mmcache.mstar.reuse_state``) hands the feeds of its
shadowed labels here and tells it when a request leaves; what it holds of a stream is the stream's own table entry,
read, never moved."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from mmcache.names import Fingerprint, as_tokens
from mmcache.shadow import ShadowIndex
from mmcache.stats import ShadowStats


class ShadowFeeds:
    """The shadow tables of ``labels`` and what each (request, label) stream was fed. ``fingerprint(label)``: what
    roots a label's names; ``stream(rid, label)``: the stream, made when the request has none for the label (under
    ``lock``); ``stored(rid, label)``: the tokens the stream holds; ``rows_left``: a feed's rows a match never cuts
    (``ShadowIndex``)."""

    __slots__ = ("labels", "fingerprint", "stream", "stored", "lock", "rows_left", "tables", "fed")

    def __init__(self, labels: frozenset, fingerprint: Callable[[str], Fingerprint],
                 stream: Callable[[str, str], object], stored: Callable[[str, str], int], lock, rows_left: int):
        self.labels, self.fingerprint, self.stream, self.stored = labels, fingerprint, stream, stored
        self.lock, self.rows_left = lock, rows_left
        self.tables: dict = {}  # label -> ShadowIndex
        # (rid, label) -> (prompt length, position -> ids fed there; None after a walk no ids describe)
        self.fed: dict = {}

    def feed(self, rid: str, label: str, token_ids, media: Sequence, salt: bytes, length: int | None) -> int:
        """The first feed of a stream is looked up in the label's ``ShadowIndex`` (named outside the pool's lock; a
        walk of embeddings by its marks, as ``ReuseState.feed`` names it); later feeds are kept by the position they
        write (a retried step overwrites its own) until a walk no ids describe. Cuts nothing: returns 0."""
        key = (rid, label)
        seen = self.fed.get(key)
        if seen is None:
            if token_ids is None:
                if not media or not length:
                    return 0  # embeddings no marks describe: nothing of this stream is measured
                token_ids = np.zeros(int(length), dtype=np.int32)
            with self.lock:
                held = self.stream(rid, label).stored_len
            if held:
                return 0  # a stream filled another way
            ids = as_tokens(token_ids)
            self.index(label).admit(rid, ids, media, salt)
            self.fed[key] = (int(ids.size), {})
            return 0
        prompt_len, fed = seen
        held = self.stored(rid, label)
        if fed is None or held < prompt_len:
            return 0  # after an unnamed walk, or a retried prefill
        if token_ids is None:
            self.fed[key] = (prompt_len, None)
        else:
            fed[held] = as_tokens(token_ids)
        return 0

    def index(self, label: str) -> ShadowIndex:
        """``label``'s shadow table (made on first use)."""
        table = self.tables.get(label)
        if table is None:
            table = self.tables[label] = ShadowIndex(self.fingerprint(label), rows_left=self.rows_left)
        return table

    def stats(self, label: str) -> ShadowStats:
        """What reuse would have matched on ``label`` so far (``ShadowIndex.stats``)."""
        return self.index(label).stats()

    def end(self, rid: str, finished: bool) -> None:
        """``rid`` left (``finished``: its pages of prompt + what was fed after it go into the table) or was reset.
        Under the lock."""
        if not self.fed:
            return
        for key in [k for k in self.fed if k[0] == rid]:
            (at, fed), table = self.fed.pop(key), self.tables[key[1]]
            if not finished:
                table.abort(rid)
                continue
            out = []
            while fed and at in fed:
                out.append(fed[at])
                at += out[-1].size
            table.finish(rid, np.concatenate(out) if out else ())
