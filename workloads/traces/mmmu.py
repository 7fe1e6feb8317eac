"""MMMU-Pro questions (``mmmu/mmmu_pro_tool_sample_questions.jsonl``): per line a ``question``, its ``options`` and
``image_N`` paths (relative to the file's folder) that fill the ``<image N>`` slots of the text. Read with the shared
JSONL policy (``workloads.traces.jsonl``); image files are checked when served, not here."""

from __future__ import annotations

import re
import string
from pathlib import Path
from typing import Sequence

from mmcache.errors import TraceError
from workloads.traces.jsonl import check_file, load_jsonl

Part = str | Path | bytes  # text, an image file, or image bytes


def _slots(text: str, images: dict[int, Part]) -> list[Part]:
    """``text`` split at its ``<image N>`` slots, each replaced by ``images[N]``."""
    parts: list[Part] = []
    for k, piece in enumerate(re.split(r"<image (\d+)>", text)):
        if k % 2 == 0:
            parts += [piece] if piece else []
        elif int(piece) in images:
            parts.append(images[int(piece)])
        else:
            raise ValueError(f"<image {piece}> but no image_{piece}")
    return parts


def question_parts(question: str, options: Sequence[str], images: dict[int, Part]) -> list[Part]:
    """The question, then its options lettered (A), (B), ..., images in their slots."""
    parts = _slots(question, images) + ["\nOptions:"]
    for letter, option in zip(string.ascii_uppercase, options):
        parts += [f"\n({letter}) "] + _slots(option, images)
    return parts


def load_mmmu(path: str | Path) -> list[list[Part]]:
    """One question (text and image paths) per non-blank line; ``TraceError`` with the file and line for anything
    malformed, and for a file without questions."""
    path = check_file(path)

    def parse(row, lineno: int) -> list[Part]:
        question, options = row["question"], row["options"]
        if not isinstance(question, str) or not isinstance(options, list) or not all(
                isinstance(o, str) for o in options):
            raise ValueError("'question' must be a string and 'options' a list of strings")
        images = {int(k.removeprefix("image_")): path.parent / v for k, v in row.items()
                  if re.fullmatch(r"image_\d+", k) and isinstance(v, str) and v}
        try:
            return question_parts(question, options, images)
        except ValueError as e:
            raise ValueError(f"ValueError: {e}") from None

    items = load_jsonl(path, parse)
    if not items:
        raise TraceError(path, None, "no questions")
    return items
