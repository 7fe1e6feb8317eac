"""How a replay serves a trace's calls: the order they arrive in, and how many of them hold pages at once.

Two settings, apart (``Serving``):

- the **order** calls arrive in. Every order keeps each session's calls in their causal order (call i before i+1).
  ``timestamp``: every call by its own arrival time; ties go to the earlier session, then the earlier call (stable,
  so equal timestamps, Mooncake has many, keep file order). ``round-robin``: ``sessions`` sessions interleaved one
  call each in turn, in session (file) order; when a session has no calls left, the next unstarted one takes its turn
  at the end of the rotation (with one call per session, as Mooncake gives, this is file order). ``closed``:
  ``sessions`` clients, each sending its session's next call as soon as the previous one would end with nothing
  cached (the service model's time for the whole prompt), and taking the next unstarted session when its own ends:
  the arrival times are the same at every pool size and under every policy, so the offline optimum replays the
  same calls.
- the number of requests **in service**: a request holds its pages from its admission until it completes, and
  between a session's calls nothing of it is held (its history is only cached, as in an engine). At most
  ``in_service`` requests are in service at once; admission is first come, first served. In ``round-robin`` order a
  request completes when a later one needs its place (default: one at a time); in ``timestamp`` and ``closed`` order
  when its modelled service time ends (default: no cap). ``pin_sessions`` keeps a session's last call held after it
  completes until the session's next call is admitted: a server that pins sessions between calls.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from typing import Iterator, Sequence

from workloads.service import ServiceModel
from workloads.traces.text_trace import Session

ORDERS = ("timestamp", "round-robin", "closed")
DEFAULT_SESSIONS = 8


@dataclasses.dataclass(frozen=True)
class Serving:
    """The order calls arrive in and how many are served at once (see the module docstring)."""

    order: str = "timestamp"
    sessions: int = DEFAULT_SESSIONS  # round-robin: sessions interleaved; closed: clients
    in_service: int | None = None     # None: one at a time in round-robin order, no cap otherwise
    pin_sessions: bool = False

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"unknown order {self.order!r}; expected one of {', '.join(ORDERS)}")
        if self.sessions < 1:
            raise ValueError(f"sessions must be >= 1, got {self.sessions}")
        if self.in_service is not None and self.in_service < 1:
            raise ValueError(f"in_service must be >= 1, got {self.in_service}")

    @property
    def clocked(self) -> bool:
        """Whether requests end at modelled times (timestamp, closed) rather than when their place is needed."""
        return self.order != "round-robin"

    @property
    def cap(self) -> int | None:
        """Requests in service at once (None: no cap)."""
        return self.in_service if self.in_service is not None or self.clocked else 1

    def describe(self) -> str:
        """The settings in words, as the CLI's header and the plots say them."""
        what = [self.order]
        if self.order != "timestamp":
            what.append(f"{self.sessions} {'sessions' if self.order == 'round-robin' else 'clients'}")
        cap = self.cap
        what.append("no cap on requests in service" if cap is None else f"{cap} in service")
        if self.pin_sessions:
            what.append("sessions pinned between calls")
        return ", ".join(what)


def schedule(sessions: Sequence[Session], serving: Serving,
             service: ServiceModel = ServiceModel()) -> Iterator[tuple[int, int, float]]:
    """Yield ``(session index, call index, arrival s)`` for every call, in arrival order (round-robin order has no
    clock: its arrivals are 0)."""
    if serving.order == "timestamp":
        keyed = [(c.arrival_s, s, i) for s, sess in enumerate(sessions) for i, c in enumerate(sess.calls)]
        keyed.sort()
        for t, s, i in keyed:
            yield s, i, t
    elif serving.order == "round-robin":
        for s, i in _rotation(sessions, serving.sessions):
            yield s, i, 0.0
    else:
        yield from _closed_loop(sessions, serving.sessions, service)


def _rotation(sessions: Sequence[Session], width: int) -> Iterator[tuple[int, int]]:
    pending = (s for s, sess in enumerate(sessions) if len(sess.calls))
    active: deque[tuple[int, int]] = deque()  # (session, next call)
    for s in pending:
        active.append((s, 0))
        if len(active) == width:
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


def _closed_loop(sessions: Sequence[Session], clients: int, service: ServiceModel
                 ) -> Iterator[tuple[int, int, float]]:
    """``clients`` clients, each sending its session's calls back to back (the next when the previous would end with
    nothing cached) and taking the next unstarted session after its last call; yielded by send time (ties: the lower
    client)."""
    pending = (s for s, sess in enumerate(sessions) if len(sess.calls))
    ready: list[tuple[float, int, int, int]] = []  # (send time, client, session, call)
    for client, s in zip(range(clients), pending):
        ready.append((0.0, client, s, 0))
    heapq.heapify(ready)
    while ready:
        t, client, s, i = heapq.heappop(ready)
        yield s, i, t
        call = sessions[s].calls[i]
        done = t + service.duration(call.prompt_len, call.output_len)
        if i + 1 < len(sessions[s].calls):
            heapq.heappush(ready, (done, client, s, i + 1))
        elif (nxt := next(pending, None)) is not None:
            heapq.heappush(ready, (done, client, nxt, 0))
