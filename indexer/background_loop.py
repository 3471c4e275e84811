"""A thread that repeats one step until stopped: the one shape of every background thread of the package (the
daemon's services, the keeper of a process's Mooncake attachment, the flushers of statistics,
``periodic_flusher.py``); ``PeriodicLoop``, one whose step comes every so often or when poked."""

from __future__ import annotations

import logging
import threading

from prefixcache.indexer.log_limits import RepeatedErrors

log = logging.getLogger("prefixcache.daemon")


class BackgroundLoop:
    """Calls ``step`` in a daemon thread until ``stop``; a failing step is logged and retried after a pause.
    The same failure again is logged at most once per ``log_limits.QUIET_S``, with a count of those not logged.

    Steps block briefly on their own input (a feed read, a queue pop, a timer), so ``stop`` takes
    effect within one step.
    """

    name = "prefixcache-service"
    retry_pause_s = 1.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = RepeatedErrors()

    def step(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """End the loop after its current step, without waiting for it: a daemon asks all its services
        first, so that stopping them costs the longest step (~0.5 s) rather than the sum of them."""
        self._stop.set()

    def stop(self) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` (none if not positive), less if asked to stop meanwhile."""
        if seconds > 0:
            self._stop.wait(seconds)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a service must outlive any one failed step
                self.errors.log(log, exc, "%s: step failed; retrying in %.0fs", self.name, self.retry_pause_s)
                self._stop.wait(self.retry_pause_s)


class PeriodicLoop(BackgroundLoop):
    """Calls ``tick`` every ``interval_s``, and at once after ``poke`` (something changed that it acts on)."""

    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._wake = threading.Event()

    def tick(self) -> None:
        raise NotImplementedError

    def poke(self) -> None:
        self._wake.set()

    def request_stop(self) -> None:
        super().request_stop()
        self._wake.set()

    def step(self) -> None:
        self._wake.wait(self.interval_s)
        self._wake.clear()
        if not self.stopping:
            self.tick()
