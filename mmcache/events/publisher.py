"""KVEventPublisher: KV and encoder-output events on ZMQ PUB sockets, in the format vLLM's consumers decode.

It is an ``IndexObserver`` (``mmcache.prefix_index``: pages stored, removed, cleared) and an ``EncoderObserver``
(``mmcache.encoder_store``: outputs stored, removed). KV events go out under ``topic`` on the socket bound to
``endpoint``; encoder-output events under ``encoder_topic`` on a socket of their own (``encoder_endpoint``), each
topic numbered on its own (``mmcache.events.wire``). So a subscriber to every topic on the KV endpoint (Dynamo's relay
subscribes to "") sees vLLM's stream exactly, never an encoder message.

Off the request path: the caches call under the pool's lock; the calls only append to a bounded queue, and a
publisher thread builds the events (``EventBuilder``), encodes batches and sends them. A call that does not fit the
queue is dropped and counted (``counters["dropped"]``): a router's view is exact only while that stays 0.
"""

from __future__ import annotations

import queue
import threading
import time

import zmq

from mmcache.errors import InvalidRequest
from mmcache.events.builder import EventBuilder
from mmcache.events.extra_keys import DIGEST_BYTES
from mmcache.events.schema import ENCODINGS
from mmcache.events.wire import DEFAULT_ENCODER_TOPIC, Framer, encode_batch


def encoder_endpoint_beside(endpoint: str) -> str:
    """The encoder-output socket's default address beside the KV socket's bound ``endpoint``: the same interface on a
    port of its own for TCP (``tcp://127.0.0.1:*``, read back from ``encoder_endpoint``), the same name with
    ``-encoder`` for IPC and in-process sockets."""
    transport, _, address = endpoint.partition("://")
    if transport == "tcp":
        return f"tcp://{address.rpartition(':')[0]}:*"
    return f"{endpoint}-encoder"


class KVEventPublisher:
    """Publishes KV events on a ZMQ PUB socket bound to ``endpoint`` (its bound address: ``self.endpoint``) and
    encoder-output events on one bound to ``encoder_endpoint`` (default ``encoder_endpoint_beside(endpoint)``; its
    bound address: ``self.encoder_endpoint``).

    ``block_size``: the page size. ``medium``: where the pages live ("GPU" on a CUDA pool). ``encoding``: ``"map"``
    (vLLM since PR #42892) or ``"array"`` (vLLM before it). ``data_parallel_rank``: sent in every batch (0, as vLLM
    sends without data parallelism). ``digest_bytes``: the media digests' length (16 for xxh3-128, 32 for blake2b and
    sha256). ``max_batch``: events per message at most. ``queue_events``: calls held for the publisher thread; past
    it they are dropped (counted). Invariant: each socket's events leave in the order the caches made them."""

    def __init__(self, endpoint: str, block_size: int, *, topic: str = "", encoder_endpoint: str | None = None,
                 encoder_topic: str = DEFAULT_ENCODER_TOPIC, medium: str = "GPU", encoding: str = "map",
                 data_parallel_rank: int | None = 0, digest_bytes: int = DIGEST_BYTES, max_batch: int = 256,
                 queue_events: int = 100_000, hwm: int = 100_000):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidRequest(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise InvalidRequest(f"endpoint must be a ZMQ address such as tcp://127.0.0.1:5557, got {endpoint!r}")
        if encoding not in ENCODINGS:
            raise InvalidRequest(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        self.block_size, self.medium, self.rank, self.encoding = block_size, medium, data_parallel_rank, encoding
        self.topic, self.encoder_topic, self.max_batch = topic.encode(), encoder_topic.encode(), int(max_batch)
        self.counters = {"events": 0, "messages": 0, "dropped": 0}
        self._builder = EventBuilder(block_size, medium, digest_bytes)
        self._queue: queue.Queue = queue.Queue(maxsize=queue_events)
        self._socket = _bound("KV-event", endpoint, hwm)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        try:
            self._encoder_socket = _bound("encoder-event", encoder_endpoint or encoder_endpoint_beside(self.endpoint),
                                          hwm)
        except InvalidRequest:
            self._socket.close(linger=0)
            raise
        self.encoder_endpoint = self._encoder_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # a stream per socket, each numbering its own messages: (socket, topic, framer)
        self._kv = (self._socket, self.topic, Framer())
        self._encoder = (self._encoder_socket, self.encoder_topic, Framer())
        self._thread = threading.Thread(target=self._run, name="mmcache-kv-events", daemon=True)
        self._thread.start()

    @property
    def unsized_media(self) -> int:
        """Media items whose placeholder count was never described: their keys ride on their first page only."""
        return self._builder.spans.unsized

    def describe_media(self, digest, tokens: int) -> None:
        """The media item named ``digest`` spans ``tokens`` placeholder tokens; tell it before its pages are stored
        (at admission) so its key rides on every page it overlaps, as vLLM's do."""
        self._builder.describe_media(digest, tokens)

    # ----------------------------------------------------------------- IndexObserver (under the pool's lock)
    def stored(self, names, parent, tokens, media, salt: bytes, depth: int) -> None:
        self._put(("stored", names, parent, tokens, media, salt, depth))

    def removed(self, names) -> None:
        self._put(("removed", names))

    def cleared(self) -> None:
        self._put(("cleared",))

    # ----------------------------------------------------------------- EncoderObserver (under the pool's lock)
    def encoder_stored(self, key, nbytes: int) -> None:
        self._put(("encoder_stored", key, nbytes))

    def encoder_removed(self, keys) -> None:
        for key in keys:
            self._put(("encoder_removed", key))

    def _put(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.counters["dropped"] += 1

    # ----------------------------------------------------------------- publisher thread
    def _send(self, stream: tuple, events: list) -> None:
        socket, topic, framer = stream
        socket.send_multipart(framer.frames(topic, encode_batch(events, self.encoding, self.rank)))
        self.counters["events"] += len(events)
        self.counters["messages"] += 1

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch, stream, taken, done = [], None, 0, False
            while True:
                taken += 1
                if item is None:
                    done = True
                    break
                kind = item[0]
                event = getattr(self._builder, kind)(*item[1:])
                where = self._encoder if kind.startswith("encoder") else self._kv
                if batch and where is not stream:  # one stream per message
                    self._send(stream, batch)
                    batch = []
                batch.append(event)
                stream = where
                if len(batch) >= self.max_batch:
                    break
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._send(stream, batch)
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
            self._encoder_socket.close(linger=1000)


def _bound(what: str, endpoint: str, hwm: int):
    """A PUB socket bound to ``endpoint``; ``InvalidRequest`` naming ``what`` it is for when it cannot bind."""
    socket = zmq.Context.instance().socket(zmq.PUB)
    socket.set_hwm(hwm)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise InvalidRequest(f"cannot bind the {what} socket to {endpoint}: {e}") from e
    return socket
