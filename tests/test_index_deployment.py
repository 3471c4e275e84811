"""An index URL that names the wrong kind of server (a Cluster node, a replica, a Sentinel) is refused with the URL
form to use, by ``deployment_problem`` and by a daemon given it, which starts nothing; real servers of each kind."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.host.processes import free_port_block
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import deployment_problem, redis_client
from tests.daemon_harness import Daemon, wait_for
from tests.redis_topologies import RedisClusterServers, RedisSentinelServers
from tests.test_data_dir_lock import serve


def problem_of(url: str) -> str | None:
    client = redis_client(url)
    try:
        return deployment_problem(client, url, Keyspace("pc"))
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


def test_a_running_daemon_whose_index_becomes_a_replica_names_the_index_in_its_health(tmp_path: Path):
    """A primary demoted under a running daemon (a failover elsewhere, an operator's REPLICAOF) still answers, but
    refuses every write: health names the index as the failing component until it is a primary again."""
    index = EmbeddedRedis(tmp_path / "index", admin=True)
    other = EmbeddedRedis(tmp_path / "other")
    with contextlib.ExitStack() as running:
        for server in (index, other):
            server.start()
            running.callback(server.stop)
        daemon = Daemon(tmp_path / "data", env={"PREFIXCACHE_REDIS_URL": index.url}).start()
        running.callback(daemon.stop)

        def redis_health() -> dict:
            return httpx.get(daemon.url + "/v1/health", timeout=10).json()["components"]["redis"]

        assert redis_health()["ok"]
        with redis_client(index.admin_url) as admin:
            admin.execute_command("REPLICAOF", other.host, other.port)
            assert wait_for(lambda: not redis_health()["ok"], timeout_s=10)
            assert "is a replica" in redis_health()["detail"] and index.password not in redis_health()["detail"]
            admin.execute_command("REPLICAOF", "NO", "ONE")
            assert wait_for(lambda: redis_health()["ok"], timeout_s=10)
