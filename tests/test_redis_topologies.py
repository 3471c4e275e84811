"""The Redis Cluster and Sentinel fixtures (tests/redis_topologies.py) are what they claim: the roles, the slot
coverage, and failovers that keep acknowledged writes, checked with redis-py's own cluster and sentinel clients."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from tests.redis_topologies import (
    CLUSTER_SLOTS,
    HOST,
    SENTINEL_SERVICE,
    RedisClusterServers,
    RedisNode,
)


def replicated_set(client: redis.Redis, key: str, value: str) -> None:
    """``SET`` then ``WAIT 1 0`` on the same connection: returns once a replica holds the write."""
    pipe = client.pipeline(transaction=False)
    pipe.set(key, value)
    pipe.execute_command("WAIT", 1, 0)
    assert pipe.execute() == [True, 1]


def owner_of(cluster: RedisClusterServers, key: str) -> RedisNode:
    """The master serving ``key``'s slot, as redis-py's cluster client routes it."""
    with cluster.client() as client:
        return cluster.node(client.get_node_from_key(key).port)


def test_cluster_has_three_masters_and_three_replicas_covering_every_slot(redis_cluster):
    assert redis_cluster.url.startswith(f"redis+cluster://:{redis_cluster.password}@{HOST}:")
    masters, replicas = redis_cluster.masters(), redis_cluster.replicas()
    assert (len(masters), len(replicas)) == (3, 3)
    with redis_cluster.client() as client:
        assert {n.port for n in client.get_primaries()} == {n.port for n in masters}
        assert {n.port for n in client.get_replicas()} == {n.port for n in replicas}
        assert sum(end - start + 1 for start, end in client.cluster_slots()) == CLUSTER_SLOTS
        keys = [f"topology:{i}" for i in range(30)]
        for key in keys:
            client.set(key, key)
        assert [client.get(key) for key in keys] == [key.encode() for key in keys]
        assert len({client.get_node_from_key(key).port for key in keys}) == 3  # the keys spread over every master


def test_cluster_refuses_clients_without_the_password(redis_cluster):
    node = redis_cluster.masters()[0]
    no_retries = Retry(NoBackoff(), 0)  # redis-py retries an authentication error as a connection error
    with redis.Redis(HOST, node.port, retry=no_retries) as client, pytest.raises(redis.exceptions.AuthenticationError):
        client.get("k")


def test_killed_master_is_replaced_by_a_replica_and_keeps_replicated_writes(private_redis_cluster):
    cluster = private_redis_cluster
    victim = owner_of(cluster, "survivor")
    with victim.client() as client:
        replicated_set(client, "survivor", "kept")
    cluster.kill_master(victim.port)
    cluster.wait_healthy()
    masters = cluster.masters()
    assert len(masters) == 3 and victim not in masters
    assert len(cluster.replicas()) == 2
    with cluster.client() as client:
        assert client.get("survivor") == b"kept"
        assert client.get_node_from_key("survivor").port != victim.port
    cluster.restart(victim)
    assert victim in cluster.replicas() and len(cluster.replicas()) == 3
    with cluster.client() as client:
        assert client.get("survivor") == b"kept"


def test_cluster_url_reaches_the_cluster_through_any_live_node(private_redis_cluster):
    cluster = private_redis_cluster
    first = cluster.live_nodes()[0]
    first.kill()
    cluster.wait_healthy()
    port = int(cluster.url.rpartition(":")[2])
    assert port != first.port
    with RedisCluster(HOST, port, password=cluster.password) as client:
        client.set("through", "another node")
        assert client.get("through") == b"another node"


def test_sentinels_name_the_primary_and_serve_it_to_clients(redis_sentinel):
    primary, replica = redis_sentinel.data_nodes
    assert redis_sentinel.primary() == primary.address
    hosts = ",".join(f"{HOST}:{s.port}" for s in redis_sentinel.sentinels)
    assert redis_sentinel.url == f"redis+sentinel://:{redis_sentinel.password}@{hosts}/{SENTINEL_SERVICE}"
    sentinel = redis_sentinel.sentinel()
    assert sentinel.discover_master(SENTINEL_SERVICE) == primary.address
    assert sentinel.discover_slaves(SENTINEL_SERVICE) == [replica.address]
    with sentinel.master_for(SENTINEL_SERVICE) as client:
        replicated_set(client, "served", "by the primary")
    with replica.client() as client:
        assert client.get("served") == b"by the primary"


def test_sentinel_failover_promotes_the_replica_with_its_replicated_writes(private_redis_sentinel):
    servers = private_redis_sentinel
    primary, replica = servers.data_nodes
    sentinel = servers.sentinel()
    with sentinel.master_for(SENTINEL_SERVICE) as client:
        replicated_set(client, "survivor", "kept")
    assert servers.kill_primary() == primary.address
    assert not primary.alive()
    assert servers.wait_failover(primary.address) == replica.address
    assert servers.primary() == replica.address
    with sentinel.master_for(SENTINEL_SERVICE) as client:
        assert client.get("survivor") == b"kept"
        client.set("after", "the failover")
    with replica.client() as client:
        assert client.execute_command("ROLE")[0] == b"master"
        assert client.get("after") == b"the failover"
