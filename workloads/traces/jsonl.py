"""The one JSONL reader every trace and data loader uses, with one error policy.

Policy (the same for Mooncake traces, chat logs, MMMU questions, DiffusionDB prompts):
- blank lines (only whitespace) are skipped; they are not records and not errors;
- a missing file, or a path that is not a regular file (a folder, a named pipe, a device such as ``/dev/zero``),
  raises ``TraceError(path, None, ...)`` before a byte is read: a pipe would block and a device never end;
- the first malformed line raises ``TraceError(path, line, reason)`` with its 1-based line number, and nothing is
  returned: a line that is not UTF-8, not JSON, nested too deep to parse, or that the loader's ``parse`` rejects
  (``ValueError``, ``KeyError``, ``TypeError``). Malformed lines are never skipped, because a replay of a partly read
  trace reports numbers for traffic that is not the user's; the message says which line to fix or filter out. A
  file whose first record line fails because the whole file is one JSON document (pretty-printed, or a list) is
  named as that, ``TraceError(path, None, ...)``, not as a bad line;
- ``limit``: stop after that many records; lines after them are never read (nor checked).
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from mmcache.errors import TraceError

T = TypeVar("T")
ONE_DOCUMENT_BYTES = 256 << 20  # a file larger than this is not read whole to tell a JSON document from JSON Lines


def kind_of(path: Path) -> str:
    """What a path that is not a regular file is, in words ("no such file", "a folder", "a named pipe", ...)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "no such file"
    except OSError as e:
        return e.strerror or str(e)
    for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a regular file"


def check_file(path: str | Path) -> Path:
    """``path`` as a ``Path``; ``TraceError`` when it is not an existing regular file (checked without opening it)."""
    path = Path(path)
    if not path.is_file():
        what = kind_of(path)
        raise TraceError(path, None, what if what == "no such file" else f"not a file but {what}")
    return path


def encodable(text: str, what: str) -> str:
    """``text`` when UTF-8 can encode it; ValueError naming ``what`` for a lone surrogate (JSON's unpaired
    ``\\ud800``), which every tokenizer would choke on."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: text holds a lone surrogate {text[e.start]!r} at character {e.start} (not "
                         "Unicode text)") from None
    return text


def _too_deep(what: str) -> str:
    return f"{what} nested too deep to read (deeper than Python's recursion limit, {sys.getrecursionlimit():,})"


def load_json(path: str | Path):
    """The one JSON value of a whole file (``check_file`` first); ``TraceError(path, None, ...)`` when it is not one."""
    path = check_file(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TraceError(path, None, f"not a JSON file: {e}") from None
    except RecursionError:
        raise TraceError(path, None, _too_deep("JSON")) from None


def _one_document(path: Path) -> str | None:
    """What ``path`` holds when it is one JSON document spread over lines rather than JSON Lines ("a list", "an
    object"), else None. Only asked after its first record line failed to parse."""
    if path.stat().st_size > ONE_DOCUMENT_BYTES:
        return None
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else None


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON value)`` for every non-blank line, in file order; see the module policy. A file
    that is one JSON document over several lines (pretty-printed) is named as such, not as a bad first line."""
    path = check_file(path)
    first = True
    with open(path, "rb") as f:  # bytes, so that bad UTF-8 too is reported with its line
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:  # stripped: a truncated line's newline would otherwise be "an invalid control character"
                yield lineno, json.loads(raw.decode("utf-8").strip())
            except UnicodeDecodeError:
                raise TraceError(path, lineno, "not UTF-8") from None
            except json.JSONDecodeError as e:
                if first and (what := _one_document(path)):
                    raise TraceError(path, None, f"one JSON document ({what} over several lines), not JSON Lines: "
                                     "this format reads one JSON record per line") from None
                raise TraceError(path, lineno, f"not JSON: {e.msg} (column {e.colno})") from None
            except RecursionError:
                raise TraceError(path, lineno, _too_deep("JSON")) from None
            first = False


def load_jsonl(path: str | Path, parse: Callable[[Any, int], T], limit: int | None = None) -> list[T]:
    """``parse(value, lineno)`` of each non-blank line, at most ``limit``; a ``ValueError``, ``KeyError`` or
    ``TypeError`` from ``parse`` becomes ``TraceError(path, lineno, reason)``."""
    out: list[T] = []
    if limit is not None and limit <= 0:
        return out
    for lineno, value in read_jsonl(path):
        try:
            out.append(parse(value, lineno))
        except TraceError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            reason = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
            raise TraceError(path, lineno, reason) from None
        if limit is not None and len(out) >= limit:
            break
    return out
