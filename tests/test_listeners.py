"""Nothing of a node listens beyond its configured addresses: real daemons, real sockets, read from /proc."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.cachestore.host.listeners import (
    ExposedListenerError,
    Listener,
    check_listeners,
    too_wide,
    tree_listeners,
)
from prefixcache.cachestore.host.processes import free_port_block
from prefixcache.cachestore.tiers.bind_shim import bind_env
from tests.daemon_harness import Daemon

#: A child that binds ADDRESS (port 0), listens, prints its port and waits for stdin to close.
LISTENER = textwrap.dedent("""
    import socket, sys
    family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
    s = socket.socket(family)
    if family == socket.AF_INET6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    s.bind((sys.argv[1], 0))
    s.listen()
    print(s.getsockname()[1], flush=True)
    sys.stdin.read()
""")


class Child:
    """A process of this test's tree listening on ``address``, until the test ends."""

    def __init__(self, address: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LISTENER, address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def listeners(self) -> list[Listener]:
        return [lst for lst in tree_listeners(os.getpid()) if lst.pid == self.proc.pid]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


@pytest.fixture
def child() -> Iterator[type[Child]]:
    started: list[Child] = []

    def start(address: str, env: dict[str, str] | None = None) -> Child:
        started.append(Child(address, env))
        return started[-1]

    yield start  # type: ignore[misc]
    for c in started:
        c.stop()


def has_ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def local_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine (the one outgoing traffic would use), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the kernel only picks a source address
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


# --- /proc parsing on real sockets -------------------------------------------------------------------------


def test_a_wildcard_listener_of_a_child_is_found_and_named_too_wide(child) -> None:
    wide = child("0.0.0.0")
    (found,) = wide.listeners()
    assert (found.address, found.port, found.pid) == ("0.0.0.0", wide.port, wide.proc.pid)
    assert found.process.startswith("python")
    assert too_wide([found]) == [found]
    with pytest.raises(ExposedListenerError) as raised:
        check_listeners(os.getpid())
    assert f"0.0.0.0:{wide.port} (python" in str(raised.value)
    assert f"pid {wide.proc.pid})" in str(raised.value)
    assert "\n" not in str(raised.value)


def test_loopback_listeners_pass(child) -> None:
    local = child("127.0.0.1")
    (found,) = local.listeners()
    assert (found.address, found.port) == ("127.0.0.1", local.port)
    assert too_wide([found]) == []
    if has_ipv6():
        (found6,) = child("::1").listeners()
        assert found6.address == "::1" and too_wide([found6]) == []


@pytest.mark.skipif(not has_ipv6(), reason="no IPv6 on this machine")
def test_an_ipv6_wildcard_listener_is_too_wide(child) -> None:
    wide = child("::")
    (found,) = wide.listeners()
    assert (found.address, found.port) == ("::", wide.port)
    assert too_wide([found]) == [found]
    assert f"[::]:{wide.port}" in str(found)


def test_what_the_node_was_given_is_allowed(child) -> None:
    wide = child("0.0.0.0")
    (found,) = wide.listeners()
    assert too_wide([found], addresses=["0.0.0.0"]) == []  # an operator's explicit wildcard
    assert too_wide([found], endpoints=[("*", wide.port)]) == []  # e.g. a KV-events endpoint tcp://*:PORT
    assert too_wide([found], endpoints=[("*", wide.port + 1)]) == [found]  # only on its own port
    assert too_wide([found], addresses=["127.0.0.1", "localhost"]) == [found]
    address = local_ipv4()
    if address is not None:
        (on_ip,) = child(address).listeners()
        assert too_wide([on_ip]) == [on_ip]
        assert too_wide([on_ip], addresses=[address]) == []


def test_the_bind_shim_moves_wildcard_binds_to_the_given_address(child) -> None:
    (found,) = child("0.0.0.0", env=bind_env("127.0.0.1")).listeners()
    assert found.address == "127.0.0.1"
    if has_ipv6():
        (found6,) = child("::", env=bind_env("127.0.0.1")).listeners()
        assert found6.address == "::ffff:127.0.0.1"  # a dual-stack socket, on IPv4 loopback only
        assert too_wide([found, found6]) == []
    (kept,) = child("127.0.0.2", env=bind_env("127.0.0.1")).listeners()
    assert kept.address == "127.0.0.2"  # a specific address is left as asked


# --- real daemons ------------------------------------------------------------------------------------------


def test_a_default_node_listens_on_loopback_only(daemon: Daemon) -> None:
    """Redis, the master (RPC, metadata, metrics), the segment owner (shm attach, transfer engine handshake and
    data ports), the REST API, and the daemon's own Mooncake client (``setup_dummy``): none beyond loopback."""
    listeners = tree_listeners(daemon.proc.pid)
    ports = {lst.port for lst in listeners}
    # REST, redis, shm attach, master RPC, metadata, metrics (PORT+3 only names the segment)
    assert {daemon.port + offset for offset in (0, 1, 2, 4, 5, 6)} <= ports, listeners
    owner = [lst for lst in listeners if lst.process == "mooncake_client"]
    assert len(owner) >= 3, listeners  # shm attach + the transfer engine's handshake and data ports
    assert too_wide(listeners) == [], f"listening beyond loopback: {too_wide(listeners)}"


@pytest.mark.skipif(local_ipv4() is None, reason="no non-loopback IPv4 address on this machine")
def test_a_pool_node_listens_on_its_mooncake_host_and_loopback_only(tmp_path: Path) -> None:
    address = local_ipv4()
    assert address is not None
    node = Daemon(tmp_path / "data", "--mooncake-host", address).start()
    try:
        listeners = tree_listeners(node.proc.pid)
        owner = [lst for lst in listeners if lst.process == "mooncake_client"]
        assert {lst.address.removeprefix("::ffff:") for lst in owner} == {address}, owner
        assert too_wide(listeners, addresses=[address]) == []
    finally:
        node.stop()


def test_a_node_with_a_wide_listener_refuses_to_serve(tmp_path: Path) -> None:
    """The daemon process itself holds a socket on 0.0.0.0 (inherited across exec): it names it and stops."""
    port = free_port_block(7)
    wrapper = textwrap.dedent("""
        import os, socket, sys
        s = socket.socket()
        s.bind(("0.0.0.0", 0))
        s.listen()
        s.set_inheritable(True)
        print(s.getsockname()[1], flush=True)
        os.execv(sys.executable, [sys.executable, "-m", "prefixcache.cachestore", *sys.argv[1:]])
    """)
    argv = [
        sys.executable,
        "-c",
        wrapper,
        "serve",
        "--data-dir",
        str(tmp_path / "data"),
        "--port",
        str(port),
        "--dram-bytes",
        "64MiB",
        "--nvme-bytes",
        "512MiB",
        "--node",
        "node-wide",
    ]
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "500"})
    wide_port = int(done.stdout.splitlines()[0])
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, done.stderr
    assert f"refusing to serve: 0.0.0.0:{wide_port} (python" in error[0]
    assert "no authentication" in error[0]
    # it stopped everything it had started: nothing listens on its ports any more
    for p in range(port, port + 7):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", p)) != 0, f"port {p} still open"
    assert time.monotonic() - started < 120


def test_the_shim_runs_a_command_bound_to_an_address() -> None:
    """``python -m prefixcache.cachestore.tiers.bind_shim run ADDRESS COMMAND``: how a container runs an external
    master."""
    code = "import socket; s = socket.socket(); s.bind(('0.0.0.0', 0)); print(s.getsockname()[0])"
    argv = [
        sys.executable,
        "-m",
        "prefixcache.cachestore.tiers.bind_shim",
        "run",
        "127.0.0.1",
        sys.executable,
        "-c",
        code,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "127.0.0.1", done.stderr
