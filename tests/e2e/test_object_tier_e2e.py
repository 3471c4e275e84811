"""A node lost with its disk loses nothing it persisted: vLLM on a fresh node loads it all from the shared bucket.

Node A (a daemon with the object tier on, a real S3 server: SeaweedFS, tests/s3_server.py) serves a vLLM engine
that publishes the prompts; A's daemon copies every persisted chunk to the bucket. A's daemon is then killed (-9)
and its data dir deleted: its DRAM, its NVMe and its copy of the cluster's secrets are gone. Node C, a new daemon
with an empty disk on the same index, master, bucket and chunk key, serves a fresh engine (vLLM's own prefix cache
off) on the same prompts: every chunk of every prompt is a hit loaded from the bucket (object -> C's DRAM ->
vLLM, verified), and the answers equal A's, which computed the prompts whole. Two engines, A's and C's; the index
and master live outside the nodes (``cluster_servers``), as a deployment whose nodes come and go runs them.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.tiers.object_store import ObjectStoreAddress
from tests.daemon_harness import ClusterServers, Daemon, cluster_servers, connector_config, make_spec, wait_for
from tests.e2e.compare import same_greedy_output
from tests.e2e.tinymodel import random_prompt
from tests.s3_server import SeaweedS3

if TYPE_CHECKING:
    from obstore.store import S3Store

pytestmark = pytest.mark.e2e

BUCKET_URL = "s3://prefixcache/e2e"
PROMPTS = [random_prompt(seed=630 + i, length=1100) for i in range(2)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """An S3 server, and the environment the daemons started in this module read their bucket from."""
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    import obstore

    obstore.put(bucket(server), "created", b"")  # the bucket exists before any node writes, as a deployment's does
    settings = {
        "PREFIXCACHE_OBJECT_STORE_URL": BUCKET_URL,
        "PREFIXCACHE_OBJECT_STORE_ENDPOINT": server.endpoint,
        "PREFIXCACHE_OBJECT_STORE_REGION": "us-east-1",
        "PREFIXCACHE_OBJECT_STORE_PATH_STYLE": "true",
        **server.credentials(),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, value in settings.items():
            patch.setenv(name, value)
        yield server
    server.stop()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    with cluster_servers(tmp_path_factory.mktemp("cluster"), "127.0.0.1") as running:
        yield running


def bucket(s3: SeaweedS3) -> S3Store:
    """A client of the bucket with the S3 server's own identity (the test's view, not a node's)."""
    from obstore.store import S3Store

    return S3Store(
        ObjectStoreAddress.parse(BUCKET_URL).bucket,
        endpoint=s3.endpoint,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
        access_key_id=s3.access_key,
        secret_access_key=s3.secret_key,
    )


def chunks_in_bucket(s3: SeaweedS3) -> list[bytes]:
    """The chunk keys the bucket holds."""
    import obstore

    address = ObjectStoreAddress.parse(BUCKET_URL)
    names = [meta["path"] for page in obstore.list(bucket(s3), address.prefix) for meta in page]
    return [key for key in map(address.key_of, names) if key is not None]


def connect(daemon: Daemon, servers: ClusterServers) -> CacheClient:
    return CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=servers.redis_password)


@pytest.fixture(scope="module")
def lost_then_fresh(run_vllm, tiny_model, s3, servers, tmp_path_factory) -> dict:
    """A publishes through node A; A is lost with its disk; C runs the same prompts through a fresh node C."""
    started = time.monotonic()
    root = tmp_path_factory.mktemp("nodes")
    a = Daemon.joining(servers, root / "a", "node-a", dram="512MiB", nvme="1GiB").start()
    try:
        spec = {"model": str(tiny_model), "prompts": PROMPTS, "max_tokens": 16}
        first = run_vllm({**spec, "kv_transfer_config": connector_config(a, redis_password=servers.redis_password)})
        published = first["metrics"]["vllm:prefixcache_published_chunks"]
        assert wait_for(lambda: len(chunks_in_bucket(s3)) == published, timeout_s=60), "A's chunks never reached S3"
    finally:
        a.kill()
    shutil.rmtree(root / "a")  # the machine is gone: its DRAM, its disk, its secrets
    keys = chunks_in_bucket(s3)
    c = Daemon.joining(servers, root / "c", "node-c", dram="512MiB", nvme="1GiB").start()
    try:
        probe = connect(c, servers)
        try:
            assert wait_for(lambda: "node-a" in probe.peers.down, timeout_s=30)
            # the master drops A's segment, and its DRAM copies with it, once A's client lease expires
            assert wait_for(lambda: not any(probe.dram.contains(keys)), timeout_s=60)
        finally:
            probe.close()
        fresh = run_vllm(
            {
                **spec,
                "prefix_caching": False,
                "kv_transfer_config": connector_config(c, redis_password=servers.redis_password),
            }
        )
        stats = httpx.get(c.url + "/v1/stats", headers=c.headers).json()
    finally:
        c.stop()
    return {
        "first": first,
        "fresh": fresh,
        "published": published,
        "in_bucket": len(keys),
        "stats": stats,
        "seconds": time.monotonic() - started,
    }


def test_a_fresh_node_loads_every_chunk_of_a_lost_node_from_the_bucket_and_answers_the_same(lost_then_fresh):
    first, fresh = lost_then_fresh["first"], lost_then_fresh["fresh"]
    print(
        f"object tier e2e: {lost_then_fresh['published']} chunks published, {lost_then_fresh['in_bucket']} in the "
        f"bucket, {fresh['metrics'].get('vllm:prefixcache_loaded_chunks', 0)} loaded on the fresh node, "
        f"{lost_then_fresh['seconds']:.0f} s"
    )
    assert [r["num_cached_tokens"] for r in first["outputs"]] == [0] * len(PROMPTS)
    assert lost_then_fresh["in_bucket"] == lost_then_fresh["published"] > 0
    # every token but the one vLLM must compute came from the bucket, through C
    assert [r["num_cached_tokens"] for r in fresh["outputs"]] == [len(p) - 1 for p in PROMPTS]
    assert fresh["metrics"]["vllm:prefixcache_loaded_chunks"] == lost_then_fresh["published"]
    assert fresh["metrics"].get("vllm:prefixcache_load_failed_blocks", 0) == 0
    assert lost_then_fresh["stats"]["corrupt_chunks"] == 0
    bucket_stats = lost_then_fresh["stats"]["object_store"]
    assert bucket_stats["chunks"] == lost_then_fresh["published"]  # C's view of the index: all of A's, in the bucket
    assert bucket_stats["rejected"] == bucket_stats["late_reads"] == 0
    for computed, loaded in zip(first["outputs"], fresh["outputs"], strict=True):
        ok, reason = same_greedy_output(computed, loaded)
        assert ok, reason
