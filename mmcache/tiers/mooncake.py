"""Mooncake Store as the shared tier: a client that satisfies ``mmcache.tiers.store.KVStore``. (The tests and
benchmarks start a master on loopback with ``tests/mooncake_master.py``.)

Install: ``pip install mmcache[tiers]`` (the ``mooncake-transfer-engine-non-cuda`` wheel, cp311 on Linux) and the
Debian packages ``libibverbs1 librdmacm1 libnuma1`` its binaries load. Facts measured on this machine:
../shared/notes/mooncake-store.md.
"""

from __future__ import annotations

import shutil
import threading


def available() -> str | None:
    """None when the Mooncake Store client and master can run here, else why not."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not import ({e}): pip install mooncake-transfer-engine-non-cuda and apt-get " \
               f"install libibverbs1 librdmacm1 libnuma1"
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH"
    return None


class MooncakeClient:
    """One process's Mooncake Store client (``KVStore``): it mounts ``segment_bytes`` of its memory into the store
    (objects this process puts live there, so they vanish when it exits) and reads through ``buffer_bytes``.

    The connection is made at construction and again on use after a failed setup; ``put`` returns False on any error
    status, ``get``/``get_many`` return b"" for an absent key (and for an unreachable master, at once for the first few
    calls, then after ~4.4 s each: the tier's deadline bounds that)."""

    def __init__(self, rpc_address: str, metadata_url: str, segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 128 << 20):
        self.rpc_address, self.metadata_url = rpc_address, metadata_url
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self._store = None
        self._lock = threading.Lock()  # one call at a time: Mooncake's client crashes when closed under a call
        try:  # connect now: a setup takes longer than a lookup's deadline, and must not mark the store down
            self._connected()
        except ConnectionError:
            pass  # made again on first use

    def _connected(self):
        if self._store is None:
            from mooncake.store import MooncakeDistributedStore
            store = MooncakeDistributedStore()
            if store.setup("127.0.0.1", self.metadata_url, self.segment_bytes, self.buffer_bytes, "tcp", "",
                           self.rpc_address) != 0:
                raise ConnectionError(f"Mooncake Store setup failed (master {self.rpc_address})")
            self._store = store
        return self._store

    def put(self, key: str, value: bytes) -> bool:
        with self._lock:
            return self._connected().put(key, value) == 0

    def get(self, key: str) -> bytes:
        with self._lock:
            return bytes(self._connected().get(key))

    def get_many(self, keys: list[str]) -> list[bytes]:
        """One batched read (``get_batch``): b"" for each absent key."""
        with self._lock:
            return [bytes(v) for v in self._connected().get_batch(list(keys))]

    def probe(self) -> bool:
        """Whether the master answers: ``health_check`` is instant but lags a death by seconds, so an ``is_exist``
        (an error status, after ~4.4 s, from a dead master) confirms it. For the tier's background prober only."""
        with self._lock:
            store = self._connected()
            return store.health_check() == 0 and store.is_exist("mmcache/probe") >= 0

    def close(self) -> None:
        with self._lock:
            if self._store is not None:
                self._store.close()
                self._store = None
