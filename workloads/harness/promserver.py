"""A real Prometheus server on loopback, scraping given targets: what the tests and benchmarks check the exporter
and the Grafana dashboard against.

``PrometheusServer`` runs the ``prometheus`` binary (Debian's package installs it on ``PATH``) as a child process with
a generated config and a fresh storage folder, on ``127.0.0.1`` and a free port, never the package's defaults
(``/etc/prometheus``, port 9090). ``query`` and ``query_range`` call its HTTP API; a non-``success`` answer raises.
Leaving the ``with`` block stops the child and removes its folder.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice; a race with other processes is possible but rare)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def duration(seconds: float) -> str:
    """``seconds`` as a Prometheus duration in whole milliseconds (``250ms``)."""
    return f"{max(1, round(seconds * 1000))}ms"


def grafana_rate_interval(scrape_s: float, step_s: float) -> float:
    """Grafana's ``$__rate_interval`` for a panel drawn at ``step_s``: max(step + scrape, 4 x scrape)."""
    return max(step_s + scrape_s, 4 * scrape_s)


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (``host:port``) every ``interval_s``; use as a context manager."""

    def __init__(self, targets: list[str], interval_s: float = 0.25, binary: str = "prometheus",
                 ready_timeout_s: float = 60.0):
        self.targets, self.interval_s, self.ready_timeout_s = list(targets), interval_s, ready_timeout_s
        self.binary = shutil.which(binary)
        if self.binary is None:
            raise FileNotFoundError(f"no {binary!r} on PATH (Debian: apt-get install prometheus)")
        self.port = self._dir = self._proc = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self._dir = Path(tempfile.mkdtemp(prefix="mmcache-prometheus-"))
        every = duration(self.interval_s)
        config = {"global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
                  "scrape_configs": [{"job_name": "mmcache", "static_configs": [{"targets": self.targets}]}]}
        (self._dir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.port = free_port()
        self._log = open(self._dir / "prometheus.log", "wb")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={self._dir / 'prometheus.yml'}", f"--storage.tsdb.path={self._dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.log()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready after {self.ready_timeout_s:g} s: {self.log()[-2000:]}")

    def log(self) -> str:
        return (self._dir / "prometheus.log").read_text(errors="replace") if self._dir else ""

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None
            self._log.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _api(self, path: str, **params) -> list[dict]:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # a bad query answers 400 with the reason in the body
            body = json.load(e)
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector ``[{"metric": {...}, "value": [t, "v"]}, ...]`` of ``expr`` at ``at`` (default: now)."""
        return self._api("query", query=expr, **({} if at is None else {"time": f"{at:.3f}"}))

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        """Matrix ``[{"metric": {...}, "values": [[t, "v"], ...]}, ...]`` of ``expr`` from ``start`` to ``end``."""
        return self._api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step_s:g}")

    def targets_up(self) -> list[dict]:
        """The active scrape targets with their health (``up``, ``down``, ``unknown``)."""
        return [{"url": t["scrapeUrl"], "health": t["health"], "error": t["lastError"]}
                for t in self._json("targets")["activeTargets"]]

    def _json(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=30) as resp:
            return json.load(resp)["data"]
