"""Keeps the servers the daemon started running: a dead one is reaped, restarted with backoff, and counted.

Without it a killed redis-server stayed a zombie, the node answered 503 until someone restarted the whole
daemon, and its services retried (and logged) every second meanwhile. Only servers the daemon started are
watched: an external Redis or master is its operator's.

Each watched server may name what must happen around its restart: ``before_restart`` runs while it is down
(the daemon drops the DRAM locations a dead segment owner or master took with it, while no publish can add
new ones), ``after_restart`` once it is up again. A restart whose start or hooks fail is tried again with a
longer pause (``min_backoff_s`` doubling to ``max_backoff_s``); so is the next restart of a server that dies
again soon, until one has stayed up ``stable_s``. Servers are checked in the order they were watched, in one
thread (the index first, which the others' hooks need): a restart, bounded by its start's timeouts, holds up
the checks of the others.

The thread that starts a server must outlive it: ``PR_SET_PDEATHSIG`` (cachestore/host/processes.py) signals a
child when the *thread* that forked it ends. So the loop ends at ``request_stop``, but the thread itself only
at ``stop``, which the daemon calls after it has stopped its servers in order.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixcache.cachestore.host.processes import ManagedProcess
from prefixcache.indexer.background_loop import BackgroundLoop

log = logging.getLogger("prefixcache.daemon")
#: A supervisor whose current check has run this long is stuck (a restart is bounded well below it).
STALL_S = 300.0


def _nothing() -> None:
    return None


@dataclass
class _Watched:
    process: ManagedProcess
    before_restart: Callable[[], None]
    after_restart: Callable[[], None]
    backoff_s: float
    up_since: float = field(default_factory=time.monotonic)
    restarts: int = 0
    down_since: float | None = None  # None while it runs (and its hooks are done)
    exit_status: str = ""
    next_try: float = 0.0
    last_failure: str = ""


class Supervisor(BackgroundLoop):
    name = "prefixcache-supervisor"

    def __init__(
        self,
        *,
        interval_s: float = 0.5,
        min_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        stable_s: float = 60.0,
    ) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.min_backoff_s, self.max_backoff_s = min_backoff_s, max_backoff_s
        self.stable_s = stable_s
        self._watched: dict[str, _Watched] = {}
        self._released = threading.Event()
        self._step_started = time.monotonic()

    def watch(
        self,
        process: ManagedProcess,
        *,
        before_restart: Callable[[], None] = _nothing,
        after_restart: Callable[[], None] = _nothing,
    ) -> None:
        """Restart ``process`` (started already) whenever it dies, until ``stop``."""
        self._watched[process.name] = _Watched(process, before_restart, after_restart, self.min_backoff_s)

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far, per watched server (by its process name)."""
        return {name: w.restarts for name, w in self._watched.items()}

    def trouble(self, name: str) -> str | None:
        """Why server ``name`` is not serving (exited, being restarted), or None while it is (or is not watched)."""
        watched = self._watched.get(name)
        if watched is None or watched.down_since is None:
            return None
        detail = f"{name} {watched.exit_status} {time.monotonic() - watched.down_since:.0f}s ago; restarting"
        return detail + (f" (last try: {watched.last_failure})" if watched.last_failure else "")

    def alive(self) -> bool:
        """Whether the supervisor runs: its thread is there and not stuck in one check."""
        running = self._thread is not None and self._thread.is_alive() and not self.stopping
        return running and time.monotonic() - self._step_started < STALL_S

    def step(self) -> None:
        self._step_started = time.monotonic()
        for watched in self._watched.values():
            if self.stopping:
                return
            self._check(watched)
        self._stop.wait(self.interval_s)

    def _run(self) -> None:
        super()._run()
        self._released.wait()  # the servers this thread started must not get their parent-death signal yet

    def stop(self) -> None:
        self._released.set()
        super().stop()

    def _check(self, watched: _Watched) -> None:
        name, now = watched.process.name, time.monotonic()
        if watched.down_since is None:
            if watched.process.alive():  # asking reaps an exited server
                if now - watched.up_since >= self.stable_s:
                    watched.backoff_s = self.min_backoff_s
                return
            watched.down_since, watched.exit_status = now, _exit_status(watched.process.returncode)
            watched.next_try, watched.last_failure = now + watched.backoff_s, ""
            log.error("%s %s; restarting it in %.1fs", name, watched.exit_status, watched.backoff_s)
        if now < watched.next_try:
            return
        try:
            if not watched.process.alive():
                watched.before_restart()
                watched.process.start()
            watched.after_restart()
        except Exception as exc:  # noqa: BLE001 - whatever failed, the server is tried again later
            watched.last_failure = (str(exc) or type(exc).__name__).splitlines()[0]
            watched.backoff_s = min(2 * watched.backoff_s, self.max_backoff_s)
            watched.next_try = time.monotonic() + watched.backoff_s
            self.errors.log(
                log,
                exc,
                "%s: restart failed (%s); next try in %.1fs",
                name,
                watched.last_failure,
                watched.next_try - time.monotonic(),
                traceback=False,
            )
            return
        watched.restarts += 1
        log.warning(
            "%s restarted (pid %s) after %.1fs down; %d restart(s) so far",
            name,
            watched.process.pid,
            time.monotonic() - watched.down_since,
            watched.restarts,
        )
        watched.down_since, watched.up_since = None, time.monotonic()
        watched.backoff_s = min(2 * watched.backoff_s, self.max_backoff_s)  # a server that dies again soon waits longer


def _exit_status(code: int | None) -> str:
    if code is None or code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"
