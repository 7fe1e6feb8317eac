"""Mooncake Store as the shared tier: a client that satisfies ``mmcache.tiers.store.KVStore``. (The tests and
benchmarks start a master on loopback with ``tests/mooncake_master.py``.)

Install: ``pip install -e ".[tiers]"`` (the ``mooncake-transfer-engine-non-cuda`` wheel: CPython 3.11 on Linux only)
and the Debian packages ``libibverbs1 librdmacm1 libnuma1`` its binaries load (``install_advice`` says what to do
elsewhere). What was measured of Mooncake Store (start, client calls, faults): docs/tiers.md.
"""

from __future__ import annotations

import shutil
import sys
import threading

from mmcache.tiers.store import EXISTS, FAILED, FULL, STORED

NO_AVAILABLE_HANDLE = -200  # Mooncake's ErrorCode for a put refused for lack of space (the store is full)
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


WHEEL_PYTHON = (3, 11)  # the one CPython mooncake-transfer-engine-non-cuda 0.3.13.post1 is built for (Linux)
SYSTEM_LIBRARIES = "apt-get install libibverbs1 librdmacm1 libnuma1"


def install_advice(python: tuple[int, int] = sys.version_info[:2], platform: str = sys.platform) -> str:
    """What to run for a Mooncake Store client on ``python`` and ``platform``: the ``tiers`` extra where its wheel
    exists; elsewhere, where pip cannot install it, a Python 3.11 venv on Linux for the store tier and its tests."""
    if platform == "linux" and tuple(python) == WHEEL_PYTHON:
        return f'pip install -e ".[tiers]" and {SYSTEM_LIBRARIES}'
    return (f"its client (mooncake-transfer-engine-non-cuda) is built for CPython 3.11 on Linux only, so pip cannot "
            f"install it for Python {python[0]}.{python[1]} on {platform}; for the store tier and its tests, use a "
            f'Python 3.11 venv on Linux (python3.11 -m venv .venv-3.11, then pip install -e ".[dev]" in it) and '
            f"{SYSTEM_LIBRARIES}; everything else runs on this Python")


def available() -> str | None:
    """None when the Mooncake Store client and master can run here, else why not and what to do."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as e:
        return f"mooncake.store does not import ({e}): {install_advice()}"
    if shutil.which("mooncake_master") is None:
        return "mooncake_master is not on PATH"
    return None


class MooncakeClient:
    """One process's Mooncake Store client (``KVStore``): it mounts ``segment_bytes`` of its memory into the store
    (objects this process puts live there, so they vanish when it exits) and reads through ``buffer_bytes``.

    The connection is made at construction and again on use after a failed setup; ``put`` says what it did
    (``mmcache.tiers.store.STORED``, ``EXISTS``, ``FULL`` or ``FAILED``), ``get``/``get_many`` return b"" for an absent
    key (and for an unreachable master, at once for the first few calls, then after ~4.4 s each: the tier's deadline
    bounds that), ``remove`` removes a key even while a reader's lease holds it."""

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

    def put(self, key: str, value: bytes) -> str:
        """Store ``value`` under ``key`` unless the key holds an entry already. Mooncake's put answers 0 for a key it
        already holds (and leaves that entry), so an ``is_exist`` first tells ``EXISTS`` from ``STORED``; a put
        refused for lack of space is ``FULL`` (the master evicts in the background, a later put may fit)."""
        with self._lock:
            store = self._connected()
            held = store.is_exist(key)
            if held != 0:  # 1: held; an error status (a dead master's, after seconds): no put to wait on too
                return EXISTS if held == 1 else FAILED
            status = store.put(key, value)
        if status == 0:
            return STORED
        return {NO_AVAILABLE_HANDLE: FULL, OBJECT_ALREADY_EXISTS: EXISTS}.get(status, FAILED)

    def remove(self, key: str) -> bool | None:
        """Remove ``key``'s entry (forced: a reader that just read it holds a lease on it, and a refused entry must
        go now; a reader that reads it meanwhile verifies what it gets): True when removed, None when the key held
        nothing, False on an error status."""
        with self._lock:
            status = self._connected().remove(key, True)
        return True if status == 0 else None if status == OBJECT_NOT_FOUND else False

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
