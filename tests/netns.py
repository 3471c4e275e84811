"""Hosts of their own on this machine: network namespaces on a private bridge, for tests of nodes that talk over
a network as separate machines do (tests/test_separate_hosts.py, tests/e2e/test_separate_hosts_e2e.py).

``Network`` makes a bridge in the root namespace that holds its subnet's first address (``10.77.N.1/24``, N a
subnet no interface of this machine uses yet), and ``Network.host`` a namespace with loopback up and one end of
a veth pair, ``eth0``, at ``10.77.N.K/24``, the other end on the bridge: machines on one switch. The root
namespace (the test process) reaches every host and every host reaches it and the others, over the bridge; a
host's loopback is its own. Processes run in a host through ``ip netns exec`` (``Host.command``).

Every name carries this process's pid and the network's number in it (namespaces ``pcnet<pid>-<n>-<host>``,
interfaces ``pcb<pid>-<n>`` and ``pcv<pid>-<n>-<k>``, at most 15 characters), so that runs side by side, and
networks of one run, never share one. ``Network.close`` kills
every process left in its hosts, then deletes the namespaces and the bridge (a namespace's end of a veth goes
with it, and the bridge's end with that); fixtures call it however the test ended. What a run that was itself
killed left behind (its pid gone) goes at the next ``Network``'s start.

Namespaces need root and iproute2's ``ip``: ``unusable()`` says why they cannot be made here, for a skip.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: The /16 every ``Network`` takes a /24 of.
SUPERNET = ipaddress.ip_network("10.77.0.0/16")
_NAMESPACE = re.compile(r"^pcnet(\d+)-")
_BRIDGE = re.compile(r"^pcb(\d+)-")
_networks = itertools.count()


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip ARGS``; a failure raises with what ``ip`` said."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def unusable() -> str | None:
    """Why network namespaces cannot be made here (a reason for a skip), or None where they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (apt-get install iproute2)"
    probe = f"pcnet{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add fails here: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def _namespace_pids(namespace: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", namespace, check=False).stdout.split()]


def _delete_namespace(namespace: str) -> None:
    """Kill every process in ``namespace`` (a namespace lives on while one is left), then delete it."""
    deadline = time.monotonic() + 10
    while pids := _namespace_pids(namespace):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    ip("netns", "del", namespace, check=False)


def remove_leftovers() -> None:
    """Delete the namespaces and bridges of runs whose process is gone."""
    for line in ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if (found := _NAMESPACE.match(name)) and not _alive(int(found.group(1))):
            _delete_namespace(name)
    for line in ip("-o", "link", "show", "type", "bridge").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if (found := _BRIDGE.match(name)) and not _alive(int(found.group(1))):
            ip("link", "del", name, check=False)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of ``SUPERNET`` that no address of this machine's root namespace lies in."""
    used = {
        ipaddress.ip_interface(field.split()[3]).network
        for field in ip("-o", "-4", "addr", "show").stdout.splitlines()
        if len(field.split()) > 3
    }
    for subnet in SUPERNET.subnets(new_prefix=24):
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise RuntimeError(f"every /24 of {SUPERNET} is in use on this machine")


def process_state(pid: int) -> str | None:
    """Process ``pid``'s state, from /proc/PID/stat (R running, S sleeping, D in the disk, T stopped, Z exited and
    not reaped); None once it is gone."""
    return _state(Path(f"/proc/{pid}/stat"))


def _state(stat: Path) -> str | None:
    try:
        return stat.read_text().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def freeze_processes(pids: Sequence[int], timeout_s: float = 5) -> None:
    """SIGSTOP each process and wait until every thread of each has stopped. ``kill`` returns before they do: on a
    busy machine a thread already serving a request goes on serving until the thread the signal went to is
    scheduled, so a test that reads at once could be answered by a process it believes frozen."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while (running := _running_threads(pids)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not running, f"threads still running after SIGSTOP: {running}"


def _running_threads(pids: Sequence[int]) -> list[str]:
    """The threads of ``pids`` not stopped (nor gone), as PID/TID."""
    running = []
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except FileNotFoundError:  # exited meanwhile: nothing of it runs
            continue
        running += [f"{pid}/{t.name}" for t in tasks if _state(t / "stat") not in (None, "T", "t", "Z", "X")]
    return running


@dataclass(frozen=True)
class Host:
    """A network namespace on the ``Network``'s bridge: a machine of its own, as far as the network goes."""

    name: str
    namespace: str
    address: str
    veth: str  # its cable's end on the bridge, in the root namespace

    @property
    def launcher(self) -> list[str]:
        """What a command runs under to run in this host: ``ip netns exec``, which execs it (the process started
        is the command's own)."""
        return ["ip", "netns", "exec", self.namespace]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this host."""
        return [*self.launcher, *argv]

    def pids(self) -> list[int]:
        """Every process running in this host."""
        return _namespace_pids(self.namespace)

    def crash(self) -> None:
        """SIGKILL every process of this host at once, as a machine that loses power stops them all."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.pids(), f"processes of host {self.name} outlived SIGKILL: {self.pids()}"

    def freeze(self) -> None:
        """SIGSTOP every process of this host, as a hung kernel leaves them: connections stay open, nothing answers.
        Returns once every thread has stopped."""
        freeze_processes(self.pids())

    def thaw(self) -> None:
        """SIGCONT every process of this host: they go on where they stopped. Waits until none is left stopped,
        signalling again any that is (with a warning, for it should not happen), so that a test of a host's
        return never tests a host half frozen."""
        self._signal_all(signal.SIGCONT)
        deadline = time.monotonic() + 5
        while (stopped := self._stopped()) and time.monotonic() < deadline:
            warnings.warn(f"host {self.name}: still stopped after SIGCONT, signalled again: {stopped}", stacklevel=2)
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
        assert not stopped, f"processes of host {self.name} still stopped after SIGCONT: {stopped}"

    def processes(self) -> dict[int, str]:
        """Every process of this host, by pid: its command name and its state (/proc/PID/stat: R running, S
        sleeping, D in the disk, T stopped), for the messages of failed assertions."""
        found = {}
        for pid in self.pids():
            with contextlib.suppress(OSError):
                if (state := process_state(pid)) is not None:
                    found[pid] = f"{Path(f'/proc/{pid}/comm').read_text().strip()} {state}"
        return found

    def _stopped(self) -> dict[int, str]:
        return {pid: what for pid, what in self.processes().items() if what.endswith(" T")}

    def _signal_all(self, sig: int) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def unplug(self) -> None:
        """Take this host's cable off the bridge: nothing it sends arrives, nothing reaches it, nothing answers."""
        ip("link", "set", self.veth, "down")

    def plug(self) -> None:
        """Put this host's cable back on the bridge."""
        ip("link", "set", self.veth, "up")

    def slow(self, rate: str = "1mbit") -> None:
        """Shape what this host sends to ``rate`` (a token bucket: slow, not dead; this kernel has no netem)."""
        tc = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "1s"]
        subprocess.run(self.command(tc), check=True, capture_output=True, timeout=30)

    def unslow(self) -> None:
        """Take the shaping off again."""
        subprocess.run(
            self.command(["tc", "qdisc", "del", "dev", "eth0", "root"]), check=True, capture_output=True, timeout=30
        )

    def sent_bytes(self) -> int:
        """Bytes this host has sent onto the network (what its cable's bridge end received)."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/rx_bytes").read_text())

    def received_bytes(self) -> int:
        """Bytes the network has delivered to this host."""
        return int(Path(f"/sys/class/net/{self.veth}/statistics/tx_bytes").read_text())


class Network:
    """A bridge in the root namespace, at ``gateway``, and the hosts on it; ``close`` takes it all down."""

    def __init__(self) -> None:
        remove_leftovers()
        self.subnet = _free_subnet()
        addresses = self.subnet.hosts()
        self.gateway = str(next(addresses))
        self._addresses = addresses
        self.name = f"{os.getpid()}-{next(_networks)}"
        self.bridge = f"pcb{self.name}"
        self.hosts: list[Host] = []
        ip("link", "add", self.bridge, "type", "bridge")
        try:
            ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
        except RuntimeError:
            self.close()
            raise

    def host(self, name: str) -> Host:
        """A new host on this network, at its next free address."""
        host = Host(name, f"pcnet{self.name}-{name}", str(next(self._addresses)), f"pcv{self.name}-{len(self.hosts)}")
        ip("netns", "add", host.namespace)
        self.hosts.append(host)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        ip("link", "set", host.veth, "master", self.bridge, "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        return host

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        for host in self.hosts:
            _delete_namespace(host.namespace)
            ip("link", "del", host.veth, check=False)  # gone with its peer already, unless the delete failed
        ip("link", "del", self.bridge, check=False)
