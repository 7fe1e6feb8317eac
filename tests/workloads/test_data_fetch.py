"""``mmcache data fetch`` against a local HTTP server on 127.0.0.1 (never another host): checksums, resume, errors."""

import hashlib
import http.server
import json
import threading

import pytest

from workloads import datasets
from workloads.cli import main

FILES = {"a/trace.jsonl": b'{"timestamp": 0}\n' * 500, "b/1.json": b"[1]", "b/2.json": b"[2, 2]"}


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves FILES; honours ``Range: bytes=N-`` with a 206 unless the server was told to ignore ranges."""

    ignore_ranges = False
    requests: list = []

    def do_GET(self):
        body = FILES.get(self.path.lstrip("/"))
        type(self).requests.append((self.path, self.headers.get("Range")))
        if body is None:
            self.send_error(404)
            return
        start = 0
        if (rng := self.headers.get("Range")) and not self.ignore_ranges:
            start = int(rng.removeprefix("bytes=").rstrip("-"))
            if start >= len(body):
                self.send_error(416)
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    RangeHandler.requests, RangeHandler.ignore_ranges = [], False
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def manifest(tmp_path, base, sha=None, size=None):
    trace = FILES["a/trace.jsonl"]
    doc = {"sources": [
        {"name": "one", "what": "a trace", "read_by": "tests", "licence": "CC0-1.0", "home": base,
         "files": [{"url": f"{base}/a/trace.jsonl", "path": "one/trace.jsonl",
                    "size": len(trace) if size is None else size,
                    "sha256": hashlib.sha256(trace).hexdigest() if sha is None else sha}]},
        {"name": "many", "what": "files by id", "read_by": "tests", "licence": "MIT", "home": base,
         "files": [{"url": f"{base}/b/{{id}}.json", "path": "many/{id}.json", "ids": ["1", "2"]}]},
        {"name": "byhand", "what": "converted", "read_by": "tests", "licence": "CC0-1.0", "home": base,
         "files": [], "manual": "convert it yourself"}]}
    path = tmp_path / "sources.json"
    path.write_text(json.dumps(doc))
    return path


def test_fetch_downloads_verifies_and_names_source_and_licence(tmp_path, server, capsys):
    data = tmp_path / "data"
    data.mkdir()
    assert main(["data", "fetch", "--manifest", str(manifest(tmp_path, server)), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    assert (data / "one/trace.jsonl").read_bytes() == FILES["a/trace.jsonl"]
    assert (data / "many/2.json").read_bytes() == b"[2, 2]" and not list(data.rglob("*.part"))
    assert f"source {server}; licence CC0-1.0" in out and "size and sha256 checked" in out
    assert "sha256 " + hashlib.sha256(b"[1]").hexdigest() + ", not on record" in out
    assert "not fetched by default, made by hand: byhand (mmcache data fetch NAME says how)" in out
    assert main(["data", "fetch", "one", "--manifest", str(manifest(tmp_path, server)), "--data", str(data)]) == 0
    assert "present one/trace.jsonl" in capsys.readouterr().out  # verified in place, not fetched again


def test_fetch_resumes_a_partial_download_with_a_range_request(tmp_path, server):
    sources = datasets.load_sources(manifest(tmp_path, server))
    part = tmp_path / "one" / "trace.jsonl.part"
    part.parent.mkdir()
    part.write_bytes(FILES["a/trace.jsonl"][:1000])
    datasets.fetch([sources["one"]], tmp_path, progress=False)
    assert RangeHandler.requests == [("/a/trace.jsonl", "bytes=1000-")]
    assert (tmp_path / "one/trace.jsonl").read_bytes() == FILES["a/trace.jsonl"] and not part.exists()


def test_a_server_that_ignores_the_range_restarts_the_file(tmp_path, server):
    RangeHandler.ignore_ranges = True
    part = tmp_path / "one" / "trace.jsonl.part"
    part.parent.mkdir()
    part.write_bytes(b"garbage")
    datasets.fetch([datasets.load_sources(manifest(tmp_path, server))["one"]], tmp_path, progress=False)
    assert (tmp_path / "one/trace.jsonl").read_bytes() == FILES["a/trace.jsonl"]


def test_a_checksum_mismatch_deletes_the_download_and_fails_in_one_line(tmp_path, server, capsys):
    bad = manifest(tmp_path, server, sha="0" * 64)
    assert main(["data", "fetch", "one", "--manifest", str(bad), "--data", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{server}/a/trace.jsonl: sha256 " in err and "expected 000" in err
    assert not (tmp_path / "one" / "trace.jsonl").exists() and not list(tmp_path.rglob("*.part"))


def test_a_missing_file_on_the_server_says_run_again_to_resume(tmp_path, server, capsys):
    doc = json.loads(manifest(tmp_path, server).read_text())
    doc["sources"][0]["files"][0]["url"] = f"{server}/nothing.jsonl"
    (tmp_path / "sources.json").write_text(json.dumps(doc))
    assert main(["data", "fetch", "one", "--manifest", str(tmp_path / "sources.json"), "--data", str(tmp_path)]) == 1
    assert "cannot fetch" in capsys.readouterr().err


def test_unknown_source_fails_before_fetching(tmp_path, server, capsys):
    assert main(["data", "fetch", "one", "nope", "--manifest", str(manifest(tmp_path, server)),
                 "--data", str(tmp_path)]) == 2
    assert "unknown data source 'nope'" in capsys.readouterr().err and not RangeHandler.requests


def test_shipped_manifest_names_every_workload_data_path():
    from workloads import registry
    sources = datasets.load_sources()
    paths = {f.path for s in sources.values() for f in s.files} | {s.name for s in sources.values() if not s.files}
    for w in registry.WORKLOADS.values():
        if w.data_path and not getattr(w, "generated", False):
            assert any(p == w.data_path or p.startswith(w.data_path + "/") or w.data_path.startswith(p + "/")
                       for p in paths), w.name
    assert all(s.licence and s.home.startswith("https://") for s in sources.values())


def test_list_says_what_is_present(tmp_path, server, capsys):
    assert main(["data", "list", "--manifest", str(manifest(tmp_path, server)), "--data", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of 1 files present" in out and "made by hand, folder missing" in out and not RangeHandler.requests
