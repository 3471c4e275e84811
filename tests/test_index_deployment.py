"""An index URL that names the wrong kind of server (a Cluster node, a replica, a Sentinel) is refused with the URL
form to use, by ``deployment_problem`` and by a daemon given it, which starts nothing; real servers of each kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.cachestore.host.processes import free_port_block
from prefixcache.indexer.redis_clients import deployment_problem, redis_client
from tests.redis_topologies import RedisClusterServers, RedisSentinelServers
from tests.test_data_dir_lock import serve


def problem_of(url: str) -> str | None:
    client = redis_client(url)
    try:
        return deployment_problem(client, url, "pc:")
    finally:
        client.close()


def replica_url(servers: RedisSentinelServers) -> str:
    primary = servers.primary()
    return next(node.url for node in servers.data_nodes if node.address != primary)


def test_a_lone_server_and_the_primary_sentinel_names_are_fit(redis_server, redis_sentinel):
    assert problem_of(redis_server.url) is None
    assert problem_of(redis_sentinel.node(redis_sentinel.primary()).url) is None
    assert problem_of(redis_sentinel.url) is None  # redis+sentinel:// finds the primary itself


def test_a_cluster_node_is_named_with_the_url_form_to_use(redis_cluster: RedisClusterServers):
    problem = problem_of(redis_cluster.masters()[0].url)
    assert problem is not None and "node of a Redis Cluster" in problem and "redis+cluster://" in problem
    assert redis_cluster.password not in problem
    assert problem_of(redis_cluster.url) is None


def test_a_replica_and_a_sentinel_are_named_with_the_url_form_to_use(redis_sentinel: RedisSentinelServers):
    replica = problem_of(replica_url(redis_sentinel))
    assert replica is not None and "is a replica" in replica and "redis+sentinel://" in replica
    sentinel = problem_of(f"redis://127.0.0.1:{redis_sentinel.sentinels[0].port}/0")
    assert sentinel is not None and "is a Redis Sentinel" in sentinel and "redis+sentinel://" in sentinel


@pytest.mark.parametrize("kind", ["cluster-node", "replica"])
def test_a_daemon_given_the_wrong_kind_of_server_refuses_to_start_in_one_line(
    kind, redis_cluster, redis_sentinel, tmp_path: Path
):
    servers = redis_cluster if kind == "cluster-node" else redis_sentinel
    url = redis_cluster.masters()[0].url if kind == "cluster-node" else replica_url(redis_sentinel)
    # the password never in a flag
    refused = serve(tmp_path / "data", free_port_block(7), env={"PREFIXCACHE_REDIS_URL": url})
    assert refused.returncode == 2, refused.stderr
    expected = "redis+cluster://" if kind == "cluster-node" else "redis+sentinel://"
    assert refused.stderr.count("error:") == 1 and expected in " ".join(refused.stderr.split()), refused.stderr
    assert "Traceback" not in refused.stderr and servers.password not in refused.stderr
    assert "embedded redis-server" not in refused.stderr and "mooncake" not in refused.stderr.lower()
