"""Argument checks shared by the core: integer counts, page ids, page names and costs, each refused with an
``InvalidRequest`` that names the problem, before the caller changes anything; and ``require``, how a cache's
``check()`` states the rules it keeps.

Integers means Python ``int`` or numpy integer scalars/dtypes; bools, floats (even integral ones), strings and None
are refused rather than coerced, so ``grow(rid, 7.9)`` or ``release(["0"])`` cannot silently mean something else.
"""

from __future__ import annotations

import array
import math

import numpy as np

from mmcache.errors import BrokenInvariant, InvalidCost, InvalidRequest


def as_int(value, what: str) -> int:
    """``value`` as an int; raises ``InvalidRequest`` unless it is an integer (bools refused)."""
    if type(value) is int:  # the common case, checked first: this runs on every call that takes a count
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise InvalidRequest(f"{what} must be an integer, got {value!r}")


def as_ids(values, what: str) -> np.ndarray:
    """Integer ids as a 1-D int64 array (a scalar or any shape is flattened); raises ``InvalidRequest`` for
    non-integer dtypes (bool, float, str, object) or ragged nesting. Empty input gives an empty array."""
    try:
        arr = np.asarray(values)
    except ValueError as e:  # ragged nesting
        raise InvalidRequest(f"{what} must be integers: {e}") from None
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidRequest(f"{what} must be integers, got {arr.dtype} values")
    return arr.astype(np.int64, copy=False).reshape(-1)


def as_names(names, count: int, what: str) -> list[int]:
    """Page names as ``count`` Python ints in [0, 2**64); raises ``InvalidRequest`` otherwise.

    ``array('Q')`` range-checks every name in C and refuses non-integers (a name only nominates a lookup, but a
    stored one must fit the uint64 name array); the names themselves are kept as given (numpy integer scalars
    included: they hash and compare like ints), which spares a second conversion on the admit path.
    """
    if len(names) != count:
        raise InvalidRequest(f"{what}: {len(names)} names for {count} full pages")
    if isinstance(names, np.ndarray):
        if names.size and (names.ndim != 1 or names.dtype.kind not in "iu" or names.min() < 0):
            raise InvalidRequest(f"{what}: page names must be unsigned 64-bit integers, got {names.dtype} values")
        return names.tolist()
    try:
        array.array("Q", names)
        return list(names)
    except (TypeError, OverflowError):
        raise InvalidRequest(f"{what}: page names must be unsigned 64-bit integers") from None


def as_cost(value, what: str) -> float | None:
    """A cost (seconds a hit saves) as a float, None kept (unknown); raises ``InvalidCost`` naming ``what`` and the
    value unless it is a finite number >= 0 (an infinite cost made a pool's typical cost NaN once, and a NaN key
    compares with nothing)."""
    if value is None:
        return None
    try:
        cost = float(value)
    except (TypeError, ValueError):
        raise InvalidCost(f"{what} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not 0 <= cost < math.inf:
        raise InvalidCost(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return cost


def require(rule: bool, what: str) -> None:
    """``BrokenInvariant`` naming ``what`` unless ``rule`` holds: how a cache's ``check()`` states its rules."""
    if not rule:
        raise BrokenInvariant(what)
