"""Writing a replay's outputs (``--json``, ``--plot``, ``--html``) so that a finished run is never lost to a write.

Invariants: a regular file at the path holds either its old content or the whole new one (the bytes are written to
a temporary file beside it, then renamed over it), never a torn mix; a path that exists and is not a regular file
(``/dev/stdout``, a pipe) is written in place, never replaced. When the write fails, the same bytes go to a fallback
file in the temp folder and ``save`` says so in one line, so the results survive a full disk or a bad folder.
A new file gets the mode ``open()`` would give it (0666 less the user's umask), a replaced one keeps its mode: the
temporary files ``mkstemp`` makes are 0600, which would hide a report from everyone the user shares it with.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _umask() -> int:
    """The process's umask (there is no call that only reads it: set and put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """What ``path``'s permission bits should be after a write: its own when it exists, else 0666 less the umask."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return 0o666 & ~_umask()


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write ``data`` (str: UTF-8) to ``path`` as the module docstring says; OSError when it cannot."""
    path, data = Path(path), data.encode("utf-8") if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        with open(path, "wb") as f:
            f.write(data)
        return path
    mode = _mode_for(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
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
    os.chmod(fallback, 0o666 & ~_umask())
    return Path(fallback), f"{flag} {path}: could not write it ({why}); the results are in {fallback} instead"
