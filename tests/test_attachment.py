"""Finding and resetting this process's connections to the segment owner (cachestore/tiers/mooncake_attachment.py).

What the keeper does when the owner dropped this process (fakes of the owner); whether a dropped process is taken
back is tested end to end in tests/test_worker_side.py."""

from __future__ import annotations

import ipaddress
import socket

from prefixcache.cachestore.tiers.mooncake_attachment import (
    AttachmentKeeper,
    _remote_endpoint,
    connections_to,
    shut_down,
)


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


class _Owner:
    """What the keeper sees of a segment owner that dropped this process: ``probe`` answers from ``maps`` (False
    until a test says otherwise), and the keeper's holds and escalations are recorded."""

    def __init__(self, maps: list[bool]) -> None:
        self.maps = maps
        self.holds: list[float] = []
        self.restarts = 0

    def probe(self) -> bool:
        return self.maps.pop(0) if len(self.maps) > 1 else self.maps[0]

    def keeper(self, server: socket.socket) -> AttachmentKeeper:
        """A keeper of an attachment to the owner listening on ``server``."""
        address = f"127.0.0.1:{server.getsockname()[1]}"
        keeper = AttachmentKeeper(
            self.probe, self.holds.append, address, repair_timeout_s=0.2, on_unrepaired=self.restart
        )
        keeper.suspect()  # its next step checks at once
        return keeper

    def restart(self) -> None:
        self.restarts += 1


def test_a_repair_that_takes_counts_and_escalates_nothing():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        owner = _Owner([False, True])  # dropped; mapped again once the connection was reset
        keeper = owner.keeper(server)
        keeper.step()
        assert (keeper.repairs, keeper.unrepaired, owner.restarts) == (1, 0, 0) and owner.holds


def test_a_repair_that_does_not_take_runs_on_unrepaired_once():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()):
        owner = _Owner([False])  # dropped for good: resetting the connection changes nothing
        keeper = owner.keeper(server)
        keeper.step()
        assert (keeper.repairs, keeper.unrepaired, owner.restarts) == (0, 1, 1)


def test_no_connection_to_reset_escalates_at_once():
    with socket.create_server(("127.0.0.1", 0)) as server:
        owner = _Owner([False])
        keeper = owner.keeper(server)
        keeper.step()
        assert (keeper.unrepaired, owner.restarts) == (1, 1) and len(owner.holds) == 1
