"""Two real nodes of one cluster: two ``prefixcache serve`` processes, each with its own DRAM segment and
NVMe tier, sharing the first one's redis-server and mooncake_master, as a multi-node deployment runs."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.chunks.codec import payload_offset
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.scattered_reads import Landed
from prefixcache.cachestore.tiers.dram import first_part_rows, split_pieces
from prefixcache.indexer.index import Location
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.redis_clients import redis_client
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_for, wait_persisted

ON_B = Location("nvme", "node-b")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    a = Daemon(tmp_path / "a").start()
    b = a.joined_by(tmp_path / "b", "node-b")
    try:
        yield a, b.start()
    finally:
        b.stop()
        a.stop()


def connect(daemon: Daemon) -> CacheClient:
    return CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=daemon.index_password)


def persisted_on_b(b: Daemon, tokens: list[int], seed: int) -> tuple[list[bytes], list[bytes]]:
    """Publish a prompt through node B and wait until B's NVMe tier holds it; returns keys and payloads."""
    client = connect(b)
    try:
        keys, payloads = publish_prompt(client, tokens, seed=seed)
        wait_persisted(client, keys)
        assert all(e is not None and ON_B in e.locations for e in client.index.get(keys))
    finally:
        client.close()
    return keys, payloads


def evict(daemon: Daemon, keys: list[bytes], force: bool = False) -> dict:
    """Evict ``keys`` through ``daemon``'s admin API; its answer."""
    body = {"keys": [k.hex() for k in keys], "force": force}
    answer = httpx.post(daemon.url + "/v1/evict", json=body, timeout=30, headers=daemon.headers)
    return answer.raise_for_status().json()


def waits_run_out(daemon: Daemon) -> int:
    """How often ``daemon`` waited the whole ``ORDER_WAIT_S`` for a node's confirmation, read from its log:
    a count that load on the machine cannot change, as it changes the time an evict takes."""
    return daemon.log_path.read_text(errors="replace").count("did not confirm an eviction within")


def stats(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()


def nvme_chunks(daemon: Daemon) -> int:
    return stats(daemon)["nvme"]["chunks"]


def test_a_node_reads_another_nodes_dram_copies_into_slots_and_straight_into_its_shared_memory(cluster):
    """The connector's two load paths, across nodes: Mooncake moves the bytes between the segments."""
    a, b = cluster
    keys, payloads = persisted_on_b(b, list(range(64 * 4)), seed=5)
    reader = connect(a)
    try:
        assert fetch_payloads(reader, keys) == payloads
        pages = reader.shared_memory(len(b"".join(payloads)))
        heads = [reader.slot(payload_offset(64)) for _ in keys]
        ends = list(itertools.accumulate(len(p) for p in payloads))
        parts = [pages[end - len(p) : end] for p, end in zip(payloads, ends, strict=True)]
        # each chunk's DRAM copy in its two parts (cachestore/tiers/dram.py): payload rows are tokens here, 64 a chunk
        cut = [
            split_pieces([head, part], payload_offset(64) + first_part_rows(64) * (len(part) // 64))
            for head, part in zip(heads, parts, strict=True)
        ]
        landed = [Landed(key, c[0][0], c[0][0], c[0][1:], c[1]) for key, c in zip(keys, cut, strict=True)]
        with reader.read_in_place(landed, time.perf_counter()) as read:
            assert read.fetch([True] * 4) == [True] * 4
            assert read.verify() == [True] * 4
        assert [bytes(part) for part in parts] == payloads
        assert reader.counters.read_from_disk == reader.counters.promoted == 0
    finally:
        reader.close()


def test_a_node_reads_chunks_only_another_nodes_nvme_holds_through_that_nodes_daemon(cluster):
    a, b = cluster
    keys, payloads = persisted_on_b(b, list(range(64 * 5)), seed=1)
    b.stop()
    b.start()  # B's segment owner starts empty: its chunks are on its NVMe alone
    reader = connect(a)
    try:
        assert all(e.locations == {ON_B} for e in reader.index.get(keys))
        assert fetch_payloads(reader, keys) == payloads
        assert reader.counters.promoted == len(keys) and reader.counters.read_from_disk == 0
    finally:
        reader.close()


def test_a_stopped_node_is_asked_nothing_and_read_again_once_it_is_back(cluster):
    """A node that stopped says so (indexer/peers.py): lookups skip the chunks only it holds and no promotion is
    asked of it, so they are recomputed at once; its return is seen without restarting anyone."""
    a, b = cluster
    tokens = list(range(64 * 2))
    keys, payloads = persisted_on_b(b, tokens, seed=11)
    b.stop()
    reader = connect(a)
    index_redis, queue = redis_client(reader.index.url), reader.index.keyspace.promotion_queue("node-b")
    try:
        assert reader.peers.down == {"node-b"}
        assert reader.lookup(prompt_query(reader.spec.root(), reader.geometry, tokens)).keys == []
        assert fetch_payloads(reader, keys) == [None, None]
        assert index_redis.llen(queue) == 0  # nothing was asked of B
        peers = httpx.get(a.url + "/v1/health").json()["components"]["peers"]
        assert peers["ok"] and not peers["degraded"] and "stopped: node-b" in peers["detail"]
        assert stats(a)["peers"] == {"node-b": {"down": True, "stopped": True, "suspect_marks": 0}}
        assert 'prefixcache_peer_down{peer="node-b"} 0.0' in httpx.get(a.url + "/metrics", headers=a.headers).text
        b.start()
        assert wait_for(lambda: reader.peers.down == frozenset(), timeout_s=10)
        assert reader.lookup(prompt_query(reader.spec.root(), reader.geometry, tokens)).keys == keys
        # promoted by B's daemon, once this node's segment owner reads B's new segment (its endpoints, within 2 s)
        assert wait_for(lambda: fetch_payloads(reader, keys) == payloads, timeout_s=15)
    finally:
        reader.close()
        index_redis.close()


def test_an_eviction_on_one_node_deletes_the_copies_another_nodes_nvme_holds(cluster):
    a, b = cluster
    keys, _ = persisted_on_b(b, list(range(64 * 4)), seed=2)
    kept, kept_payloads = persisted_on_b(b, list(range(1000, 1000 + 64 * 2)), seed=3)
    result = evict(a, keys)
    assert (result["chunks"], result["kept_elsewhere"], result["pending_nodes"]) == (len(keys), 0, [])
    reader = connect(a)
    try:
        assert reader.index.get(keys) == [None] * len(keys)
        assert nvme_chunks(b) == len(kept)
        assert fetch_payloads(reader, keys) == [None] * len(keys)
        assert fetch_payloads(reader, kept) == kept_payloads  # the rest of B's tier is untouched
    finally:
        reader.close()
    assert stats(b)["evictions"]["requested_chunks"] == len(keys)


def test_a_node_that_was_down_takes_its_eviction_order_when_it_returns(cluster):
    """The order waits in Redis: nothing comes back from B's disk, though B reconciles its tier at start."""
    a, b = cluster
    keys, _ = persisted_on_b(b, list(range(64 * 3)), seed=4)
    b.stop()
    result = evict(a, keys)
    assert (result["chunks"], result["kept_elsewhere"], result["pending_nodes"]) == (0, len(keys), ["node-b"])
    assert waits_run_out(a) == 1
    reader = connect(a)
    try:
        assert all(e.locations == {ON_B} for e in reader.index.get(keys)), "DRAM copies must go at once"
        again = evict(a, keys)
        assert again["pending_nodes"] == ["node-b"]
        assert waits_run_out(a) == 1, "a node that did not answer is waited for again"
        cli = [sys.executable, "-m", "prefixcache.cachestore", "evict", "--url", a.url, *(k.hex() for k in keys)]
        told = subprocess.run(cli, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert "kept on other nodes: 3" in told.stdout and "not confirmed yet by node-b" in told.stdout, told.stdout
        b.start()
        assert wait_for(lambda: reader.index.get(keys) == [None] * len(keys), timeout_s=30), "B never took its order"
        assert nvme_chunks(b) == 0
        assert stats(b)["queues"]["eviction_orders"] == 0
    finally:
        reader.close()


def test_a_returning_node_keeps_chunks_pinned_after_its_order_and_drops_those_a_forced_eviction_took(cluster):
    """Pins outrank an order that waited in Redis, unless the eviction was forced (it unpins its chunks)."""
    a, b = cluster
    keys, _ = persisted_on_b(b, list(range(64 * 4)), seed=6)
    pinned_later, forced = keys[:2], keys[2:]
    b.stop()
    assert evict(a, pinned_later)["pending_nodes"] == ["node-b"]
    pins = {"keys": [k.hex() for k in pinned_later + forced]}
    httpx.post(a.url + "/v1/pin", json=pins, headers=a.headers).raise_for_status()
    result = evict(a, forced, force=True)
    assert (result["kept_elsewhere"], result["pending_nodes"]) == (len(forced), ["node-b"])
    with closing(connect(a)) as reader:
        now = reader.index.clock_s()
        assert not any(e.pinned(now) for e in reader.index.get(forced)), "a forced eviction takes the pins with it"
        b.start()
        assert wait_for(lambda: reader.index.get(forced) == [None] * len(forced), timeout_s=30)
        assert wait_for(lambda: stats(b)["queues"]["eviction_orders"] == 0)
        kept, now = reader.index.get(pinned_later), reader.index.clock_s()
    assert all(e is not None and e.pinned(now) and e.locations == {ON_B} for e in kept)
    assert nvme_chunks(b) == len(pinned_later)
