"""The Mooncake master is no single point of failure: two masters in high-availability mode (etcd elects the
leader, standbys replay its operation log), two real nodes found through etcd. The leader killed while a client
of node A publishes and fetches and a reader on node B reads A's DRAM copies across the network: no read returns
wrong data, node A's fetches find its NVMe copies meanwhile, the standby takes the pool over with the objects the
leader held, publishes and cross-node DRAM reads resume by themselves, and the old leader, started again, stands by."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.node.settings import EtcdMasters, load_settings
from prefixcache.cachestore.tiers.mooncake_servers import MooncakeMaster
from prefixcache.indexer.errors import ConfigError
from tests.daemon_harness import (
    Daemon,
    HaClusterServers,
    fetch_payloads,
    ha_cluster_servers,
    make_spec,
    publish_prompt,
    wait_for,
    wait_persisted,
)
from tests.etcd_server import MISSING

needs_etcd = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

#: Seconds from the leader's death until publishes and cross-node DRAM reads work again: the issue's 15 s, with a
#: margin for this machine's noise (an election takes about 10 s: Mooncake's 5 s etcd lease, then the new leader's
#: warm-up; 9.2-13.3 s over ten runs).
RESUMED_WITHIN_S = 15 + 10
CHUNK_TOKENS = 64
#: Room for one chunk's object in DRAM (64 tokens of 2 KiB, its header and tokens).
OBJECT_SLOT_BYTES = 256 << 10


def read_loop(url: str, lines: str, out: str, stop: str) -> None:
    """Node B's reader, in a process of its own (Mooncake's attached clients share per-process state, so a process
    attaches once, as each vLLM worker does): reads from DRAM alone, no promotion from NVMe, the objects named in
    ``lines`` (JSON lines of keys and the SHA-256 of each stored object): the first line's and the newest line's,
    every 100 ms, each pass written to ``out``: hits and wrong reads of each."""
    from prefixcache.cachestore.chunks.arena import ArenaFullError
    from prefixcache.cachestore.client.config import fetch_config
    from prefixcache.cachestore.tiers.dram import MooncakeTier

    config = fetch_config(url)
    dram = MooncakeTier(config.mooncake.shm_address, arena_bytes=64 << 20, object_prefix=config.key_prefix)

    def read(entry: dict) -> tuple[int, int]:
        keys = [bytes.fromhex(key) for key in entry["keys"]]
        try:
            slots = [dram.arena.alloc(OBJECT_SLOT_BYTES) for _ in keys]
        except ArenaFullError:  # slots of reads abandoned at their deadline are held for a minute
            return 0, 0
        try:
            sizes = dram.get_into(keys, slots, deadline_s=2.0)
            digests = [
                hashlib.sha256(slot[:size]).hexdigest() if size > 0 else None
                for slot, size in zip(slots, sizes, strict=True)
            ]
        finally:
            for slot in slots:
                dram.arena.free(slot)
        hits = sum(digest is not None for digest in digests)
        wrong = sum(digest not in (None, want) for digest, want in zip(digests, entry["shas"], strict=True))
        return hits, wrong

    with open(out, "a") as report:
        while not Path(stop).exists():
            entries = [json.loads(line) for line in Path(lines).read_text().splitlines()]
            started = time.time()
            first, newest = read(entries[0]), read(entries[-1])
            record = {"t": started, "first": first, "newest": [len(entries) - 1, *newest]}
            report.write(json.dumps(record) + "\n")
            report.flush()
            time.sleep(0.1)
    dram.close()


def test_the_master_setting_names_masters_in_high_availability_mode_through_etcd():
    ha = load_settings({"mooncake_master": "etcd://e0:2379;e1:2379,e2:2379/pool-1"}).mooncake_ha
    assert ha is not None and ha.endpoints == ("e0:2379", "e1:2379", "e2:2379") and ha.cluster_id == "pool-1"
    assert ha.address == "etcd://e0:2379;e1:2379;e2:2379"
    assert load_settings({"mooncake_master": "etcd://e0:2379"}).mooncake_ha == EtcdMasters(("e0:2379",))
    single = load_settings({"mooncake_master": "m:50051", "mooncake_metadata_url": "http://m:8080/metadata"})
    assert single.mooncake_ha is None
    for wrong, why in [
        ("etcd://", "etcd's endpoints"),
        ("etcd://e0/pool", "etcd's endpoints"),
        ("etcd://e0:2379/two words", "cluster id"),
        ("m", "host:port, or etcd://"),
    ]:
        with pytest.raises(ConfigError, match=why):
            load_settings({"mooncake_master": wrong})
    several = "http://m0:9003/metrics,http://m1:9003/metrics"
    with pytest.raises(ConfigError, match="several masters"):
        load_settings(
            {"mooncake_master": "m:1", "mooncake_metadata_url": "http://m:2/metadata", "mooncake_metrics_url": several}
        )
    with pytest.raises(ConfigError, match="not an http"):
        load_settings({"mooncake_master": "etcd://e0:2379", "mooncake_metrics_url": "m0:9003"})


def test_a_single_master_runs_as_ever_and_one_of_a_group_with_its_operation_log(tmp_path):
    single = MooncakeMaster(tmp_path, rpc_port=1, metadata_port=2, metrics_port=3)
    assert single.argv[1:] == [
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        "-http_metadata_server_port=2",
        "-rpc_address=127.0.0.1",
        "-rpc_port=1",
        "-metrics_host=127.0.0.1",
        "-metrics_port=3",
        "-default_kv_lease_ttl=2000",
        "-eviction_high_watermark_ratio=0.95",
        "-allow_evict_soft_pinned_objects=false",
        "-logtostderr",
    ]
    grouped = MooncakeMaster(
        tmp_path, rpc_port=1, metrics_port=3, etcd_endpoints=["e0:2379", "e1:2379"], cluster_id="p"
    )
    assert grouped.argv[1:6] == [
        "-enable_ha=true",
        "-ha_backend_type=etcd",
        "-ha_backend_connstring=e0:2379;e1:2379",
        "-cluster_id=p",
        "-enable_oplog=true",
    ]
    assert grouped.metadata_port is None and grouped.metadata_url == "etcd://e0:2379;e1:2379"
    assert not any("metadata_server" in arg for arg in grouped.argv)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[HaClusterServers, Daemon, Daemon]]:
    with ha_cluster_servers(tmp_path / "servers") as servers:
        a = Daemon.joining_ha(servers, tmp_path / "a", "node-a")
        b = Daemon.joining_ha(servers, tmp_path / "b", "node-b")
        try:
            yield servers, a.start(), b.start()
        finally:
            b.stop()
            a.stop()


def stored_digests(client: CacheClient, keys: list[bytes]) -> list[str]:
    """The SHA-256 of each object as DRAM holds it (read back by the client that stored it). A read that fails
    (a master's RPC timed out under the machine's load opens the tier's breaker, and it answers misses for a
    second) is tried again for a few seconds: every object must read back then."""
    slots = [client.slot(OBJECT_SLOT_BYTES) for _ in keys]
    try:
        deadline = time.monotonic() + 10
        sizes = client.dram.get_into(keys, slots)
        while not all(size > 0 for size in sizes):
            assert time.monotonic() < deadline, f"published objects did not read back from DRAM: {sizes}"
            time.sleep(0.2)
            sizes = client.dram.get_into(keys, slots)
        return [hashlib.sha256(slot[:size]).hexdigest() for slot, size in zip(slots, sizes, strict=True)]
    finally:
        for slot in slots:
            client.release(slot)


def master_health(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/health", timeout=10).json()["components"]["mooncake_master"]


@needs_etcd
def test_a_killed_leader_hands_the_pool_to_a_standby_with_its_objects(cluster, tmp_path):
    servers, a, b = cluster
    client = CacheClient.connect(a.url, make_spec(CHUNK_TOKENS), arena_bytes=64 << 20, redis_password=a.index_password)
    lines, out, stop = tmp_path / "keys.jsonl", tmp_path / "reads.jsonl", tmp_path / "stop"
    reader = None
    try:
        keys, payloads = publish_prompt(client, list(range(CHUNK_TOKENS * 8)), seed=1)
        wait_persisted(client, keys)  # node A's fetches can fall back on its NVMe while DRAM is away
        lines.write_text(json.dumps({"keys": [k.hex() for k in keys], "shas": stored_digests(client, keys)}) + "\n")
        health = master_health(a)
        assert health["ok"] and not health["degraded"] and "1 standing by" in health["detail"], health
        arguments = ", ".join(repr(str(arg)) for arg in (b.url, lines, out, stop))
        script = f"from tests.test_master_ha import read_loop; read_loop({arguments})"
        with open(tmp_path / "reader.log", "wb") as reader_log:
            reader = subprocess.Popen([sys.executable, "-c", script], stdout=reader_log, stderr=subprocess.STDOUT)

        def reads() -> list[dict]:
            return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []

        # node B reads node A's DRAM copies across the pool, its peers' endpoints found in etcd
        assert wait_for(lambda: any(r["first"][0] == len(keys) for r in reads()), 30), (
            tmp_path / "reader.log"
        ).read_text()[-3000:]

        leader = servers.leader()
        killed = time.time()
        leader.kill()
        wrong = published = 0
        misses: list[int] = []  # of each fetch of node A's chunks: DRAM away, its NVMe copies stand in
        published_at = None  # when the first publish after the kill stored every chunk
        while time.time() - killed < 40:
            stored: list[bool] = []
            new_keys, _ = publish_prompt(client, [published + 10_000] * CHUNK_TOKENS * 2, seed=published, stored=stored)
            published += 1
            if all(stored):
                published_at = published_at or time.time()
                entry = {"keys": [k.hex() for k in new_keys], "shas": stored_digests(client, new_keys)}
                with open(lines, "a") as f:
                    f.write(json.dumps(entry) + "\n")
            got = fetch_payloads(client, keys)
            wrong += sum(p is not None and p != want for p, want in zip(got, payloads, strict=True))
            misses.append(sum(p is None for p in got))
            resumed = [r for r in reads() if r["t"] > killed and r["first"][0] == len(keys) and r["newest"][0] > 0]
            if published_at and resumed and resumed[0]["newest"][1] == len(new_keys):
                break
            time.sleep(0.2)
        assert wrong == 0
        assert misses[-1] == 0, misses
        after = [r for r in reads() if r["t"] > killed]
        assert not any(r["first"][1] or r["newest"][2] for r in reads()), "node B read wrong bytes"
        assert published_at is not None and published_at - killed < RESUMED_WITHIN_S, "publishes did not resume"
        back = next(r["t"] for r in after if r["first"][0] == len(keys))
        # the objects node A put before the kill, read from DRAM alone: the new leader knew them from the oplog
        assert back - killed < RESUMED_WITHIN_S, f"node B's DRAM reads came back {back - killed:.1f}s after the kill"
        print(
            f"leader killed: publishes resumed after {published_at - killed:.1f}s, node B's DRAM reads of the "
            f"chunks put before after {back - killed:.1f}s; node A's fetches missed {sum(misses)} of "
            f"{len(keys) * len(misses)} chunks meanwhile"
        )

        new_leader = servers.leader()
        assert new_leader is not leader
        health = master_health(a)
        assert health["ok"] and health["degraded"] and f"{new_leader.address}" in health["detail"], health
        # demotion reads the node's DRAM use from whichever master leads; the failover is counted
        stats = httpx.get(a.url + "/v1/stats", headers=a.headers).json()
        assert stats["dram"]["bytes_used"] > 0
        assert stats["master_failovers"] == 1
        assert "prefixcache_master_failovers_total 1.0" in httpx.get(a.url + "/metrics", headers=a.headers).text
        leader.start()  # the old leader, back: it stands by
        assert wait_for(lambda: servers.role(leader) == "standby", 15), servers.role(leader)
        assert servers.leader() is new_leader
        assert wait_for(lambda: "1 standing by" in master_health(b)["detail"], 10), master_health(b)
    finally:
        stop.touch()
        if reader is not None:
            reader.wait(30)
        client.close()
