"""Keeps this process's Mooncake attachment alive after the segment owner has dropped it.

A process attached with ``setup_dummy`` pings the segment owner every second from a thread of
Mooncake's own. When the owner hears nothing for 10 s (a hard-coded TTL: the process was stopped,
starved of CPU, or the owner's one request thread was held up by a long call), it unmaps the
process's shared memory, and every later call fails with -600 (INVALID_PARAMS), for good: the
client's pings still succeed, so it never learns it was dropped, and ``register_buffer`` on memory
it already registered does nothing (Mooncake issues #1711 and #2198). Seen here in CI: a vLLM
prefill instance silently stopped publishing.

Mooncake does re-register every piece of a process's shared memory when a ping *fails* (that is how
it survives the owner restarting). ``AttachmentKeeper`` watches for the failure's signature (a read
of an object that does not exist answers -600 instead of -704), then has the tier answer misses
without calling Mooncake for a ping interval and shuts down this process's connections to the owner:
the next ping is the first call to meet a dead connection (another call would only have its
connection replaced), it fails, and that reconnection runs. The memory keeps its addresses and
contents (vLLM's KV cache included), and the owner maps it again within a second or two.

That reset is not always enough: after a whole host was frozen and thawed, the owner ran first and
dropped the process, and for a minute no reset made a ping fail (Mooncake's ping thread went on
pinging without a failure), so no reconnection ran while every call failed. A process that can do more
says so with ``on_unrepaired``, run when a repair has not taken within ``repair_timeout_s``: the daemon
restarts its segment owner (cachestore/node/daemon.py), whose loss every ping does notice, and the
reconnection registers the memory with the new owner.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable

from prefixcache.indexer.background_loop import BackgroundLoop

log = logging.getLogger("prefixcache.dram")

#: Longer than Mooncake's 1 s between pings: one ping falls in each repair attempt.
REPAIR_ATTEMPT_S = 1.5
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_ESTABLISHED = "01"
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")


def connections_to(address: str) -> list[int]:
    """This process's file descriptors of established TCP connections to ``host:port`` (Linux).

    The host is compared only when it is an IP literal (a name may resolve to any of several)."""
    host, _, port_text = address.rpartition(":")
    port = int(port_text)
    try:
        wanted_ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        wanted_ip = None
    inodes = set()
    for table in _TCP_TABLES:
        with contextlib.suppress(OSError):
            for line in open(table).read().splitlines()[1:]:  # noqa: SIM115 - a /proc file, read at once
                fields = line.split()
                remote_ip, remote_port = _remote_endpoint(fields[2])
                if remote_port == port and fields[3] == _ESTABLISHED and wanted_ip in (None, remote_ip):
                    inodes.add(fields[9])
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            match = _SOCKET_LINK.fullmatch(os.readlink(f"/proc/self/fd/{fd}"))
            if match and match.group(1) in inodes:
                fds.append(int(fd))
    return fds


def _remote_endpoint(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """An address of /proc/net/tcp (``0100007F:1F90``: the IP as 32-bit words in host order, then the port)."""
    ip_hex, port_hex = field.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # each word is little-endian here
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip, int(port_hex, 16)


def shut_down(fds: list[int]) -> None:
    """Shut down the connections behind ``fds`` (owned by Mooncake: they stay open, their peer is gone)."""
    for fd in fds:
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as connection:
            connection.shutdown(socket.SHUT_RDWR)


class AttachmentKeeper(BackgroundLoop):
    """Checks the attachment every ``interval_s`` and whenever a call failed as a dropped one would
    (``suspect``); repairs it when the owner has dropped it.

    ``probe`` says whether the owner still maps this process's memory (None: cannot tell, Mooncake is
    unreachable or reconnecting); ``hold_calls(s)`` makes the tier answer misses for ``s`` seconds without
    calling Mooncake; ``on_unrepaired`` runs when a repair did not take (None: keep trying).
    """

    name = "prefixcache-attachment"

    def __init__(
        self,
        probe: Callable[[], bool | None],
        hold_calls: Callable[[float], None],
        owner_address: str,
        *,
        interval_s: float = 2.0,
        repair_timeout_s: float = 15.0,
        thread_setup: Callable[[], None] | None = None,
        on_unrepaired: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._probe = probe
        self._hold_calls = hold_calls
        self._owner = owner_address
        self._interval_s = interval_s
        self._repair_timeout_s = repair_timeout_s
        self._thread_setup = thread_setup
        self._on_unrepaired = on_unrepaired
        self._suspected = threading.Event()
        self.repairs = 0  # attachments the owner had dropped and took back
        self.unrepaired = 0  # repairs that did not take (and ran ``on_unrepaired``, where given)

    def suspect(self) -> None:
        """A call answered as it would after the owner dropped this process: check now."""
        self._suspected.set()

    def stop(self) -> None:
        self._suspected.set()  # the step waits on it
        super().stop()

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        super()._run()

    def step(self) -> None:
        self._suspected.wait(self._interval_s)
        self._suspected.clear()
        if self.stopping or self._probe() is not False:
            return
        started = time.monotonic()
        failure = self._repair(started + self._repair_timeout_s)
        if failure is None:
            self.repairs += 1
            log.warning(
                "the Mooncake segment owner at %s had dropped this process (it heard no ping for 10 s); "
                "its memory is registered again after %.1f s",
                self._owner,
                time.monotonic() - started,
            )
            return
        if self.stopping:
            return
        self.unrepaired += 1
        log.error(
            "the Mooncake segment owner at %s dropped this process (it heard no ping for 10 s) and %s: DRAM loads "
            "and publishes fail meanwhile; retrying",
            self._owner,
            failure,
        )
        if self._on_unrepaired is not None:
            self._on_unrepaired()
        self._stop.wait(self._repair_timeout_s)  # whatever ``on_unrepaired`` set going, before a new check

    def _repair(self, deadline: float) -> str | None:
        """Reset this process's connections to the owner until it maps this process's memory again (None), or
        why it does not by ``deadline``."""
        while time.monotonic() < deadline and not self.stopping:
            self._hold_calls(REPAIR_ATTEMPT_S)
            connections = connections_to(self._owner)
            if not connections:
                return "no connection to it was found to reset"
            shut_down(connections)
            self._stop.wait(REPAIR_ATTEMPT_S)
            intact = self._probe()
            while intact is None and time.monotonic() < deadline:
                self._stop.wait(0.5)  # Mooncake is reconnecting: calls fail without reaching the owner
                intact = self._probe()
            if intact:
                return None
        return f"did not take it back within {self._repair_timeout_s:.0f} s"
