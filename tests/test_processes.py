"""Port choice for daemons started by tests and by `prefixcache serve`, and the priority a child server runs at."""

from __future__ import annotations

import socket
import sys

from prefixcache.cachestore.host.processes import ManagedProcess, _ephemeral_ports, free_port_block
from tests.daemon_harness import niceness


def test_a_port_block_lies_outside_the_ephemeral_range_and_is_free():
    """Outgoing connections take ephemeral ports; a block there could lose a port before the daemon binds it."""
    ephemeral = _ephemeral_ports()
    for _ in range(20):
        base = free_port_block(7)
        block = range(base, base + 7)
        assert block.stop <= ephemeral.start or block.start >= ephemeral.stop
        for port in block:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port))


def test_blocks_differ_between_calls_so_parallel_tests_rarely_collide():
    assert len({free_port_block(7) for _ in range(10)}) > 1


def test_a_server_started_with_a_nice_runs_at_it_in_every_thread_and_its_session(tmp_path):
    """Raising a nice needs no privilege, so this runs anywhere; the daemon lowers its segment owner's
    (tests/test_serve.py)."""
    two_threads = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    server = ManagedProcess(
        "sleeper", [sys.executable, "-c", two_threads], tmp_path / "sleeper.log", ready=lambda: True, nice=7
    )
    server.start()
    try:
        assert server.pid is not None
        seen = niceness(server.pid)
        assert set(seen.values()) <= {7, "7", "none"} and 7 in seen.values(), seen
    finally:
        server.stop()
