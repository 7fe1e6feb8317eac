"""The order in which a trace's calls reach the cache.

Both orders keep each session's calls in their causal order (call i before call i+1).

- ``timestamp``: every call by its own arrival time; ties go to the earlier session, then the earlier call. Stable,
  so equal timestamps (Mooncake has many) keep file order.
- ``round-robin``: ``in_flight`` sessions at a time, interleaved one call each in turn, in session (file-name)
  order; when a session has no calls left, the next unstarted session takes its turn at the end of the rotation.
  With one request per session (Mooncake gives no sessions) this is simply file order.
"""

from __future__ import annotations

from collections import deque
from typing import Iterator, Sequence

from workloads.traces.text_trace import Session

ORDERS = ("timestamp", "round-robin")


def schedule(sessions: Sequence[Session], order: str, in_flight: int = 8) -> Iterator[tuple[int, int]]:
    """Yield ``(session index, call index)`` for every call, in replay order."""
    if order == "timestamp":
        keyed = [(c.arrival_s, s, i) for s, sess in enumerate(sessions) for i, c in enumerate(sess.calls)]
        keyed.sort()
        for _, s, i in keyed:
            yield s, i
    elif order == "round-robin":
        if in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {in_flight}")
        pending = (s for s, sess in enumerate(sessions) if len(sess.calls))
        active: deque[tuple[int, int]] = deque()  # (session, next call)
        for s in pending:
            active.append((s, 0))
            if len(active) == in_flight:
                break
        while active:
            s, i = active.popleft()
            yield s, i
            if i + 1 < len(sessions[s].calls):
                active.append((s, i + 1))
            else:
                nxt = next(pending, None)
                if nxt is not None:
                    active.append((nxt, 0))
    else:
        raise ValueError(f"unknown order {order!r}; expected one of {', '.join(ORDERS)}")
