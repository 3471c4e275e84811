"""Nodes with an object tier (``--object-store-url``): chunks persisted to NVMe are copied to the shared bucket, a
node lost with its disk loses none of them, and a bucket that stops never fails a request.

Real daemons, a real S3 server (SeaweedFS, tests/s3_server.py); the nodes of a cluster share the first one's
Redis and Mooncake master, as in tests/test_two_nodes.py.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.indexer.index import Location
from prefixcache.indexer.keys import prompt_query
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_for, wait_persisted
from tests.s3_server import SeaweedS3


@pytest.fixture
def s3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SeaweedS3]:
    """An S3 server, and the environment every daemon started in the test reads its bucket and credentials from."""
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    settings = {
        "PREFIXCACHE_OBJECT_STORE_URL": "s3://prefixcache/cluster",
        "PREFIXCACHE_OBJECT_STORE_ENDPOINT": server.endpoint,
        "PREFIXCACHE_OBJECT_STORE_REGION": "us-east-1",
        "PREFIXCACHE_OBJECT_STORE_PATH_STYLE": "true",
        **server.credentials(),
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()


def connect(daemon: Daemon) -> CacheClient:
    return CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=daemon.index_password)


def in_bucket(client: CacheClient, keys: list[bytes], node: str) -> bool:
    return all(e is not None and Location("object", node) in e.locations for e in client.index.get(keys))


def object_stats(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()["object_store"]


def object_health(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/health").json()["components"]["object"]


def test_a_node_lost_with_its_disk_loses_nothing_a_fresh_node_loads_it_from_the_bucket(s3, tmp_path):
    a = Daemon(tmp_path / "a").start()
    b = a.joined_by(tmp_path / "b", "node-b").start()
    c = None
    try:
        writer = connect(b)
        tokens = list(range(64 * 4))
        keys, payloads = publish_prompt(writer, tokens, seed=5)
        wait_persisted(writer, keys)
        assert wait_for(lambda: in_bucket(writer, keys, "node-b"), timeout_s=15)
        assert wait_for(lambda: object_stats(b)["backlog"] == 0, timeout_s=5)
        copies = object_stats(b)
        assert (copies["copied"], copies["copy_failures"]) == (len(keys), {})
        # A's bucket reconciler may locate an object between B's put and B's indexing of it: a second location
        assert len(keys) <= copies["chunks"] <= 2 * len(keys)
        writer.close()
        b.kill()
        shutil.rmtree(tmp_path / "b")  # the machine is gone: its DRAM, its disk
        c = a.joined_by(tmp_path / "c", "node-c").start()  # a new node, its disk empty
        reader = connect(c)
        try:
            assert wait_for(lambda: "node-b" in reader.peers.down, timeout_s=10)
            # the master drops the lost node's segment, and its DRAM copies with it, once its client lease expires
            assert wait_for(lambda: not any(reader.dram.contains(keys)), timeout_s=60)
            assert reader.lookup(prompt_query(reader.spec.root(), reader.geometry, tokens)).keys == keys
            assert fetch_payloads(reader, keys) == payloads  # object -> C's DRAM -> the client, verified
            assert reader.counters.promoted == len(keys)
            assert object_health(c) == {"ok": True, "degraded": False, "detail": "s3://prefixcache/cluster"}
            assert httpx.get(c.url + "/v1/stats", headers=c.headers).json()["corrupt_chunks"] == 0
            # every node sees the bucket's locations (B's, and A's where A located one first); C copied none
            seen = object_stats(c)
            assert len(keys) <= seen["chunks"] <= 2 * len(keys)
            assert (seen["copied"], seen["rejected"], seen["reachable"]) == (0, 0, True)
        finally:
            reader.close()
    finally:
        for daemon in (c, b, a):
            if daemon is not None:
                daemon.stop()


def test_a_stopped_bucket_fails_no_request_degrades_health_and_copies_resume_after(s3, tmp_path):
    a = Daemon(tmp_path / "a").start()
    client = connect(a)
    try:
        s3.stop()
        keys, payloads = publish_prompt(client, list(range(64 * 2)), seed=9)
        wait_persisted(client, keys)  # NVMe takes them: nothing acknowledged waits for the bucket
        assert fetch_payloads(client, keys) == payloads
        assert wait_for(lambda: object_health(a)["degraded"], timeout_s=15)
        assert not in_bucket(client, keys, "node-a")
        assert object_stats(a)["copy_failures"].get("bucket", 0) > 0
        assert object_stats(a)["backlog"] > 0  # kept, to copy once the bucket answers
        s3.start()
        assert wait_for(lambda: in_bucket(client, keys, "node-a"), timeout_s=30)
        assert wait_for(lambda: not object_health(a)["degraded"], timeout_s=15)
        assert wait_for(lambda: object_stats(a)["backlog"] == 0, timeout_s=5)
        assert object_stats(a)["copied"] == len(keys)
    finally:
        client.close()
        a.stop()


def test_an_index_lost_with_the_disk_is_registered_again_from_the_bucket(s3, tmp_path):
    a = Daemon(tmp_path / "a")
    a.start()
    try:
        client = connect(a)
        tokens = list(range(64 * 3))
        keys, payloads = publish_prompt(client, tokens, seed=13)
        wait_persisted(client, keys)
        assert wait_for(lambda: in_bucket(client, keys, "node-a"), timeout_s=15)
        client.close()
        a.stop()
        for lost in ("redis", "nvme"):  # the index and the disk; the cluster's secrets stay
            shutil.rmtree(tmp_path / "a" / lost)
        a.start()
        reader = connect(a)
        try:
            assert wait_for(lambda: in_bucket(reader, keys, "node-a"), timeout_s=30)  # the bucket reconciler's pass
            assert reader.lookup(prompt_query(reader.spec.root(), reader.geometry, tokens)).keys == keys
            assert fetch_payloads(reader, keys) == payloads
        finally:
            reader.close()
    finally:
        a.stop()
