"""Child servers the daemon (and the test fixtures) run: start, wait until ready, stop cleanly.

Each child gets its own process group so a Ctrl-C on the daemon's terminal reaches the daemon only;
the daemon then stops its children in order (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixcache.cachestore.host.cpu_priority import set_own_nice, set_session_nice
from prefixcache.indexer.errors import ConfigError, PrefixCacheError

log = logging.getLogger("prefixcache.processes")
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it when the daemon dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _prepare_child(nice: int) -> None:
    """Runs in the child before exec."""
    die_with_parent()
    if nice:
        set_own_nice(nice)


class ServerStartError(PrefixCacheError, RuntimeError):
    """A child server exited or did not become ready in time; the message quotes its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_BLOCK_PORT = 20000  # above the well-known and registered service ports most hosts run


def _ephemeral_ports() -> range:
    """The ports the kernel hands to outgoing connections (Linux's default when it cannot be read)."""
    try:
        low, high = (int(field) for field in _EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A port P such that P..P+count-1 are all free right now (for a daemon's derived ports).

    The block lies outside the kernel's ephemeral range: a daemon binds its ports one by one over
    seconds, and inside that range any outgoing connection (Redis clients, HTTP probes) may take a
    port of the block in between.
    """
    ephemeral = _ephemeral_ports()
    below = range(_LOWEST_BLOCK_PORT, max(_LOWEST_BLOCK_PORT, ephemeral.start - count + 1))
    above = range(ephemeral.stop, max(ephemeral.stop, 65536 - count + 1))
    bases = below if len(below) >= len(above) else above
    if not bases:
        raise OSError(f"no room for a block of {count} ports outside the ephemeral range {ephemeral}")
    chooser = random.SystemRandom()
    for _ in range(100):
        base = chooser.choice(bases)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + count):
                    s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                    s.bind((host, port))
            return base
        except OSError:
            continue
    raise OSError(f"no block of {count} free ports found")


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def find_executable(name: str, extra_dirs: Sequence[Path] = ()) -> str:
    """Path of ``name`` on PATH or in ``extra_dirs``; a clear error naming what to install if absent."""
    for directory in extra_dirs:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if not found:
        raise ConfigError(f"{name} not found on PATH; run deploy/setup.sh (it installs it)")
    return found


class ManagedProcess:
    """One child server with a log file, a readiness probe and a clean stop."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        ready: Callable[[], bool],
        env: dict[str, str] | None = None,
        listens_on: Sequence[tuple[str, int]] = (),
        nice: int = 0,
    ) -> None:
        """``listens_on``: the (host, port)s the server binds, which ``start`` first waits to find free; ``nice``:
        the server's CPU priority, for its session and its threads (cachestore/host/cpu_priority.py)."""
        self.name = name
        self.nice = nice
        self.env = env
        self.argv = list(argv)
        self.log_path = log_path
        self.listens_on = list(listens_on)
        self._ready = ready
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self, timeout_s: float = 30.0) -> None:
        self._wait_for_ports(timeout_s)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log_file:
            self._proc = subprocess.Popen(
                self.argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=functools.partial(_prepare_child, self.nice),
                env=self.env,
            )
        if self.nice and not set_session_nice(self._proc.pid, self.nice):
            log.warning("%s runs at the default priority: nice %d needs CAP_SYS_NICE", self.name, self.nice)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with code {self._proc.returncode}: {self._log_tail()}")
            if self._ready():
                return
            time.sleep(0.05)
        self.stop()
        raise ServerStartError(f"{self.name} was not ready after {timeout_s:.0f}s: {self._log_tail()}")

    def _wait_for_ports(self, timeout_s: float) -> None:
        """Wait until nothing listens on this server's ports any more.

        A daemon restarted right after a crash reuses its fixed ports while the servers it had started
        may still be shutting down (they get SIGTERM when their parent dies, and take a moment):
        starting at once made the new server fail to bind and exit.
        """
        deadline = time.monotonic() + timeout_s
        while busy := [f"{host}:{port}" for host, port in self.listens_on if port_open(host, port)]:
            if time.monotonic() > deadline:
                raise ServerStartError(
                    f"{self.name} cannot start: {', '.join(busy)} still in use after {timeout_s:.0f}s"
                )
            time.sleep(0.1)

    def alive(self) -> bool:
        """Whether the server runs; asking reaps it if it has exited (no zombie stays behind)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """How the last started server exited (``-N``: killed by signal N); None while it runs or before a start."""
        return self._proc.returncode if self._proc is not None else None

    def stop(self, grace_s: float = 10.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def kill(self) -> None:
        """SIGKILL and reap it: a server that must go at once (a segment owner that will not take its daemon back;
        tests of crash recovery)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
