"""A one-line progress indicator on stderr, rate-limited; silent unless enabled (the CLI enables it on a TTY)."""

from __future__ import annotations

import sys
import time


class Progress:
    """``update(done)`` redraws ``label done/total (pct)`` at most every ``interval`` seconds; ``close`` clears it."""

    def __init__(self, total: int, label: str = "", enabled: bool = True, stream=None, interval: float = 0.5):
        self.total, self.label, self.enabled = max(int(total), 1), label, enabled
        self.stream = stream or sys.stderr
        self.interval = interval
        self._last = 0.0
        self._drawn = False

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.interval and done < self.total:
            return
        self._last = now
        self.stream.write(f"\r{self.label} {done}/{self.total} ({100 * done / self.total:.0f}%)\033[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
