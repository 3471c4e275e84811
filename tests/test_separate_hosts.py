"""Nodes on hosts of their own: each ``prefixcache serve`` in a network namespace (tests/netns.py) at an address
of its own, its REST API and its Mooncake segment bound there, and its clients in the same namespace
(tests/host_client.py); whatever passes between nodes crosses a network, as between machines
(tests/test_two_nodes.py runs its nodes on one loopback instead).

Where the cluster's servers run: the index's Redis and the Mooncake master run in the root namespace, on the
bridge's address (``cluster_servers``), as a deployment with an external index and master runs them, and every
node joins them over the network. A node's embedded redis-server and master listen on its loopback only, so
no other host could join them; and with them outside every node, a node can fail alone (the last tests crash
one and pull one's cable) while the others keep the index and the pool. The root namespace also holds the
test itself (it calls the daemons' REST APIs over the bridge) and the KV-event subscriber: a router on the
cluster's network.

Mooncake moves bytes between nodes over TCP (``mooncake_protocol``'s default): each node's segment owner binds
and advertises its own address (``--mooncake-host``), and a client attaches to its own node's owner through
shared memory. The hosts' traffic counters show the chunks crossing.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import httpx
import pytest

from prefixcache.indexer.peers import SUSPECT_LONGEST_S
from tests.daemon_harness import ClusterServers, cluster_servers, node_on, wait_for
from tests.host_client import HostClient
from tests.netns import Host, Network, unusable
from tests.test_kv_events import Subscriber
from tests.test_two_nodes import evict, nvme_chunks

CHUNK = 64
KV_EVENTS_PORT = 5557
#: What a load of a lost or slow node's chunks may take, with every margin this noisy machine needs: its read's
#: deadline is 0.5 s and a promotion's wait 2 s, where Mooncake alone waits 30 s.
LOAD_BOUND_S = 5.0


@pytest.fixture(scope="module")
def usable() -> None:
    reason = unusable()
    if reason:
        pytest.skip(reason)


class Cluster:
    """Nodes A and B on hosts of their own, joined to the cluster's servers in the root namespace; A publishes
    KV events on its address, to ``subscriber``."""

    def __init__(self, network: Network, directory: Path, servers: ClusterServers) -> None:
        self.servers = servers
        self.host_a, self.host_b = network.host("a"), network.host("b")
        events = f"tcp://{self.host_a.address}:{KV_EVENTS_PORT}"
        chunks = ("--chunk-tokens", str(CHUNK))
        self.a = node_on(self.host_a, servers, directory / "a", *chunks, "--kv-events-endpoint", events)
        self.b = node_on(self.host_b, servers, directory / "b", *chunks)
        self.subscriber = Subscriber(events)

    def client_a(self) -> closing[HostClient]:
        return closing(HostClient(self.host_a, self.a))

    def client_b(self) -> closing[HostClient]:
        return closing(HostClient(self.host_b, self.b))

    def segments(self) -> list[str]:
        """The segments the master has mounted (its ``/get_all_segments``)."""
        url = f"http://{self.servers.host}:{self.servers.metrics_port}/get_all_segments"
        return httpx.get(url, timeout=5).raise_for_status().text.split()


@contextmanager
def running_cluster(directory: Path) -> Iterator[Cluster]:
    """A network, the cluster's servers on its bridge, and nodes A and B started; all taken down on exit."""
    with Network() as network, cluster_servers(directory / "servers", network.gateway) as servers:
        cluster = Cluster(network, directory, servers)
        try:
            cluster.a.start()
            cluster.b.start()
            yield cluster
        finally:
            cluster.b.stop()
            cluster.a.stop()
            cluster.subscriber.socket.close(linger=0)


@pytest.fixture(scope="module")
def cluster(usable, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("hosts")) as nodes:
        yield nodes


@pytest.fixture
def doomed_cluster(usable, tmp_path: Path) -> Iterator[Cluster]:
    """A cluster of the test's own, for tests that take node A down."""
    with running_cluster(tmp_path) as nodes:
        yield nodes


def prompt(seed: int, chunks: int) -> list[int]:
    return list(range(seed * 10_000, seed * 10_000 + chunks * CHUNK))


def test_a_chunk_published_on_one_host_is_read_on_another_over_the_network(cluster):
    with cluster.client_a() as on_a, cluster.client_b() as on_b:
        keys, payloads = on_a.publish(prompt(1, chunks=4), seed=1)
        sent, received = cluster.host_a.sent_bytes(), cluster.host_b.received_bytes()
        assert on_b.fetch(keys) == payloads
        crossed = sum(map(len, payloads))
        assert cluster.host_a.sent_bytes() - sent >= crossed, "A's segment owner sent them"
        assert cluster.host_b.received_bytes() - received >= crossed, "the network delivered them to B"
        assert on_b.counters()["promoted"] == 0  # from A's DRAM, by Mooncake


def test_one_hosts_kv_events_reach_a_router_on_the_network(cluster):
    tokens = prompt(6, chunks=2)
    with cluster.client_a() as on_a:
        keys, _ = on_a.publish(tokens, seed=6)
    seen = cluster.subscriber.until({("BlockStored", k, medium) for k in keys for medium in ("CPU", "STORAGE")})
    stored = {(e.block_hashes[0], e.medium): e.token_ids for e in seen if type(e).__name__ == "BlockStored"}
    for i, key in enumerate(keys):
        assert stored[key, "CPU"] == stored[key, "STORAGE"] == tokens[i * CHUNK : (i + 1) * CHUNK]


def test_a_chunk_only_one_hosts_nvme_holds_is_promoted_by_its_daemon_for_a_reader_on_another(cluster):
    with cluster.client_a() as on_a, cluster.client_b() as on_b:
        keys, payloads = on_a.publish(prompt(2, chunks=3), seed=2)
        on_a.wait_persisted(keys)
        assert on_a.demote(keys) == [True] * len(keys)
        received = cluster.host_b.received_bytes()
        assert on_b.fetch(keys) == payloads
        assert on_b.counters()["promoted"] == len(keys)
        assert cluster.host_b.received_bytes() - received >= sum(map(len, payloads))


def test_a_host_that_read_from_another_before_it_restarted_reads_from_it_again(cluster):
    """A restarted node's segment owner keeps its segment's name on new ports: the others learn them."""
    with cluster.client_a() as on_a, cluster.client_b() as on_b:
        keys, payloads = on_a.publish(prompt(3, chunks=3), seed=3)
        on_a.wait_persisted(keys)
        assert on_b.fetch(keys) == payloads
    cluster.a.stop()
    cluster.a.start()  # its chunks are on its NVMe alone now: A promotes them into its new segment
    with cluster.client_b() as on_b:
        assert wait_for(lambda: on_b.fetch(keys) == payloads, timeout_s=15), "B never read A's new segment"


def test_an_eviction_asked_of_one_host_deletes_the_copies_another_hosts_nvme_holds(cluster):
    with cluster.client_b() as on_b:
        keys, _ = on_b.publish(prompt(4, chunks=3), seed=4)
        kept, kept_payloads = on_b.publish(prompt(5, chunks=2), seed=5)
        on_b.wait_persisted(keys + kept)
        before = nvme_chunks(cluster.b)
        result = evict(cluster.a, keys)
        assert (result["chunks"], result["kept_elsewhere"], result["pending_nodes"]) == (len(keys), 0, [])
        assert nvme_chunks(cluster.b) == before - len(keys)
        assert on_b.fetch(keys) == [None] * len(keys)
        assert on_b.fetch(kept) == kept_payloads


def health_of(daemon) -> dict:
    return httpx.get(daemon.url + "/v1/health", timeout=10).json()


def stats_of(daemon) -> dict:
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers, timeout=10).json()


def state_of_a(cluster: Cluster) -> str:
    """What a failed assertion on A's return says of A: its processes and states, and its daemon's last words."""
    log = cluster.a.log_path.read_text(errors="replace").splitlines()
    said = [line for line in log if "Segment cache sync" not in line][-12:]
    return f"A's processes: {cluster.host_a.processes()}; A's daemon log ends:\n" + "\n".join(said)


def lose_a(cluster: Cluster, lose: Callable[[Host], None], recover: Callable[[Host], None] | None = None) -> None:
    """Publish a prompt on each node, B reading A's too (its owner then holds connections to A's), lose A
    (``lose(host_a)``), and check what B serves then: B takes A for down within seconds, so its lookups of A's
    prompt miss and its health names A; A's chunks fetched anyway miss (no error, no bytes of another chunk),
    before and after the master expires A's segment; B's own chunks hit, and B publishes and reads new ones. With
    ``recover``, A comes back (``recover(host_a)``) and B reads from it again without restarting anyone."""
    a_tokens, b_tokens = prompt(7, chunks=3), prompt(8, chunks=3)
    with cluster.client_a() as on_a:
        a_keys, a_payloads = on_a.publish(a_tokens, seed=7)
        on_a.wait_persisted(a_keys)
    with cluster.client_b() as on_b:
        b_keys, b_payloads = on_b.publish(b_tokens, seed=8)
        assert on_b.fetch(a_keys) == a_payloads
        assert on_b.down() == set() and on_b.lookup(a_tokens) == a_keys
        lose(cluster.host_a)
        started = time.monotonic()  # a load planned just before the loss: its read has a deadline
        assert on_b.fetch(a_keys, across_network=True) == [None] * len(a_keys)
        assert time.monotonic() - started < LOAD_BOUND_S, "a read from the lost node waited for Mooncake"
        assert wait_for(lambda: on_b.down() == {"node-a"}, timeout_s=10), "B never took A for down"
        assert on_b.lookup(a_tokens) == [], "B's lookups still offer chunks only A holds"
        assert on_b.lookup(b_tokens) == b_keys
        peers = health_of(cluster.b)["components"]["peers"]
        assert peers["degraded"] and "unreachable: node-a" in peers["detail"], peers
        assert on_b.fetch(b_keys) == b_payloads
        new_keys, new_payloads = on_b.publish(prompt(9, chunks=2), seed=9)
        assert on_b.fetch(new_keys) == new_payloads
        assert on_b.fetch(a_keys) == [None] * len(a_keys)  # past the lookups: Mooncake's own timeouts, then misses
        a_segment = f"{cluster.host_a.address}:{cluster.a.port + 3}"  # the node's segment_port, PORT+3
        assert wait_for(lambda: a_segment not in cluster.segments(), timeout_s=60), "the master kept A's segment"
        assert on_b.fetch(a_keys) == [None] * len(a_keys)
        assert on_b.fetch(b_keys) == b_payloads
        assert on_b.counters()["corrupt"] == 0
        # B serves: a read of B's owner that waited on A backs the DRAM tier off for a second (misses, health
        # unavailable meanwhile), after which B is ready again without A
        assert wait_for(lambda: httpx.get(cluster.b.url + "/v1/health", timeout=10).status_code == 200, timeout_s=5)
        if recover is None:
            return
        recover(cluster.host_a)
        assert wait_for(lambda: on_b.down() == set(), timeout_s=15), f"B never took A back; {state_of_a(cluster)}"
        assert on_b.lookup(a_tokens) == a_keys
        assert wait_for(lambda: on_b.fetch(a_keys) == a_payloads, timeout_s=60), (
            f"B never read A's chunks again ({on_b.counters()}); {state_of_a(cluster)}"
        )
        assert on_b.counters()["corrupt"] == 0


def test_a_host_that_crashes_leaves_misses_and_the_other_host_serving(doomed_cluster):
    lose_a(doomed_cluster, Host.crash)


def test_a_host_cut_off_the_network_is_skipped_and_read_again_once_plugged_back(doomed_cluster):
    lose_a(doomed_cluster, Host.unplug, recover=Host.plug)


def test_a_frozen_host_is_skipped_and_read_again_once_it_runs_again(doomed_cluster):
    lose_a(doomed_cluster, Host.freeze, recover=Host.thaw)


def test_a_host_behind_a_slow_link_costs_a_read_its_deadline_then_is_skipped_until_it_is_fast(doomed_cluster):
    """A's link shaped to 1 Mbit/s: alive (it beats), but a read of its chunks would take seconds. The read is a miss
    at its deadline, A is marked suspect for everyone, and lookups skip it; once the link is fast and the mark
    over, B reads from A again."""
    if shutil.which("tc") is None:
        pytest.skip("iproute2's tc is not installed (apt-get install iproute2)")
    cluster = doomed_cluster
    a_tokens = prompt(10, chunks=3)  # 3 chunks of 128 KiB: 3 s at 1 Mbit/s
    with cluster.client_a() as on_a, cluster.client_b() as on_b:
        a_keys, a_payloads = on_a.publish(a_tokens, seed=10)
        b_keys, b_payloads = on_b.publish(prompt(11, chunks=2), seed=11)
        assert on_b.fetch(a_keys, across_network=True) == a_payloads
        cluster.host_a.slow("1mbit")
        try:
            started = time.monotonic()
            assert on_b.fetch(a_keys, across_network=True) == [None] * len(a_keys)
            assert time.monotonic() - started < LOAD_BOUND_S, "a read over the slow link was not cut at its deadline"
            assert on_b.counters()["late"] == len(a_keys)
            assert on_b.down() == {"node-a"} and on_b.lookup(a_tokens) == []
            peers = health_of(cluster.b)["components"]["peers"]
            assert "node-a (marked suspect)" in peers["detail"], peers
            assert on_b.fetch(b_keys) == b_payloads
            assert wait_for(lambda: stats_of(cluster.b)["clients"]["late_chunks"] == len(a_keys))  # flushed each 1 s
            assert stats_of(cluster.b)["peers"]["node-a"]["suspect_marks"] >= 1
        finally:
            cluster.host_a.unslow()
        # late reads in a row double A's mark (up to SUSPECT_LONGEST_S): on a loaded machine more than one may count
        back = SUSPECT_LONGEST_S + 10
        assert wait_for(lambda: on_b.lookup(a_tokens) == a_keys, timeout_s=back), (
            f"A was never read from again: B avoids {on_b.down()}, found {len(on_b.lookup(a_tokens))} of "
            f"{len(a_keys)} chunks; B's daemon sees {health_of(cluster.b)['components']['peers']}"
        )
        assert wait_for(lambda: on_b.fetch(a_keys, across_network=True) == a_payloads, timeout_s=60)
        assert on_b.counters()["corrupt"] == 0
