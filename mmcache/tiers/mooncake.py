"""Mooncake Store as the shared tier: a client that satisfies ``mmcache.tiers.store.KVStore``, and a master process
on loopback for tests, benchmarks and single-machine use.

Install: ``pip install mmcache[tiers]`` (the ``mooncake-transfer-engine-non-cuda`` wheel, cp311 on Linux) and the
Debian packages ``libibverbs1 librdmacm1 libnuma1`` its binaries load. Facts measured on this machine:
../shared/notes/mooncake-store.md.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (free when asked; the OS may hand them out later)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class MooncakeMaster:
    """A ``mooncake_master`` on 127.0.0.1 with its RPC, HTTP metadata and metrics/admin ports all free ones (the
    admin port defaults to 9003, which parallel runs would fight over). ``stop``/``start`` keep the ports, so a
    restarted master is found by clients at the same address."""

    def __init__(self):
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.proc: subprocess.Popen | None = None

    @property
    def rpc_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self, timeout: float = 20.0) -> MooncakeMaster:
        self.proc = subprocess.Popen(
            ["mooncake_master", "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.http_port}", "--metrics_host=127.0.0.1",
             f"--metrics_port={self.metrics_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with status {self.proc.returncode}")
            if all(_listening(p) for p in (self.rpc_port, self.http_port)):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on {self.rpc_port}/{self.http_port} in {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class MooncakeClient:
    """One process's Mooncake Store client (``KVStore``): it mounts ``segment_bytes`` of its memory into the store
    (objects this process puts live there, so they vanish when it exits) and reads through ``buffer_bytes``.

    The connection is made on first use and again after a failed setup; ``put`` returns False on any error status,
    ``get`` returns b"" for an absent key (and for an unreachable master, which Mooncake answers at once)."""

    def __init__(self, rpc_address: str, metadata_url: str, segment_bytes: int = 256 << 20,
                 buffer_bytes: int = 128 << 20):
        self.rpc_address, self.metadata_url = rpc_address, metadata_url
        self.segment_bytes, self.buffer_bytes = segment_bytes, buffer_bytes
        self._store = None

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
        return self._connected().put(key, value) == 0

    def get(self, key: str) -> bytes:
        return bytes(self._connected().get(key))

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None
