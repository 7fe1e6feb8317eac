"""Writing a replay's outputs (``--json``, ``--plot``, ``--html``) so that a finished run is never lost to a write.

Invariants: a regular file at the path holds either its old content or the whole new one (the bytes are written to
a temporary file beside it, then renamed over it), never a torn mix; a path that exists and is not a regular file
(``/dev/stdout``, a pipe) is written in place, never replaced. When the write fails, the same bytes go to a fallback
file in the temp folder and ``save`` says so in one line, so the results survive a full disk or a bad folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` as the module docstring says; OSError when it cannot."""
    path, data = Path(path), data.encode("utf-8") if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        with open(path, "wb") as f:
            f.write(data)
        return path
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def save(flag: str, path: str | Path, data: bytes | str) -> tuple[Path, str | None]:
    """``(where the bytes are, problem)``: ``path`` and None, or a fallback file and the one line that says why."""
    try:
        return write_atomic(path, data), None
    except OSError as e:
        why = e.strerror or str(e)
    path = Path(path)
    fd, fallback = tempfile.mkstemp(prefix=f"mmcache-{path.stem}-", suffix=path.suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)
    return Path(fallback), f"{flag} {path}: could not write it ({why}); the results are in {fallback} instead"
