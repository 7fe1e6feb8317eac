"""Seed-TTS-Eval's ``meta.lst`` (``SEEDTTS``, under the shared data folder): one row a line,
``utt_id|prompt_text|prompt_wav|target_text``, the WAV paths relative to the file. voice-clone says its rows
(``workloads.models.voice_clone``) and its replica-replay trace clones their reference voices (``voice_sessions``);
the WAV files are read when used, not here."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from mmcache.errors import TraceError

SEEDTTS = "seedtts/meta.lst"


class Row(NamedTuple):
    """One line: say ``text`` in the voice of the reference WAV ``wav``, whose transcript is ``transcript``."""

    rid: str
    wav: Path
    transcript: str
    text: str


def load_seedtts(meta: str | Path) -> list[Row]:
    """The rows of ``meta`` in file order; ``TraceError`` (file and line) for a line without four fields, and for a
    file that cannot be read or has no rows."""
    meta = Path(meta)
    try:
        lines = meta.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TraceError(meta, None, str(e)) from e
    rows = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            fields = line.split("|")
            if len(fields) != 4 or not all(f.strip() for f in fields):
                raise TraceError(meta, n, f"expected utt_id|prompt_text|prompt_wav|target_text, got {line!r}")
            rid, transcript, wav, text = (f.strip() for f in fields)
            rows.append(Row(rid, meta.parent / wav, transcript, text))
    if not rows:
        raise TraceError(meta, None, "no rows")
    return rows
