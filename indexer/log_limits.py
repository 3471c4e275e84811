"""Rate limits for errors a loop meets again and again: one log record per error per interval, with a count.

A service retries a failed step every second; while a server it needs is down, each retry fails the same
way, and logging every one (a traceback each) buried the one line that said what happened, at ~20 KB/s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: How long the same error stays quiet after it was logged.
QUIET_S = 30.0


class RepeatedErrors:
    """Says, per error, whether to log it now: the first time, then again once ``quiet_s`` has passed, with
    how many were not logged in between. "The same error" is the same type with the same message."""

    def __init__(self, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.quiet_s = quiet_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # error -> (when last logged, suppressed since)

    def log(
        self,
        logger: logging.Logger,
        exc: BaseException,
        message: str,
        *args: object,
        level: int = logging.ERROR,
        traceback: bool = True,
    ) -> bool:
        """Log ``message % args`` about ``exc`` (with its traceback unless told) if it is due; whether it was."""
        suppressed = self._due(exc)
        if suppressed is None:
            return False
        if suppressed:
            message += f" ({suppressed} more of this error not logged in the last {self.quiet_s:.0f}s)"
        logger.log(level, message, *args, exc_info=exc if traceback else None)
        return True

    def _due(self, exc: BaseException) -> int | None:
        """How many times ``exc`` went unlogged since it last was, if it is to be logged now; else None."""
        key = (type(exc).__qualname__, str(exc))
        now = self._clock()
        with self._lock:
            last, suppressed = self._seen.get(key, (None, 0))
            if last is not None and now - last < self.quiet_s:
                self._seen[key] = (last, suppressed + 1)
                return None
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.quiet_s}  # forget quiet ones
            self._seen[key] = (now, 0)
            return suppressed
