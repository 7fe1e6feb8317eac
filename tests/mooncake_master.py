"""Loopback test infrastructure: free TCP ports on 127.0.0.1 (the Mooncake master's, torch.distributed's rendezvous)
and a ``mooncake_master`` for the tests and benchmarks that use a real Mooncake Store (the product module
``mmcache.tiers.mooncake`` holds only the client)."""

from __future__ import annotations

import socket
import subprocess
import time


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
    restarted master is found by clients at the same address. ``flags``: more ``mooncake_master`` flags (e.g.
    ``--default_kv_lease_ttl=200``)."""

    def __init__(self, *flags: str):
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.flags = flags
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
             f"--metrics_port={self.metrics_port}", *self.flags],
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
