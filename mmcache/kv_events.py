"""KV events for external routers: what a prefix index stores and drops, published over ZMQ in vLLM's KV-event format,
so a KV-aware router (Dynamo, llm-d, vLLM's own subscriber) can index mmcache's pages, multimodal keys kept.

Wire format (vLLM ``vllm/distributed/kv_events.py``, the msgspec structs encoded ``array_like`` and ``tag``-ged as in
vLLM's ``kv_events_subscriber`` example): each ZMQ message is three frames ``(topic, seq as 8 bytes big-endian,
msgpack payload)``; the payload is a ``KVEventBatch`` ``[ts, events]`` (``[ts, events, data_parallel_rank]`` with a
rank), each event one of

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

``block_hashes`` are page names (unsigned 64-bit), ``token_ids`` the pages' ids concatenated, ``extra_keys`` one
list per page: ``["mm", <hex of the page's media blob: offset ‖ digest per medium>]`` when the page holds media and
``["salt", <hex>]`` on a depth-0 page of a salted chain (vLLM puts its ``cache_salt`` on the first block too).

Off the request path: the index calls ``stored``/``removed``/``cleared`` under the pool's lock; they only append to a
bounded queue, and a publisher thread encodes batches and sends them. An event that does not fit the queue is
dropped and counted (``counters["dropped"]``): a router's view is exact only while that stays 0.
"""

from __future__ import annotations

import queue
import threading
import time
from itertools import count

import msgpack
import numpy as np
import zmq

from mmcache.errors import InvalidRequest


class KVEventPublisher:
    """An ``IndexObserver`` that publishes vLLM-format KV events on a ZMQ PUB socket bound to ``endpoint``.

    ``block_size``: the page size. ``medium``: where the pages live ("GPU" on a CUDA pool). ``max_batch``: events per
    message at most. ``queue_events``: events held for the publisher thread; past it events are dropped (counted).
    Invariant: events leave in the order the index made them, one sequence number per message."""

    def __init__(self, endpoint: str, block_size: int, *, topic: str = "", medium: str = "GPU",
                 data_parallel_rank: int | None = None, max_batch: int = 256, queue_events: int = 100_000,
                 hwm: int = 100_000):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidRequest(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise InvalidRequest(f"endpoint must be a ZMQ address such as tcp://127.0.0.1:5557, got {endpoint!r}")
        self.block_size, self.medium, self.rank = block_size, medium, data_parallel_rank
        self.topic, self.max_batch = topic.encode(), int(max_batch)
        self.counters = {"events": 0, "messages": 0, "dropped": 0}
        self._queue: queue.Queue = queue.Queue(maxsize=queue_events)
        self._seq = count()
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(hwm)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as e:
            self._socket.close(linger=0)
            raise InvalidRequest(f"cannot bind the KV-event socket to {endpoint}: {e}") from e
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="mmcache-kv-events", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- IndexObserver (under the pool's lock)
    def stored(self, names, parent, tokens: np.ndarray, media, salt: bytes, depth: int) -> None:
        self._put(("s", names, parent, tokens, media, salt, depth))

    def removed(self, names) -> None:
        self._put(("r", names))

    def cleared(self) -> None:
        self._put(("c",))

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counters["dropped"] += 1

    # ----------------------------------------------------------------- publisher thread
    def _event(self, item) -> list:
        kind = item[0]
        if kind == "s":
            _, names, parent, tokens, media, salt, depth = item
            extra = []
            for i, blob in enumerate(media):
                keys = [["mm", blob.hex()]] if blob else []
                if salt and depth + i == 0:
                    keys.append(["salt", salt.hex()])
                extra.append(keys or None)
            return ["BlockStored", names, parent, tokens.ravel().tolist(), self.block_size, None, self.medium, None,
                    extra]
        if kind == "r":
            return ["BlockRemoved", item[1], self.medium]
        return ["AllBlocksCleared"]

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch, done, taken = [], item is None, 1
            while item is not None:
                batch.append(self._event(item))
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                taken += 1
                done = item is None
            if batch:
                body = [time.time(), batch] + ([self.rank] if self.rank is not None else [])
                self._socket.send_multipart((self.topic, next(self._seq).to_bytes(8, "big"), msgpack.packb(body)))
                self.counters["events"] += len(batch)
                self.counters["messages"] += 1
            for _ in range(taken):
                self._queue.task_done()
            if done:
                return

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued event was sent; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self) -> None:
        """Send what is queued, stop the thread, close the socket."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
            self._socket.close(linger=1000)
