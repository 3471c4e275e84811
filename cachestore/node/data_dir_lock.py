"""One daemon per data dir and per NVMe tier: an exclusive ``flock`` on ``<dir>/daemon.lock`` in each, held for the
daemon's life.

Two daemons on one data dir run two redis-servers on one AOF and two owners of one NVMe tier, and each
undoes the other's writes; two daemons given other data dirs but one ``--nvme-dir`` would share the tier's pack
files, and the second would take the first's live manifest (RocksDB's own lock held) for a broken one and move it
aside. The second must refuse to start before it starts anything. The lock is the
kernel's, on the open file: it goes with the process however that ends (even ``kill -9``), so a stale lock
file never blocks a restart. The file records the holder's PID and port, for the refusal to name them; it
is never deleted (a process that deleted it could lock a new file while another still holds the old one).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from prefixcache.indexer.errors import ConfigError

LOCK_FILE_NAME = "daemon.lock"


class DataDirLock:
    """Holds ``<data_dir>/daemon.lock`` from ``acquire`` until ``release`` (or the process's end). ``role`` and
    ``option`` name the directory and the setting that gives it, in refusals."""

    def __init__(self, data_dir: Path, role: str = "data dir", option: str = "--data-dir") -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_FILE_NAME
        self._role = role
        self._option = option
        self._fd: int | None = None

    def acquire(self, port: int) -> None:
        """Create the data dir if needed and lock it, recording this process and ``port``; a ``ConfigError``
        naming the holder if another daemon has it, or saying why the directory cannot be used."""
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self._role} {self.data_dir} is in use by another prefixcache daemon ({holder}); stop "
                f"it or give this one another {self._option}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "port": port}).encode() + b"\n", 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the file releases the lock
            self._fd = None

    def _open(self) -> int:
        if self.data_dir.exists() and not self.data_dir.is_dir():
            raise ConfigError(f"{self._role} {self.data_dir} is not a directory")
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot use {self._role} {self.data_dir}: {exc.strerror}") from None


def _describe_holder(fd: int) -> str:
    """``pid N, port P`` from the lock file the holder wrote (what it says, or that it says nothing readable)."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        record = json.loads(os.pread(fd, 4096, 0))
        return f"pid {int(record['pid'])}, port {int(record['port'])}"
    return "its PID and port unknown: the lock file holds no record yet"
