"""Which TCP sockets a process and its descendants listen on, and a check that none listens too wide.

The daemon runs this once its servers are up (``check_listeners``): a socket of its process tree bound to
an address it was not given (the wildcard ``0.0.0.0`` or ``::`` above all) stops it before it serves,
with an error naming each such socket and its process. Mooncake's transfer protocol has no
authentication, so a transfer port reachable from outside the node hands out the segment to anyone.

How: LISTEN sockets come from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (this network namespace's), with
their inodes; a process's own sockets are the ``socket:[inode]`` links under ``/proc/<pid>/fd``; the tree
is every process whose chain of parents (``/proc/<pid>/stat``) reaches the root pid. Allowed are loopback
(127.0.0.0/8, ``::1`` and their IPv4-mapped forms), the addresses given, and specific (address, port)
pairs given (the REST API on its ``host``, an explicitly configured KV-events endpoint).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from prefixcache.indexer.errors import PrefixCacheError

_PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's "st" column
#: What a configured address means when it is one of these: any address.
WILDCARDS = frozenset({"0.0.0.0", "::", "*", ""})


class ExposedListenerError(PrefixCacheError, RuntimeError):
    """A process of the daemon's tree listens on an address wider than the node was told to use."""


@dataclass(frozen=True)
class Listener:
    address: str  # as the kernel has it: 0.0.0.0, ::, 127.0.0.1, ::ffff:127.0.0.1...
    port: int
    pid: int
    process: str  # the process's name (comm)

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port} ({self.process}, pid {self.pid})"


def _address(hex_address: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ("127.0.0.1", 8080): the address is printed as native-order 32-bit words."""
    hex_ip, hex_port = hex_address.split(":")
    raw = b"".join(int(hex_ip[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(hex_ip), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(hex_port, 16)


def listening_sockets(proc: Path = _PROC) -> dict[int, tuple[str, int]]:
    """Every LISTEN TCP socket of this network namespace: inode -> (address, port)."""
    found: dict[int, tuple[str, int]] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(FileNotFoundError):  # a kernel without IPv6 has no tcp6
            for line in (proc / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and fields[3] == _LISTEN:
                    found[int(fields[9])] = _address(fields[1])
    return found


def process_tree(root: int, proc: Path = _PROC) -> list[int]:
    """``root`` and every process descended from it (those that exit meanwhile are skipped)."""
    children: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the name (in parentheses) may hold spaces
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def socket_inodes(pid: int, proc: Path = _PROC) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (none if it exited or cannot be read)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.scandir(proc / str(pid) / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd.path)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _name(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def tree_listeners(root: int, proc: Path = _PROC) -> list[Listener]:
    """The LISTEN sockets held by ``root`` and its descendants (a socket shared by several: each holder)."""
    sockets = listening_sockets(proc)
    listeners = []
    for pid in process_tree(root, proc):
        for inode in socket_inodes(pid, proc) & sockets.keys():
            address, port = sockets[inode]
            listeners.append(Listener(address, port, pid, _name(pid, proc)))
    return sorted(listeners, key=lambda lst: (lst.port, lst.pid))


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address)
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def _resolved(host: str) -> set[str]:
    """The addresses ``host`` stands for: itself if an IP literal or a wildcard, else what it resolves to."""
    if host in WILDCARDS:
        return {"0.0.0.0", "::"}
    with contextlib.suppress(ValueError):
        return {str(_ip(host))}
    try:
        return {str(_ip(str(info[4][0]))) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _is_loopback(host: str) -> bool:
    return host == "localhost" or any(_ip(ip).is_loopback for ip in _resolved(host) if ip not in WILDCARDS)


def too_wide(
    listeners: Iterable[Listener], addresses: Iterable[str] = (), endpoints: Iterable[tuple[str, int]] = ()
) -> list[Listener]:
    """The listeners on neither loopback, nor one of ``addresses``, nor their own (host, port) of ``endpoints``.

    A wildcard listener is allowed only where a wildcard is given (``0.0.0.0``, ``::``, ``*``).
    """
    allowed = {ip for host in addresses for ip in _resolved(host)}
    allowed_at = {(ip, port) for host, port in endpoints for ip in _resolved(host)}
    wrong = []
    for listener in listeners:
        ip = _ip(listener.address)
        if ip.is_loopback or str(ip) in allowed or (str(ip), listener.port) in allowed_at:
            continue
        wrong.append(listener)
    return wrong


def check_listeners(root: int, addresses: Iterable[str] = (), endpoints: Iterable[tuple[str, int]] = ()) -> None:
    """Raise ``ExposedListenerError`` naming every socket of ``root``'s tree that listens wider than allowed."""
    addresses, endpoints = list(addresses), list(endpoints)
    wrong = too_wide(tree_listeners(root), addresses, endpoints)
    if wrong:
        given = ", ".join(["loopback", *dict.fromkeys(a for a in addresses if not _is_loopback(a))])
        raise ExposedListenerError(
            f"refusing to serve: {'; '.join(map(str, wrong))} listen{'s' if len(wrong) == 1 else ''} beyond this "
            f"node's addresses ({given}); nothing of a node may listen wider than its configured addresses "
            "(Mooncake's transfer protocol has no authentication)"
        )
