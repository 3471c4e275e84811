"""The whole node on a Redis Cluster and behind Sentinel, through failovers: real servers, real kill -9.

A failed master or primary costs misses while its replica takes over (``IndexUnavailableError``, which every
caller treats as a miss), never an error to vLLM and never wrong KV; hits resume once the cluster is healthy.
What a failover can lose are the writes its replica had not received (replication is asynchronous): those
entries are gone, their chunks are recomputed and published again, and a node's NVMe copies are registered
again by its reconcile at start.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis.crc import key_slot

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import ChunkRecord, Location
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.redis_index import RedisIndex
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import (
    Daemon,
    fetch_payloads,
    make_chunk,
    make_spec,
    publish_prompt,
    wait_for,
    wait_persisted,
)
from tests.netns import freeze_processes
from tests.redis_topologies import RedisClusterServers, RedisNode, RedisSentinelServers

PROMPT = list(range(64 * 6 + 20))  # six full chunks of 64 and a tail long enough to be found


def on_index(daemon_dir: Path, url: str, password: str) -> Daemon:
    daemon = Daemon(daemon_dir, "--redis-url", url)
    daemon.index_password = password
    return daemon


@pytest.fixture
def node_on_cluster(tmp_path: Path, redis_cluster: RedisClusterServers) -> Iterator[tuple[Daemon, CacheClient]]:
    daemon = on_index(tmp_path / "node", redis_cluster.url, redis_cluster.password).start()
    client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=redis_cluster.password)
    yield daemon, client
    client.index.flush()
    client.close()
    daemon.stop()


def register_chain(index: RedisIndex, tokens: list[int]) -> list[bytes]:
    """Register the full chunks of ``tokens`` as one producer does; returns their keys."""
    spec, records = make_spec(), []
    parent = spec.root()
    for start in range(0, len(tokens) - 63, 64):
        packed = pack_tokens(tokens[start : start + 64])
        record = ChunkRecord.of(
            parent=parent,
            packed_tokens=packed,
            root=spec.root(),
            namespace=spec.digest,
            size_bytes=1,
            location=Location("dram", "a"),
        )
        records.append(record)
        parent = record.key
    index.register(records)
    return [r.key for r in records]


def matched(client: CacheClient, tokens: list[int]) -> int:
    return client.lookup(client.hasher().extend(tokens).query()).matched_tokens


def master_serving(cluster: RedisClusterServers, anchor: bytes) -> RedisNode:
    """The master that serves the slot of the chain anchored at ``anchor`` (its first chunk's key)."""
    with cluster.client() as client:
        node = client.nodes_manager.get_node_from_slot(key_slot(anchor.hex().encode()))
    return cluster.node(node.port)


def replica_of(cluster: RedisClusterServers, master: RedisNode) -> RedisNode:
    (replica,) = [
        node for node in cluster.replicas() if node.client().info("replication").get("master_port") == master.port
    ]
    return replica


def fill_replication_stream(cluster: RedisClusterServers, master: RedisNode, megabytes: int = 48) -> None:
    """Write ``megabytes`` to ``master``: more than the kernel buffers of a stopped replica's link take, so what
    follows stays in the master's memory."""
    with cluster.client() as client:
        names = (f"filler:{i}" for i in range(100_000))
        mine = [n for n in names if client.nodes_manager.get_node_from_slot(key_slot(n.encode())).port == master.port]
        for name in mine[:megabytes]:
            client.set(name, os.urandom(1 << 20))


def test_a_node_on_a_cluster_publishes_persists_hits_and_evicts(node_on_cluster):
    daemon, client = node_on_cluster
    keys, payloads = publish_prompt(client, PROMPT, seed=1)
    wait_persisted(client, keys)  # the daemon read this node's change feed on the chain's shard
    assert matched(client, PROMPT) == len(PROMPT)
    assert fetch_payloads(client, keys) == payloads
    stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()
    assert stats["nvme"]["chunks"] == len(keys)
    listed = httpx.get(daemon.url + "/v1/chunks", params={"limit": 3}, headers=daemon.headers).json()
    assert len(listed["chunks"]) == 3
    evicted = httpx.post(daemon.url + "/v1/evict", json={"keys": [keys[0].hex()]}, headers=daemon.headers).json()
    assert evicted["chunks"] == 1
    assert matched(client, PROMPT) == 0


def test_prompts_with_different_first_chunks_spread_over_the_masters(redis_cluster):
    index = RedisIndex(redis_cluster.url, key_prefix="spread")
    try:
        anchors = [register_chain(index, [prompt * 1000 + i for i in range(130)])[0] for prompt in range(24)]
        holders = {master_serving(redis_cluster, anchor).port for anchor in anchors}
        assert len(holders) == 3  # 24 chains over 3 masters: every one holds some
        assert all(node.client().dbsize() > 0 for node in redis_cluster.masters())
    finally:
        index.flush()
        index.close()


def test_a_killed_master_costs_misses_never_errors_or_wrong_kv(tmp_path, private_redis_cluster):
    cluster = private_redis_cluster
    daemon = on_index(tmp_path / "node", cluster.url, cluster.password).start()
    client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=cluster.password)
    try:
        keys, payloads = publish_prompt(client, PROMPT, seed=2)
        wait_persisted(client, keys)
        outcomes: list[str] = []
        failures: list[BaseException] = []
        stop = threading.Event()

        def traffic() -> None:  # what a connector does: look up, load what hit, publish what missed
            seed = 10
            while not stop.is_set():
                try:
                    hit = matched(client, PROMPT)
                    got = fetch_payloads(client, keys)
                    assert all(g is None or g == p for g, p in zip(got, payloads, strict=True)), "wrong KV"
                    meta, slot, _ = make_chunk(client, client.spec.root(), [seed] * 64, seed)
                    try:
                        client.publish([(meta, slot)])  # False while the chunk's master is down: not an error
                    finally:
                        client.release(slot)
                    seed += 1
                    outcomes.append("hit" if hit == len(PROMPT) else "miss")
                except BaseException as exc:  # noqa: BLE001 - every failure is reported by the assertion below
                    failures.append(exc)
                    return

        worker = threading.Thread(target=traffic)
        worker.start()
        time.sleep(1)
        cluster.kill_master(master_serving(cluster, keys[0]).port)
        cluster.wait_healthy()
        count_at_healthy = len(outcomes)
        assert wait_for(lambda: outcomes[count_at_healthy:].count("hit") >= 3 or failures, timeout_s=30), outcomes
        stop.set()
        worker.join(30)
        assert not failures, failures
        assert outcomes[count_at_healthy:].count("hit") >= 3
    finally:
        client.close()
        daemon.stop()


def test_writes_a_failover_lost_are_misses_then_registered_again_by_reconcile(tmp_path, private_redis_cluster):
    """The replica is stopped (SIGSTOP) while more than its socket buffers can hold is written to its master, then a
    prompt is published and persisted, and the master is killed: the replica is promoted without those writes. They
    miss; the node's restart registers its NVMe copies again."""
    cluster = private_redis_cluster
    daemon = on_index(tmp_path / "node", cluster.url, cluster.password).start()
    client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=cluster.password)
    try:
        first = PROMPT[:128]
        keys, _ = publish_prompt(client, first, seed=3)
        wait_persisted(client, keys)
        master = master_serving(cluster, keys[0])
        replica = replica_of(cluster, master)
        freeze_processes([replica.pid])
        try:
            fill_replication_stream(cluster, master)
            more, payloads = publish_prompt(client, PROMPT, seed=3)  # the same chain, longer: the same master
            wait_persisted(client, more)
            assert matched(client, PROMPT) == len(PROMPT)
            master.kill()  # not kill_master: it asks every node its role, the stopped replica too
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        cluster.wait_healthy()
        assert wait_for(lambda: matched(client, PROMPT) == len(first), timeout_s=20)  # the rest was lost
        daemon.stop()
        daemon.start()  # reconcile: what this node's NVMe tier holds is registered again
        assert wait_for(lambda: matched(client, PROMPT) == len(PROMPT), timeout_s=20)
        assert fetch_payloads(client, more[2:]) == payloads[2:]
    finally:
        client.close()
        daemon.stop()


def test_an_index_behind_sentinel_fails_over_to_the_replica(private_redis_sentinel):
    servers: RedisSentinelServers = private_redis_sentinel
    index = RedisIndex(servers.url, key_prefix="failover")
    try:
        keys = register_chain(index, PROMPT)
        query = prompt_query(make_spec().root(), ChunkGeometry(chunk_tokens=64), PROMPT)
        assert index.lookup(query).keys == keys
        old = servers.kill_primary()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if index.lookup(query).keys == keys:
                    break
            except IndexUnavailableError:
                pass  # what a caller takes as a miss, while the sentinels elect
            time.sleep(0.1)
        else:
            raise AssertionError("lookups never hit again after the failover")
        assert servers.wait_failover(old) != old
        assert register_chain(index, PROMPT[:64] + [7] * 64)[0] == keys[0]  # the new primary takes writes
    finally:
        index.flush()
        index.close()


def test_a_lookup_is_one_round_trip_and_a_first_chunk_break_one_more(redis_cluster, request):
    index = RedisIndex(redis_cluster.url, key_prefix="trips")
    geometry = ChunkGeometry(chunk_tokens=64)
    try:
        register_chain(index, PROMPT)
        cached = prompt_query(make_spec().root(), geometry, PROMPT[:320])
        broken = prompt_query(make_spec().root(), geometry, PROMPT[:40] + [9] * 300)  # differs at token 40
        index.lookup(cached, touch=False)  # loads the script on the master
        index.lookup(broken, touch=False)
        sent = request.getfixturevalue("sent_commands")  # from here on: the lookups above loaded the script
        assert index.lookup(cached, touch=False).full_tokens == 320
        assert len(sent) == 1
        assert index.lookup(broken, touch=False).matched_tokens == 40  # from the first chunk's probe bucket
        assert len(sent) == 3
    finally:
        index.flush()
        index.close()
