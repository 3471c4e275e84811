"""Finding and resetting this process's connections to the segment owner (cachestore/tiers/mooncake_attachment.py).

Whether a dropped process is taken back is tested end to end in tests/test_worker_side.py."""

from __future__ import annotations

import ipaddress
import socket

from prefixcache.cachestore.tiers.mooncake_attachment import _remote_endpoint, connections_to, shut_down


def test_proc_net_tcp_addresses_are_read_as_the_kernel_writes_them():
    assert _remote_endpoint("0100007F:1F90") == (ipaddress.ip_address("127.0.0.1"), 8080)
    assert _remote_endpoint("0000000000000000FFFF00000100007F:0050") == (ipaddress.ip_address("127.0.0.1"), 80)
    assert _remote_endpoint("00000000000000000000000001000000:01BB") == (ipaddress.ip_address("::1"), 443)


def test_only_established_connections_to_the_owner_are_found_and_shut_down():
    with socket.create_server(("127.0.0.1", 0)) as owner, socket.create_server(("127.0.0.1", 0)) as other:
        port = owner.getsockname()[1]
        with (
            socket.create_connection(("127.0.0.1", port)) as ours,
            socket.create_connection(("127.0.0.1", other.getsockname()[1])) as unrelated,
        ):
            accepted, _ = owner.accept()
            with accepted:
                found = connections_to(f"127.0.0.1:{port}")
                assert found and ours.fileno() in found and unrelated.fileno() not in found
                assert connections_to(f"localhost:{port}") == found  # a name: the port alone decides
                assert connections_to(f"127.0.0.2:{port}") == []
                shut_down(found)
                assert accepted.recv(1) == b""  # the owner's side sees the connection end
                assert ours.fileno() != -1  # the connection's owner still holds its descriptor
