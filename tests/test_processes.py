"""Port choice for daemons started by tests and by `prefixcache serve`."""

from __future__ import annotations

import socket

from cachestore.processes import _ephemeral_ports, free_port_block


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
