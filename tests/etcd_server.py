"""A real etcd for tests: one member on loopback, free ports, its data in a folder of the test's own.

Mooncake's masters in high-availability mode elect their leader in etcd, and keep their operation log and the
pool's transfer endpoints there. Debian's ``etcd-server`` package provides ``etcd`` (deploy/setup.sh installs it);
tests that need one skip where it is missing.
"""

from __future__ import annotations

import shutil
import urllib.request
from pathlib import Path

from prefixcache.cachestore.host.processes import ManagedProcess, free_port

#: Why a test that needs etcd is skipped, where it is; None where etcd is installed.
MISSING = None if shutil.which("etcd") else "etcd is not installed (deploy/setup.sh installs Debian's etcd-server)"


class EtcdServer(ManagedProcess):
    """``etcd``, one member, listening on ``host`` only; ready once it answers ``/health``."""

    def __init__(self, directory: Path, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = free_port(host)
        peer = f"http://{host}:{free_port(host)}"
        client = f"http://{host}:{self.port}"
        argv = [
            "etcd",
            "--name=test",
            f"--data-dir={directory / 'data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-level=warn",
        ]
        super().__init__("etcd", argv, directory / "etcd.log", self._healthy, listens_on=[(host, self.port)])

    @property
    def endpoint(self) -> str:
        """``host:port``, as Mooncake takes it."""
        return f"{self.host}:{self.port}"

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False
