"""Ctrl-C held while finished results are printed and written, so an interrupt never loses what was measured.

Invariant: inside ``hold_interrupts()`` a SIGINT raises nothing; it is recorded in ``Held.received``, and the code
in the block runs to its end (every output written whole), after which the caller reports the interrupt (exit 130).
Outside the main thread, where Python cannot set a signal handler, and in a process started with SIGINT ignored
(``nohup``), the block runs as it would without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Iterator


@dataclasses.dataclass
class Held:
    received: bool = False


@contextlib.contextmanager
def hold_interrupts() -> Iterator[Held]:
    """Hold SIGINT for the block (module docstring); the handler that was there before is put back after it."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:  # started to ignore Ctrl-C: it stays ignored
        yield held
        return

    def record(signum, frame):
        held.received = True
    signal.signal(signal.SIGINT, record)
    try:
        yield held
    finally:  # None: a handler not set from Python; Python's own is the nearest to it
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
