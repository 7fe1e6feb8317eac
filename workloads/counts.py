"""Counts in words, for the command line's output: ``counted(1, "request")`` is "1 request", ``counted(2_000,
"request")`` "2,000 requests"."""

from __future__ import annotations


def counted(n: int, phrase: str) -> str:
    """``n`` and ``phrase``, a singular noun phrase whose first word takes an s in the plural ("line without
    messages" -> "2 lines without messages"), in the plural unless ``n`` is 1."""
    if n != 1:
        first, sep, rest = phrase.partition(" ")
        phrase = f"{first}s{sep}{rest}"
    return f"{n:,} {phrase}"
