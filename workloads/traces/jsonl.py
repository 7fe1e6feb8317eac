"""The one JSONL reader every trace and data loader uses, with one error policy.

Policy (the same for Mooncake traces, chat logs, MMMU questions, DiffusionDB prompts):
- blank lines (only whitespace) are skipped; they are not records and not errors;
- a missing file, or a path that is not a file, raises ``TraceError(path, None, ...)``;
- the first malformed line raises ``TraceError(path, line, reason)`` with its 1-based line number, and nothing is
  returned: a line that is not UTF-8, not JSON, or that the loader's ``parse`` rejects (``ValueError``,
  ``KeyError``, ``TypeError``). Malformed lines are never skipped, because a replay of a partly read trace reports
  numbers for traffic that is not the user's; the message says which line to fix or filter out;
- ``limit``: stop after that many records; lines after them are never read (nor checked).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from mmcache.errors import TraceError

T = TypeVar("T")


def check_file(path: str | Path) -> Path:
    """``path`` as a ``Path``; ``TraceError`` when it is not an existing file."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(path, None, "no such file" if not path.exists() else "not a file")
    return path


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON value)`` for every non-blank line, in file order; see the module policy."""
    path = check_file(path)
    with open(path, "rb") as f:  # bytes, so that bad UTF-8 too is reported with its line
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:  # stripped: a truncated line's newline would otherwise be "an invalid control character"
                yield lineno, json.loads(raw.decode("utf-8").strip())
            except UnicodeDecodeError:
                raise TraceError(path, lineno, "not UTF-8") from None
            except json.JSONDecodeError as e:
                raise TraceError(path, lineno, f"not JSON: {e.msg} (column {e.colno})") from None


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
