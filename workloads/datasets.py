"""The public data sets the replays read, and their download into the folder ``--data`` reads (``mmcache data``).

The manifest (``workloads/data/sources.json``) lists each source: what it is, which commands read it, its licence,
its home page, and its files (URL, path under the data folder, and the size and sha256 where they are known; an
entry with ``ids`` stands for one file per id, ``{id}`` filled in). A source without files cannot be fetched as
files (it must be converted); its ``manual`` says how to make the folder.

Fetching one file keeps these invariants:
- the file at its path is only ever a complete, verified download: bytes go to ``<path>.part`` and are renamed into
  place after the size and sha256 (those the manifest has) match; a mismatch deletes the part and fails;
- an interrupted download resumes: a ``.part`` left behind is continued with an HTTP Range request (a server that
  ignores the range sends the whole file, which then replaces the part);
- a file already in place is kept when it matches what the manifest knows (its size and sha256, when given).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from mmcache.errors import MmcacheError

CHUNK = 1 << 16
TIMEOUT_S = 60


class DataError(MmcacheError):
    """A manifest that cannot be read, an unknown source, or a download that failed or did not verify."""


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    url: str
    path: str                  # relative to the data folder
    size: int | None = None
    sha256: str | None = None


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    what: str
    read_by: str
    licence: str
    home: str
    files: tuple[RemoteFile, ...]
    manual: str | None = None  # how to make the folder when there are no files to fetch


def manifest_path() -> Path:
    return Path(str(resources.files("workloads") / "data" / "sources.json"))


def _files(entry: dict) -> list[RemoteFile]:
    ids = entry.get("ids")
    keys = {k: entry.get(k) for k in ("url", "path", "size", "sha256")}
    if ids is None:
        return [RemoteFile(**keys)]
    return [RemoteFile(keys["url"].replace("{id}", i), keys["path"].replace("{id}", i)) for i in ids]


def load_sources(path: str | Path | None = None) -> dict[str, Source]:
    """The manifest's sources by name; ``DataError`` naming the file when it cannot be read."""
    path = Path(path) if path is not None else manifest_path()
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return {s["name"]: Source(s["name"], s["what"], s["read_by"], s["licence"], s["home"],
                                  tuple(f for e in s["files"] for f in _files(e)), s.get("manual"))
                for s in doc["sources"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a data manifest ({type(e).__name__}: {e})") from None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _mismatch(f: RemoteFile, path: Path) -> str | None:
    """Why the file at ``path`` is not ``f`` as the manifest knows it, or None."""
    size = path.stat().st_size
    if f.size is not None and size != f.size:
        return f"size {size:,} bytes, expected {f.size:,}"
    if f.sha256 is not None and (got := _sha256(path)) != f.sha256:
        return f"sha256 {got}, expected {f.sha256}"
    return None


def _bar(total: int | None, desc: str, enabled: bool):
    from workloads.harness.progress import bars_available
    if not (enabled and bars_available()):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, leave=False)


def _download(f: RemoteFile, part: Path, progress: bool) -> None:
    """Append the rest of ``f`` to ``part`` (or restart it when the server sends the whole file)."""
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(f.url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have and (f.size is None or have == f.size):  # the part is already whole
            return
        raise
    with response:
        resumed = response.status == 206
        length = response.headers.get("Content-Length")
        total = (int(length) + (have if resumed else 0)) if length is not None else f.size
        bar = _bar(total, Path(f.path).name, progress)
        if bar is not None and resumed:
            bar.update(have)
        with open(part, "ab" if resumed else "wb") as out:
            while block := response.read(CHUNK):
                out.write(block)
                if bar is not None:
                    bar.update(len(block))
        if bar is not None:
            bar.close()


def fetch_file(f: RemoteFile, root: Path, progress: bool = True) -> str:
    """Put ``f`` at ``root / f.path`` (module invariants); returns what happened, for one line of output."""
    dest = root / f.path
    if dest.is_file() and (why := _mismatch(f, dest)) is None:
        return f"present {f.path}"
    if dest.is_file():
        print(f"  {f.path}: {why}; fetching it again", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        _download(f, part, progress)
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(f"cannot fetch {f.url}: {reason} (run the command again to resume)") from None
    if (why := _mismatch(f, part)) is not None:
        part.unlink()
        raise DataError(f"{f.url}: {why}; the download was deleted")
    os.replace(part, dest)
    checked = "size and sha256 checked" if f.sha256 else f"sha256 {_sha256(dest)}, not on record"
    return f"fetched {f.path} ({dest.stat().st_size:,} bytes; {checked})"


def fetch(sources: list[Source], root: Path, progress: bool = True) -> list[str]:
    """Fetch every file of ``sources`` into ``root``, printing each source's origin and licence first; returns the
    names of the sources made by hand (no files) whose folder is missing, after printing how to make each. A source
    made by hand is never reported fetched. ``DataError`` at the first file that fails (what was fetched stays)."""
    missing = []
    for s in sources:
        print(f"{s.name}: {s.what}\n  source {s.home}; licence {s.licence}")
        if not s.files:
            if (root / s.name).is_dir():
                print(f"  present {s.name}/ (made by hand; not checked)")
            else:
                print(f"  not fetched (no file to download as is): {s.manual}")
                missing.append(s.name)
            continue
        for f in s.files:
            print(f"  {fetch_file(f, root, progress)}")
    return missing
