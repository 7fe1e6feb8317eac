"""DiffusionDB prompts (``diffusiondb/diffusiondb_5k.jsonl``): one JSON object with a string ``prompt`` per line,
read with the shared JSONL policy (``workloads.traces.jsonl``)."""

from __future__ import annotations

from pathlib import Path

from workloads.traces.jsonl import load_jsonl


def _prompt(row, lineno: int) -> str:
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError("expected a JSON object with a string 'prompt'")
    return row["prompt"]


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """The ``prompt`` of each line, in file order, at most ``limit``; ``TraceError`` (file and 1-based line) for a
    missing file or a line that is not a UTF-8 JSON object with a string ``prompt``; blank lines are skipped."""
    return load_jsonl(path, _prompt, limit)
