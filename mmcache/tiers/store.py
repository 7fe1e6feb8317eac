"""StoreTier: pages shared across instances through a key-value store (Mooncake Store), verified before use.

A page goes to the store under its chain name with a self-describing payload: the process fingerprint and the salt
in clear, the page's depth, token ids, 128-bit media id, the lineage of its parent (``mmcache.tiers.lineage``), the
page layout (dtype and shape) and a checksum of its bytes (``mmcache.tiers.page_format``). A get is a nomination
only: every field is compared with what the requesting instance expects before one byte is used, so a cross-instance
hit is as exact as a device hit.

Never a stall: a lookup reads the nominated chain in batches (``get_many``, Mooncake's ``get_batch``) on the tier's
reader thread and waits for them at most ``deadline_s`` in all (one deadline for the whole lookup, not a timeout per
call). An answer that arrives after its deadline is dropped, never used; every answer used is verified first.

Up or down (``up``), decided on a failure rate, not on one call: every store call's outcome (a read on time, late or
failed; a put or a removal answered or failed) goes into a window of the last ``window_s`` seconds, and the store is
marked down when at least ``down_failures`` of those calls failed and they are at least ``down_rate`` of them. A
store that stops answering is caught sooner: while a read that missed its deadline is still in flight, lookups skip
the store at once (``skipped_late_read``), and once it has been in flight ``stall_s`` the store is marked down. While
down every lookup is a miss at once and a background prober (``probe_s``; never a request) marks it up again. On
Mooncake a dead master makes ``get`` take ~4.4 s after a few fast empty answers and ``put`` fail after ~4.5 s, so
puts run on the publisher thread (``publish_async``).

A put is published (``published_pages``/``published_entries``) only when it was stored. A full store is not an
outage: the tier removes the oldest entries it stored itself (``room_removed``; at least twice the new entry's size)
and puts once more, and a put still refused (``FULL``: ``publish_full``) is skipped, the store staying up. (Mooncake's
master evicts only entries no reader holds a lease on, 10 s after each read by default, so under steady reads it can
evict only the newest, unread entries: left to it, a full store drops what was just published.) A put whose key
holds an entry already (``EXISTS``: Mooncake's put never overwrites; ``publish_exists``) is skipped too. An entry
refused by verification (a MAC that fails, any field that differs) is removed from the store (``discard``, on the
publisher thread), so the next publish of the real bytes stores them and is served. The puts and removals are
counted by the kind of entry too (``kinds``: ``"kv"`` pages, ``"encoder"`` entries; ``counters`` holds the totals).

Authenticated entries: with a deployment ``key`` every payload ends in a keyed BLAKE2b MAC over all of it (header,
fingerprint, salt, layout, token ids, page bytes); a reader with the key refuses, and counts (``mac_failures``), an
entry whose MAC fails before looking at any field. Without a key the checksum only catches corruption: anyone who can
put to the store can serve bytes to every instance that trusts it (the README's trust model).
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from typing import Protocol

import numpy as np

from mmcache.errors import InvalidRequest
from mmcache.histogram import WaitHistogram
from mmcache.stats import KINDS  # what an entry is: a KV page (``TierStack``) or an encoder output (``EncoderTiers``)
from mmcache.tiers.lineage import RequestLineage
from mmcache.tiers.page_format import Expected, check_key, page_key, unseal, verify_page

WAIT_BOUNDS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


STORED, EXISTS, FULL, FAILED = "stored", "exists", "full", "failed"  # what a put did (``KVStore.put``)
PUBLISHED = {"kv": "published_pages", "encoder": "published_entries"}  # the counter of a kind's stored puts
KIND_COUNTERS = ("published", "publish_exists", "publish_full", "publish_dropped", "room_removed", "refused_removed")


class KVStore(Protocol):
    """What the tier needs of a store: ``put`` returns what it did: ``STORED`` (or True), ``EXISTS`` (the key holds
    an entry already, left as it is), ``FULL`` (refused for lack of space) or ``FAILED`` (or False); ``get`` returns
    b"" for an absent key. Optional: ``get_many(keys)`` (one batched read, b"" per absent key), ``remove(key)``
    (True when it removed an entry, None when the key held none, False on failure) and ``probe()`` (True when the
    store answers; the background prober calls it, else a ``get``)."""

    def put(self, key: str, value: bytes) -> bool | str: ...

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

    def get_many(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def remove(self, key: str) -> bool | None:
        return True if self._data.pop(key, None) is not None else None


class FailureWindow:
    """The outcomes of the store calls of the last ``window_s`` seconds (at most ``max_calls`` of them, the oldest
    forgotten first). ``record`` says whether the window now holds at least ``min_failures`` failures that are at
    least ``rate`` of its calls. Not thread-safe: the tier records under its health lock."""

    def __init__(self, window_s: float, min_failures: int, rate: float, clock, max_calls: int = 1024):
        self.window_s, self.min_failures, self.rate, self._clock = window_s, min_failures, rate, clock
        self._calls: collections.deque[tuple[float, bool]] = collections.deque(maxlen=max_calls)
        self._failures = 0

    def record(self, failed: bool) -> bool:
        now = self._clock()
        if len(self._calls) == self._calls.maxlen:
            self._failures -= self._calls[0][1]
        self._calls.append((now, failed))
        self._failures += failed
        while self._calls[0][0] < now - self.window_s:
            self._failures -= self._calls.popleft()[1]
        return self._failures >= self.min_failures and self._failures >= self.rate * len(self._calls)

    def clear(self) -> None:
        self._calls.clear()
        self._failures = 0


def put_outcome(answer) -> str:
    """A ``KVStore.put`` answer as one of ``STORED``, ``EXISTS``, ``FULL``, ``FAILED`` (True and False are a simple
    store's)."""
    if answer is True or answer == STORED:
        return STORED
    return answer if answer in (EXISTS, FULL) else FAILED


class StoreTier:
    """Publish pages to a ``KVStore`` and read verified pages back within a deadline; degrades to misses while the
    store is down (see the module docstring).

    ``deadline_s``: the longest one lookup waits for the store, all its batches together (None: read inline with no
    bound, for an in-process ``MemoryStore``). ``batch_pages``: pages per batched read. ``probe_s``: how often the
    background prober tries a store marked down. ``window_s``, ``down_failures``, ``down_rate``: the store is marked
    down when, over the last ``window_s`` seconds, at least ``down_failures`` calls failed and they are at least
    ``down_rate`` of its calls. ``stall_s``: how long a read past its deadline may stay in flight before the store is
    marked down. ``own_entries``: how many of the entries it stored the tier remembers (oldest forgotten first), to
    make room in a full store. ``key``: the deployment key (16-64 bytes) that authenticates entries.

    Invariants: no request thread waits on the store past its deadline or calls it while it is marked down or while
    an earlier read is in flight past its deadline; no byte of an answer is used before it is verified (MAC, then
    every field); an answer after its deadline is dropped; a put is counted published only when the store stored it.
    """

    def __init__(self, client: KVStore, *, probe_s: float = 5.0, deadline_s: float | None = 0.05,
                 batch_pages: int = 16, publish_async: bool = True, queue_pages: int = 4096,
                 key: bytes | None = None, window_s: float = 10.0, down_failures: int = 3, down_rate: float = 0.5,
                 stall_s: float = 1.0, own_entries: int = 1 << 16, clock=time.monotonic):
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidRequest(f"deadline_s must be positive or None, got {deadline_s!r}")
        for name, value in (("batch_pages", batch_pages), ("down_failures", down_failures)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequest(f"{name} must be a positive integer, got {value!r}")
        if not (window_s > 0 and stall_s > 0 and 0 < down_rate <= 1):
            raise InvalidRequest(f"window_s and stall_s must be positive and down_rate in (0, 1], got "
                                 f"{window_s!r}, {stall_s!r}, {down_rate!r}")
        self.key = check_key(key)
        self.client, self.probe_s, self._clock = client, float(probe_s), clock
        self.deadline_s, self.batch_pages, self.stall_s = deadline_s, batch_pages, float(stall_s)
        self._down = False
        self._health = threading.Condition()
        self._window = FailureWindow(float(window_s), down_failures, float(down_rate), clock)
        self._late_read: tuple[concurrent.futures.Future, float] | None = None  # in flight past its deadline
        # (key, bytes, kind) of the entries it stored, oldest first
        self._own: collections.deque[tuple[str, int, str]] = collections.deque(maxlen=own_entries)
        self.counters = dict.fromkeys(("published_pages", "published_entries", "publish_dropped", "publish_full",
                                       "publish_exists", "room_removed", "hit_pages", "gets", "batches", "misses",
                                       "rejected", "mac_failures", "refused_removed", "failures", "late",
                                       "read_errors", "skipped", "skipped_late_read", "marked_down", "probes"), 0)
        self.kinds = {kind: dict.fromkeys(KIND_COUNTERS, 0) for kind in KINDS}  # the puts and removals per kind
        self.wait = WaitHistogram(WAIT_BOUNDS)  # seconds each lookup that asked the store spent reading it
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._prober: threading.Thread | None = None
        self._reader = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmcache-store-read")
                        if deadline_s is not None else None)
        self._closed = False
        if publish_async:
            self._queue = queue.Queue(maxsize=queue_pages)
            self._thread = threading.Thread(target=self._publisher, name="mmcache-store-publish", daemon=True)
            self._thread.start()

    # ----------------------------------------------------------------- health
    @property
    def up(self) -> bool:
        """False while the store is marked down (until the background prober finds it answering again)."""
        return not self._down

    def _called(self, failed: bool, took: float = 0.0) -> None:
        """Record one store call's outcome; mark the store down when the window's failure rate says so, or at once
        for a call that failed after ``took`` >= ``stall_s`` (a store that stopped answering, as a read stuck past
        its deadline)."""
        with self._health:
            self.counters["failures"] += failed
            if (self._window.record(failed) or failed and took >= self.stall_s) and not self._down:
                self._mark_down()

    def _mark_down(self) -> None:
        """Mark the store down (counted once per fall: ``marked_down``) and start the background prober if none
        runs."""
        with self._health:
            if not self._down:
                self.counters["marked_down"] += 1
            self._down = True
            if self._prober is None and not self._closed:
                self._prober = threading.Thread(target=self._probe_loop, name="mmcache-store-probe", daemon=True)
                self._prober.start()
            self._health.notify_all()

    def _probe_loop(self) -> None:
        """While the store is marked down, try it every ``probe_s`` (off every request's path); mark it up, with an
        empty failure window, when it answers. Exits at ``close``."""
        while True:
            with self._health:
                while not self._closed and not self._down:
                    self._health.wait()
                if self._closed or self._health.wait_for(lambda: self._closed, self.probe_s):
                    return
            self.counters["probes"] += 1
            try:
                probe = getattr(self.client, "probe", None)
                ok = probe() if probe is not None else (self.client.get("mmcache/probe") is not None)
            except Exception:  # noqa: BLE001 - a failed probe leaves the store down
                ok = False
            if ok:
                with self._health:
                    self._window.clear()
                    self._down = False

    # ----------------------------------------------------------------- publish
    def publishing(self, items: int, kind: str = "kv") -> bool:
        """Whether ``items`` entries of ``kind`` may be published now. The one rule for a store marked down: what
        would be published is dropped and counted (``publish_dropped``), whether a publisher asks before encoding its
        entries (``TierStack.publish``, ``EncoderTiers.publish``: their bytes are then never read) or the put is
        about to be made (``_put``, for entries queued before the store went down). A full store is not down."""
        if not self.up:
            self._count(kind, "publish_dropped", items)
            return False
        return True

    def publish(self, items: list[tuple[str, bytes]], kind: str = "kv") -> None:
        """Put ``(key, payload)`` pairs of ``kind`` (``KINDS``: ``"kv"`` pages, ``"encoder"`` entries): on the
        publisher thread with ``publish_async`` (dropped, and counted, when its queue is full or the store is down),
        else now. A stored put counts in ``PUBLISHED[kind]`` (``published_pages``, ``published_entries``)."""
        for key, payload in items:
            if not self._submit(self._put, key, payload, kind):
                self._count(kind, "publish_dropped")

    def discard(self, key: str, kind: str = "kv") -> None:
        """Remove the entry of ``kind`` under ``key``, which a reader refused (its MAC or a field failed): Mooncake's
        put never overwrites, so until it is gone the real entry cannot be stored there. On the publisher thread (now
        without ``publish_async``); skipped while the store is down, when the queue is full or the store cannot
        remove."""
        if self.up and getattr(self.client, "remove", None) is not None:
            self._submit(self._remove, key, kind)

    def _count(self, kind: str, what: str, n: int = 1) -> None:
        """Count ``n`` puts or removals of ``kind`` as ``what`` (a ``KIND_COUNTERS`` name): in ``kinds[kind]`` and
        in ``counters``, whose totals are over both kinds (``published`` is ``PUBLISHED[kind]`` there)."""
        self.kinds[kind][what] += n
        self.counters[PUBLISHED[kind] if what == "published" else what] += n

    def _submit(self, call, *args) -> bool:
        """Run ``call(*args)`` on the publisher thread (now without one); False when it was not taken (closed, or
        the queue full)."""
        if self._closed:
            return False
        if self._queue is None:
            call(*args)
            return True
        try:
            self._queue.put_nowait((call, args))
        except queue.Full:
            return False
        return True

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
        """Put what is queued, then stop the publisher, the prober and the reader (waiting for a call in flight);
        call it before closing the store's client (a client closed under a call crashes Mooncake's). Later
        publishes are dropped and counted, later lookups miss."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread, self._queue = None, None
        with self._health:
            self._closed = True
            self._health.notify_all()
        if self._prober is not None:
            self._prober.join()
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    def _publisher(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                call, args = item
                call(*args)
            finally:
                self._queue.task_done()

    def _put(self, key: str, payload: bytes, kind: str) -> None:
        """One put of ``kind``, counted by what the store did with it: stored (``published``), already held
        (``publish_exists``), refused for lack of space even after ``_make_room`` (``publish_full``), or failed
        (``publish_dropped``, and a failed call)."""
        if not self.publishing(1, kind):  # down since it was queued
            return
        outcome = self._put_once(key, payload)
        if outcome == FULL and self._make_room(len(payload)):
            outcome = self._put_once(key, payload)
        if outcome == STORED:
            self._own.append((key, len(payload), kind))
        self._count(kind, {STORED: "published", EXISTS: "publish_exists", FULL: "publish_full",
                           FAILED: "publish_dropped"}[outcome])

    def _put_once(self, key: str, payload: bytes) -> str:
        started = self._clock()
        try:
            outcome = put_outcome(self.client.put(key, payload))
        except Exception:  # noqa: BLE001 - any store failure is a miss, never a request's error
            outcome = FAILED
        self._called(outcome == FAILED, self._clock() - started)
        return outcome

    def _make_room(self, nbytes: int) -> bool:
        """Remove the oldest entries this tier stored until twice ``nbytes`` went (``room_removed``, by the kind of
        the entry removed); whether any did. Entries the store already evicted free nothing and are passed over."""
        if getattr(self.client, "remove", None) is None:
            return False
        freed = 0
        while freed < 2 * nbytes and self.up:
            try:
                key, size, kind = self._own.popleft()
            except IndexError:  # nothing of its own left (publishers without a publisher thread may race here)
                break
            started = self._clock()
            try:
                removed = self.client.remove(key)
            except Exception:  # noqa: BLE001 - a failed removal frees nothing
                removed = False
            self._called(removed is False, self._clock() - started)
            if removed is True:
                freed += size
                self._count(kind, "room_removed")
        return freed > 0

    def _remove(self, key: str, kind: str) -> None:
        """One removal of a refused entry of ``kind`` (``refused_removed`` once the key holds nothing: removed, or
        gone already)."""
        if not self.up:
            return
        started = self._clock()
        try:
            removed = self.client.remove(key)
        except Exception:  # noqa: BLE001 - left for a later reader to refuse and remove again
            removed = False
        self._count(kind, "refused_removed", int(removed is not False))
        self._called(removed is False, self._clock() - started)

    # ----------------------------------------------------------------- read
    def _get_many(self, keys: list[str]) -> list[bytes]:
        get_many = getattr(self.client, "get_many", None)
        return get_many(keys) if get_many is not None else [self.client.get(k) for k in keys]

    def _read(self, keys: list[str], deadline: float | None) -> list[bytes] | None:
        """One batched read, waited for until ``deadline``; None when it failed or came late (a late answer is
        dropped when it comes; a late read is remembered until it ends). Each read is one outcome for the window."""
        self.counters["batches"] += 1
        self.counters["gets"] += len(keys)
        future = None
        try:
            if self._reader is None:
                out = self._get_many(keys)
            else:
                future = self._reader.submit(self._get_many, keys)
                out = future.result(timeout=max(0.0, deadline - self._clock()))
        except concurrent.futures.TimeoutError:
            self.counters["late"] += 1
            self._late_read = (future, deadline)
        except Exception:  # noqa: BLE001 - a failed read is a miss (RuntimeError once the reader is shut down)
            self.counters["read_errors"] += 1
        else:
            self._called(False)
            return out
        self._called(True)
        return None

    def _may_read(self) -> bool:
        """Whether a lookup may ask the store now: not while it is marked down or closed (``skipped``), nor while a
        read past its deadline is still in flight (``skipped_late_read``; once that read has been in flight
        ``stall_s`` past its deadline the store is marked down)."""
        if not self.up or self._closed:
            self.counters["skipped"] += 1
            return False
        late = self._late_read
        if late is None:
            return True
        future, since = late
        if future.done():
            self._late_read = None
            return True
        self.counters["skipped_late_read"] += 1
        if self._clock() - since >= self.stall_s:
            self._mark_down()
        return False

    def fetch(self, keys: list[str]) -> list[bytes]:
        """The stored payloads of ``keys`` (b"" for each absent one, and for those not read: the store down, a failed
        read, the deadline passed), read in batches of ``batch_pages`` within one deadline for the whole call. Takes
        no lock; verifies nothing: the caller verifies every payload before it uses a byte (encoder entries:
        ``mmcache.tiers.encoder_entry``) and ``discard``s one it refuses."""
        out = [b""] * len(keys)
        if not keys or not self._may_read():
            return out
        started = self._clock()
        deadline = None if self.deadline_s is None else started + self.deadline_s
        for j in range(0, len(keys), self.batch_pages):
            payloads = self._read(keys[j:j + self.batch_pages], deadline)
            if payloads is None:
                break
            out[j:j + len(payloads)] = payloads
        self.wait.observe(self._clock() - started)
        return out

    def match(self, names, start: int, tokens: np.ndarray, mids: np.ndarray, lineage: RequestLineage,
              want: Expected, limit: int | None = None) -> list[memoryview]:
        """Verified page bytes for pages ``start, start+1, ...`` of a request, to the first miss, failed
        verification, ``limit`` pages or the deadline; an empty list while the store is down. Takes no lock."""
        out, P = [], want.page_size
        if not self._may_read():
            return out
        started = self._clock()
        deadline = None if self.deadline_s is None else started + self.deadline_s
        stop = len(names) if limit is None else min(len(names), start + limit)
        j = start
        while j < stop:
            keys = [page_key(n) for n in names[j:min(stop, j + self.batch_pages)]]
            payloads = self._read(keys, deadline)
            if payloads is None:
                break
            for key, payload in zip(keys, payloads):
                data = self._verified(payload, want, names[j], j, tokens[j * P:(j + 1) * P], mids[j], lineage)
                if data is None and payload:  # refused: removed, so the real entry can be stored again
                    self.discard(key)
                if data is None:
                    break
                out.append(data)
                j += 1
            else:
                continue
            break
        self.counters["hit_pages"] += len(out)
        if stop > start:  # it read the store
            self.wait.observe(self._clock() - started)
        return out

    def _verified(self, payload: bytes, want: Expected, name: int, j: int, tokens: np.ndarray, mid: np.ndarray,
                  lineage: RequestLineage) -> memoryview | None:
        if not payload:
            self.counters["misses"] += 1
            return None
        if self.key is not None:
            payload = unseal(payload, self.key)
            if payload is None:
                self.counters["mac_failures"] += 1
                return None
        data = verify_page(payload, want, name, j, tokens, mid, lineage.before(j), keyed=self.key is not None)
        if data is None:
            self.counters["rejected"] += 1
        return data
