"""Token counts as people write them: ``64k`` = 65,536, ``1M`` = 1,048,576 (binary, like "128k context"),
``1.5M``, plain integers, and ``inf`` (unbounded, returned as None)."""

from __future__ import annotations

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str) -> int | None:
    """``"64k"`` -> 65536, ``"inf"`` -> None; ValueError on anything else or a size below 1."""
    s = str(text).strip().lower().replace("_", "")
    if s in ("inf", "infinite", "unbounded"):
        return None
    unit = s[-1] if s and s[-1] in "kmg" else ""
    number = s[: len(s) - len(unit)]
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64k, 1M, inf)") from None
    if value != value or value < 1 or value == float("inf"):
        raise ValueError(f"a size must be a positive number of tokens or 'inf', got {text!r}")
    return int(value)


def parse_sizes(text: str) -> list[int | None]:
    """A comma-separated list of sizes, in the given order."""
    parts = [p for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError("empty size list")
    return [parse_size(p) for p in parts]


def format_size(tokens: int | None) -> str:
    """Inverse of ``parse_size`` for exact multiples; otherwise the plain integer."""
    if tokens is None:
        return "inf"
    for unit, mult in (("M", 1 << 20), ("k", 1 << 10)):
        if tokens >= mult and tokens % mult == 0:
            return f"{tokens // mult}{unit}"
    return str(tokens)
