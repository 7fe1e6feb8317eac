"""StoreTier: pages shared across instances through a key-value store (Mooncake Store), verified before use.

A page goes to the store under its chain name with a self-describing payload: the process fingerprint and the salt
in clear, the page's depth, token ids, 128-bit media id, the lineage of its parent (``mmcache.tiers.lineage``), the
page layout (dtype and shape) and a checksum of its bytes. A get is a nomination only: every field is compared with
what the requesting instance expects before one byte is used, so a cross-instance hit is as exact as a device hit.

Faults: a store that fails (an exception or an error status from ``put``) is marked down; for ``probe_s`` seconds
every call is skipped and answered as a miss, then the next call probes it again. On Mooncake a dead master makes
``put`` fail only after ~4.5 s, so publishing runs on a background thread (``publish_async``) and never on a
request's path; ``get`` answers empty bytes at once, which is a miss.
"""

from __future__ import annotations

import collections
import queue
import struct
import threading
import time
from typing import Protocol

import numpy as np
import xxhash

from mmcache.names import Fingerprint
from mmcache.tiers.lineage import RequestLineage

_MAGIC = b"MMCP1\0"
_HEAD = struct.Struct("<6sQIIIII16s16sQ")  # magic, name, depth, page_size, fp, salt, layout lengths, plin, media, sum


class KVStore(Protocol):
    """What the tier needs of a store: ``put`` returns True on success; ``get`` returns b"" for an absent key."""

    def put(self, key: str, value: bytes) -> bool: ...

    def get(self, key: str) -> bytes: ...


class MemoryStore:
    """A bounded in-process store (least recently used dropped first) for sizing replays: what a store of
    ``capacity_pages`` would keep. Not shared across processes."""

    def __init__(self, capacity_pages: int):
        self.capacity_pages = int(capacity_pages)
        self._data: collections.OrderedDict[str, bytes] = collections.OrderedDict()

    def put(self, key: str, value: bytes) -> bool:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.capacity_pages:
            self._data.popitem(last=False)
        return True

    def get(self, key: str) -> bytes:
        value = self._data.get(key, b"")
        if value:
            self._data.move_to_end(key)
        return value


def page_key(name: int) -> str:
    return f"mmcache/{int(name):016x}"


def layout_of(page_shape, dtype) -> bytes:
    return f"{str(dtype).removeprefix('torch.')}{tuple(page_shape)}".encode()


def encode_page(fp_bytes: bytes, salt: bytes, layout: bytes, name: int, depth: int, tokens: np.ndarray,
                media: np.ndarray, parent_lineage: bytes, data: bytes) -> bytes:
    """One page's payload: header, fingerprint, salt, layout, token ids (int32), then the page bytes."""
    head = _HEAD.pack(_MAGIC, int(name), depth, tokens.size, len(fp_bytes), len(salt), len(layout), parent_lineage,
                      media.astype(np.uint64).tobytes(), xxhash.xxh3_64_intdigest(data))
    return b"".join((head, fp_bytes, salt, layout, tokens.astype(np.int32).tobytes(), data))


class Expected:
    """What an instance expects of every page it reads: its fingerprint, salt, layout and page bytes."""

    def __init__(self, fingerprint: Fingerprint, salt: bytes, page_shape, dtype, page_bytes: int):
        self.fp_bytes = repr(fingerprint).encode()
        self.salt, self.layout, self.page_bytes = bytes(salt), layout_of(page_shape, dtype), page_bytes
        self.page_size = fingerprint.page_size


def verify_page(payload: bytes, want: Expected, name: int, depth: int, tokens: np.ndarray, media: np.ndarray,
                parent_lineage: bytes) -> memoryview | None:
    """The page bytes of ``payload`` if every verifying field equals the request's, else None (a miss)."""
    if len(payload) < _HEAD.size:
        return None
    magic, pname, pdepth, psize, nfp, nsalt, nlay, plin, pmedia, checksum = _HEAD.unpack_from(payload)
    if (magic != _MAGIC or pname != int(name) or pdepth != depth or psize != want.page_size or plin != parent_lineage
            or pmedia != media.astype(np.uint64).tobytes()):
        return None
    view = memoryview(payload)
    a = _HEAD.size
    parts = []
    for n in (nfp, nsalt, nlay, psize * 4):
        parts.append(view[a:a + n])
        a += n
    fp, salt, layout, toks = parts
    data = view[a:]
    if (bytes(fp) != want.fp_bytes or bytes(salt) != want.salt or bytes(layout) != want.layout
            or len(data) != want.page_bytes or bytes(toks) != tokens.astype(np.int32).tobytes()
            or xxhash.xxh3_64_intdigest(data) != checksum):
        return None
    return data


class StoreTier:
    """Publish pages to a ``KVStore`` and read verified pages back; degrades to misses while the store is down."""

    def __init__(self, client: KVStore, *, probe_s: float = 5.0, publish_async: bool = True,
                 queue_pages: int = 4096, clock=time.monotonic):
        self.client, self.probe_s, self._clock = client, float(probe_s), clock
        self._down_until = None  # None: believed up; else the clock time of the next probe
        self._health = threading.Lock()
        self.counters = dict.fromkeys(("published_pages", "publish_dropped", "hit_pages", "gets", "misses",
                                       "rejected", "failures", "skipped"), 0)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        if publish_async:
            self._queue = queue.Queue(maxsize=queue_pages)
            self._thread = threading.Thread(target=self._publisher, name="mmcache-store-publish", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- health
    @property
    def up(self) -> bool:
        """False while the store is marked down and not yet due for a probe."""
        with self._health:
            return self._down_until is None or self._clock() >= self._down_until

    def _failed(self) -> None:
        with self._health:
            self.counters["failures"] += 1
            self._down_until = self._clock() + self.probe_s

    def _succeeded(self) -> None:
        with self._health:
            self._down_until = None

    # ----------------------------------------------------------------- publish
    def publish(self, items: list[tuple[str, bytes]]) -> None:
        """Put ``(key, payload)`` pairs: on the publisher thread with ``publish_async`` (dropped, and counted, when
        its queue is full or the store is down), else now."""
        for item in items:
            if self._closed:
                self.counters["publish_dropped"] += 1
                continue
            if self._queue is None:
                self._put(*item)
                continue
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self.counters["publish_dropped"] += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued page was put (or dropped); False if ``timeout`` passed first."""
        if self._queue is None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self) -> None:
        """Put what is queued, then stop the publisher thread; call it before closing the store's client (a client
        closed under a put in flight crashes Mooncake's). Later publishes are dropped and counted."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread, self._queue = None, None
            self._closed = True

    def _publisher(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._put(*item)
            finally:
                self._queue.task_done()

    def _put(self, key: str, payload: bytes) -> None:
        if not self.up:
            self.counters["publish_dropped"] += 1
            return
        try:
            ok = self.client.put(key, payload)
        except Exception:  # noqa: BLE001 - any store failure is a miss, never a request's error
            ok = False
        if ok:
            self._succeeded()
            self.counters["published_pages"] += 1
        else:
            self._failed()
            self.counters["publish_dropped"] += 1

    # ----------------------------------------------------------------- read
    def match(self, names, start: int, tokens: np.ndarray, mids: np.ndarray, lineage: RequestLineage,
              want: Expected, limit: int | None = None) -> list[memoryview]:
        """Verified page bytes for pages ``start, start+1, ...`` of a request, to the first miss, failed
        verification, or ``limit`` pages; an empty list while the store is down."""
        out, P = [], want.page_size
        if not self.up:
            self.counters["skipped"] += 1
            return out
        stop = len(names) if limit is None else min(len(names), start + limit)
        for j in range(start, stop):
            self.counters["gets"] += 1
            try:
                payload = self.client.get(page_key(names[j]))
            except Exception:  # noqa: BLE001
                self._failed()
                break
            if not payload:
                self.counters["misses"] += 1
                break
            data = verify_page(payload, want, names[j], j, tokens[j * P:(j + 1) * P], mids[j], lineage.before(j))
            if data is None:
                self.counters["rejected"] += 1
                break
            out.append(data)
        self.counters["hit_pages"] += len(out)
        return out
