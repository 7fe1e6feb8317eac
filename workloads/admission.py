"""Which requests an engine replay may start now, the one rule both engine replays (``transformers_cb.PeerEngine``,
``mstar_serving``) admit by: in listed order, at most ``limit`` running, a session's call only after its previous
call finished, and (with ``arrivals``: seconds after the replay started, one per call) not before it arrived. A call
that cannot start yet does not hold back later calls that can (another session's, or one that arrived)."""

from __future__ import annotations

import collections
from typing import Sequence


class Admission:
    """The calls still to start, by index into ``sessions`` (each call's session)."""

    def __init__(self, sessions: Sequence[str], arrivals: Sequence[float] | None, limit: int):
        self.sessions, self.arrivals, self.limit = list(sessions), arrivals, limit
        self.pending = collections.deque(range(len(self.sessions)))
        self.busy: set[str] = set()  # sessions with a call running
        self.running = 0

    def __bool__(self) -> bool:
        """Whether any call is still to start."""
        return bool(self.pending)

    def take(self, now: float) -> list[int]:
        """The calls that start at ``now`` (seconds since the replay started), in order; each is running from here
        until ``finished``."""
        out = []
        while self.running < self.limit:
            k = next((k for k in self.pending if self.sessions[k] not in self.busy
                      and (self.arrivals is None or self.arrivals[k] <= now)), None)
            if k is None:
                break
            self.pending.remove(k)
            self.busy.add(self.sessions[k])
            self.running += 1
            out.append(k)
        return out

    def finished(self, k: int) -> None:
        """Call ``k`` ended: its slot and its session are free."""
        self.busy.discard(self.sessions[k])
        self.running -= 1

    def wait_s(self, now: float) -> float | None:
        """Seconds from ``now`` until the next pending call arrives, when a slot is free for it (None: nothing is
        to arrive, or no slot is free)."""
        if self.arrivals is None or self.running >= self.limit:
            return None
        later = [self.arrivals[k] - now for k in self.pending if self.arrivals[k] > now]
        return min(later) if later else None
