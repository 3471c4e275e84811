"""Forged chunks against the real stack: copies replaced by a self-consistent header (the right key, tokens and
header checksum) over another payload, signed with a key that is not the cluster's. Each is a miss, counted as a
MAC failure, and dropped, by the client that fetches it and by the daemon's services that read it."""

from __future__ import annotations

import stat

import httpx

from prefixcache.indexer.index import Location
from tests.daemon_harness import (
    Daemon,
    connect,
    corrupt_chunks,
    damage_dram_copies,
    fetch_payloads,
    forge_dram_copy,
    forge_nvme_copy,
    publish_prompt,
    wait_for,
    wait_persisted,
)

DRAM = Location("dram", "node-a")


def test_the_chunk_key_is_generated_private_and_named_by_path_never_by_value(daemon):
    config = httpx.get(daemon.url + "/v1/config")
    key_file = daemon.chunk_key_file
    assert config.json()["secret_files"]["chunk_key"] == str(key_file)
    assert key_file.read_text().strip() not in config.text
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_a_forged_dram_copy_is_refused_counted_and_dropped_and_nvme_serves_the_chunk(daemon, client):
    keys, payloads = publish_prompt(client, list(range(128)), seed=3)
    wait_persisted(client, keys)
    forged_before = corrupt_chunks(daemon, "mac")
    fake = forge_dram_copy(client.dram, keys[0])
    assert fetch_payloads(client, keys) == payloads  # the genuine NVMe copy, never the forgery
    assert fake[-64:] != payloads[0][-64:]
    assert client.counters.mac_failures == 1 and client.counters.read_from_disk == 1
    assert client.dram.contains(keys[:1]) == [False]  # the forgery is deleted
    client.recorder.flush()
    assert corrupt_chunks(daemon, "mac") == forged_before + 1


def test_a_forged_nvme_copy_is_a_miss_and_the_daemon_deletes_and_counts_it(daemon, client):
    """NVMe alone holds the chunk (after a restart DRAM starts empty): the fetch misses, and the daemon, asked to
    promote the chunk, finds the forgery, deletes it and drops the entry."""
    keys, payloads = publish_prompt(client, list(range(64)), seed=5)
    wait_persisted(client, keys)
    forge_nvme_copy(daemon, keys[0])
    client.close()
    daemon.stop()
    daemon.start()
    after = connect(daemon)
    try:
        assert after.index.get(keys)[0] is not None  # re-indexed from its (consistent) header at start
        assert fetch_payloads(after, keys) == [None]
        assert wait_for(lambda: after.index.get(keys) == [None]), "the forged copy's entry stayed"
        assert corrupt_chunks(daemon, "mac") == 1  # the daemon's services start counting anew
    finally:
        after.close()


def test_the_write_behind_never_persists_a_forged_copy(tmp_path):
    """A copy forged in DRAM before the write-behind copies it to NVMe: refused, dropped, counted, not persisted."""
    daemon = Daemon(tmp_path / "data", env={"PREFIXCACHE_WRITE_BEHIND_HOLD_S": "3"}).start()
    client = connect(daemon)
    try:
        keys, _ = publish_prompt(client, list(range(128)), seed=11)
        damage_dram_copies(daemon, keys[:1], damage=forge_dram_copy)
        wait_persisted(client, keys[1:])
        assert wait_for(lambda: client.index.get(keys[:1]) == [None]), "the forged copy stayed indexed"
        stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()
        assert stats["write_behind"]["corrupt"] == 1 and stats["corrupt_by_reason"]["mac"] == 1
        assert fetch_payloads(client, keys[:1]) == [None]
    finally:
        client.close()
        daemon.stop()


def test_metrics_count_mac_failures_by_reason(daemon, client):
    keys, _ = publish_prompt(client, list(range(64)), seed=13)
    wait_persisted(client, keys)
    forge_dram_copy(client.dram, keys[0])
    fetch_payloads(client, keys)
    client.recorder.flush()
    metrics = httpx.get(daemon.url + "/metrics", headers=daemon.headers).text
    assert 'prefixcache_corrupt_chunks_total{reason="mac"} 1.0' in metrics
    assert 'prefixcache_corrupt_chunks_total{reason="damaged"} 0.0' in metrics
