"""The documentation's pages and what is in them, for the tests that check them: the README and ``docs/*.md``, their
fenced code blocks (``tests/test_docs_blocks.py`` runs them) and the commands they show (``tests/test_docs_commands.py``
checks what those read, ``tests/test_docs_figures.py`` what the README quotes)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>.*)$")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
COMMAND_START = ("mmcache ", "python ")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path):
    """(line, language, marker, code) of every fenced block; the code dedented by its fence's indent."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        start, body, i = i + 1, [], i + 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1
        lang, _, marker = info.partition(" ")
        yield start, lang.lower(), marker.strip(), "\n".join(body) + "\n"


def commands(path: Path):
    """(line, command) of every command the page shows: each line of a fenced block, each line indented as code
    (four spaces) that starts a command, and each inline code span that starts one (``mmcache ...``, ``python
    ...``), the README's Results table included. A span broken across lines is joined first."""
    text = path.read_text(encoding="utf-8")
    fenced = set()  # 0-based indices of the fenced blocks' lines, fences included
    for start, _, _, code in blocks(path):
        body = code.splitlines()
        fenced.update(range(start - 1, start + len(body) + 1))
        for k, line in enumerate(body):
            if line.strip():
                yield start + k + 1, line.strip()
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if k not in fenced and line.startswith("    ") and line.strip().startswith(COMMAND_START):
            yield k + 1, line.strip()
    prose = "\n".join("" if k in fenced else line for k, line in enumerate(lines))
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        if span.startswith(COMMAND_START):
            yield prose.count("\n", 0, m.start()) + 1, span
