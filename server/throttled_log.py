"""A warning per reason per interval, with how many it stands for.

Refusals come from the network, so one log line each lets any client flood
the log (44,385 lines in 20 s of HTTP/2 rapid reset). The counts that matter
go to metrics; the log says that it happened, how often, and the latest case.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["ThrottledLog"]


class ThrottledLog:
    """Logs the first event of each reason, then at most one line per ``every`` seconds with the count since.

    Args:
        logger: Where the lines go.
        every: Seconds between two lines of one reason.
        clock: Monotonic seconds (tests pass a fake).
    """

    def __init__(self, logger: logging.Logger, every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = logger
        self.every = every
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._unreported: dict[str, int] = {}

    def warning(self, reason: str, message: str) -> bool:
        """Count one ``reason`` event; log ``message`` (with the count since the last line) if it is time.

        Returns whether a line was written.
        """
        now = self._clock()
        with self._lock:
            n = self._unreported.get(reason, 0) + 1
            last = self._last.get(reason)
            if last is not None and now - last < self.every:
                self._unreported[reason] = n
                return False
            self._last[reason] = now
            self._unreported[reason] = 0
        suffix = "" if n == 1 else f" ({n} such events since the last line, {self.every:.0f} s apart at most)"
        self._log.warning("%s%s", message, suffix)
        return True
