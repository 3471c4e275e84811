"""The node daemon and the client library against the real stack: redis-server, mooncake_master,
a segment owner and RocksDB files, all started by a real ``prefixcache serve`` process."""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path

import httpx
import pytest
import redis

from prefixcache.cachestore.chunks.codec import payload_offset, read_meta
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.config import fetch_config
from prefixcache.cachestore.client.scattered_reads import Landed, ScatteredRead
from prefixcache.cachestore.services.write_behind import hold_left_s
from prefixcache.cachestore.tiers.dram import first_part_rows, split_pieces
from prefixcache.cachestore.tiers.tier import Removal
from prefixcache.indexer.index import Location
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.leases import Leases
from tests.daemon_harness import (
    Daemon,
    connect,
    damage_dram_copy,
    fetch_payloads,
    make_spec,
    publish_prompt,
    wait_for,
    wait_persisted,
)

NVME = Location("nvme", "node-a")
DRAM = Location("dram", "node-a")


def test_publish_lookup_fetch_round_trip(client):
    tokens = list(range(64 * 3 + 20))
    keys, payloads = publish_prompt(client, tokens)
    match = client.lookup(prompt_query(client.spec.root(), client.geometry, tokens))
    assert match.keys == keys[:3] and match.partial.key == keys[3] and match.matched_tokens == len(tokens)
    assert fetch_payloads(client, keys) == payloads
    assert client.counters.fetched == 4 and client.counters.missing == 0


def test_every_published_chunk_is_persisted_within_a_bounded_delay(daemon, client):
    keys, _ = publish_prompt(client, list(range(64 * 10)))
    assert wait_persisted(client, keys) < 5
    assert all(e.locations == {DRAM, NVME} for e in client.index.get(keys))
    stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()
    assert stats["write_behind"]["persisted"] == 10 and stats["nvme"]["chunks"] == 10
    # held back write_behind_hold_s (0.25 s by default) after the publish, then copied
    assert 0.25 <= stats["write_behind"]["delay_p50_s"] <= stats["write_behind"]["delay_max_s"] < 5


@pytest.mark.parametrize(
    ("newest_created_s", "now_s", "left_s"),
    [
        (100.0, 100.0, 0.25),  # just published: the whole hold
        (100.0, 100.1, 0.15),
        (100.0, 100.3, 0.0),  # a backlog: copied at once
        (100.0, 99.0, 0.25),  # a publisher's clock ahead of this node's: never more than the hold
    ],
)
def test_the_write_behind_holds_a_fresh_chunk_back_at_most_its_hold(newest_created_s, now_s, left_s):
    assert hold_left_s(newest_created_s, now_s, 0.25) == pytest.approx(left_s)


def test_kill_9_and_restart_keeps_persisted_chunks(daemon, client):
    tokens = list(range(64 * 4))
    keys, payloads = publish_prompt(client, tokens)
    wait_persisted(client, keys)
    client.close()
    daemon.kill()
    daemon.start()
    restarted = connect(daemon)
    try:
        entries = restarted.index.get(keys)
        assert all(e.locations == {NVME} for e in entries)  # DRAM started empty: its locations were dropped
        assert restarted.lookup(prompt_query(restarted.spec.root(), restarted.geometry, tokens)).keys == keys
        assert fetch_payloads(restarted, keys, store_disk_reads=True) == payloads
        assert restarted.counters.read_from_disk == 4  # this node's NVMe, read directly
        assert restarted.counters.stored_after_disk_read == 4
        assert all(e.locations == {DRAM, NVME} for e in restarted.index.get(keys)), "not stored back into DRAM"
    finally:
        restarted.close()


def fetch_in_groups(
    client: CacheClient, keys: list[bytes], group: int, store_disk_reads: bool = False
) -> list[bytes | None]:
    """Fetch as the connector does: a few chunks per call, each call naming the chunks still to come, and
    (``store_disk_reads``) the chunks read from NVMe stored into DRAM once all are loaded."""
    slots = [client.slot(4 << 20) for _ in keys]
    try:
        with client.load() as load:
            views, read_from_disk = [], []
            for start in range(0, len(keys), group):
                end = start + group
                fetched = load.fetch(
                    keys[start:end], slots[start:end], upcoming=list(zip(keys[end:], slots[end:], strict=True))
                )
                views += fetched.payloads
                read_from_disk += fetched.from_disk
        payloads = [bytes(v) if v is not None else None for v in views]
        if store_disk_reads:
            client.store_disk_reads(read_from_disk)
        return payloads
    finally:
        for slot in slots:
            client.release(slot)


def restart_with_nvme_only(daemon: Daemon, client: CacheClient, tokens: list[int], seed: int):
    keys, payloads = publish_prompt(client, tokens, seed=seed)
    wait_persisted(client, keys)
    client.close()
    daemon.stop()
    daemon.start()
    return keys, payloads


def test_this_nodes_nvme_chunks_are_read_straight_from_disk_then_stored_into_dram(daemon, client):
    keys, payloads = restart_with_nvme_only(daemon, client, list(range(64 * 6)), seed=5)
    reader = connect(daemon)
    try:
        assert fetch_in_groups(reader, keys, 2) == payloads
        assert reader.counters.read_from_disk == 6 and reader.counters.promoted == 0 and reader.counters.missing == 0
        assert all(e.locations == {NVME} for e in reader.index.get(keys)), "a fetch stored into DRAM by itself"
        assert fetch_in_groups(reader, keys, 2, store_disk_reads=True) == payloads
        assert reader.counters.stored_after_disk_read == 6
        assert all(e.locations == {DRAM, NVME} for e in reader.index.get(keys)), "not stored into DRAM"
    finally:
        reader.close()
    again = connect(daemon)
    try:
        assert fetch_in_groups(again, keys, 2) == payloads and again.counters.read_from_disk == 0
    finally:
        again.close()


def test_the_first_nvme_miss_reads_every_upcoming_chunk_into_its_slot_ahead(daemon, client):
    keys, payloads = restart_with_nvme_only(daemon, client, list(range(64 * 6)), seed=7)
    reader = connect(daemon)
    slots = [reader.slot(4 << 20) for _ in keys]
    try:
        with reader.load() as load:  # the load stops after its first fetch: closing it waits for the reads ahead
            first = load.fetch(keys[:2], slots[:2], upcoming=list(zip(keys[2:], slots[2:], strict=True))).payloads
        assert [bytes(v) for v in first] == payloads[:2]
        assert [read_meta(slot).key for slot in slots[2:]] == keys[2:], "upcoming chunks were not read ahead"
        for slot in slots:
            reader.release(slot)
        assert fetch_in_groups(reader, keys[2:], 2) == payloads[2:]  # nothing stale left behind
        assert reader.counters.read_from_disk == 6 and reader.counters.missing == 0
    finally:
        reader.close()


def test_dram_copies_gone_without_the_index_hearing_are_all_read_ahead_at_the_first_miss(daemon, client):
    """The master can evict a DRAM copy unannounced (its own eviction at 95 %): the index then still names
    DRAM for the upcoming chunks too, and they must not be read from disk one fetch after another."""
    keys, payloads = publish_prompt(client, list(range(64 * 6)), seed=9)
    wait_persisted(client, keys)
    assert client.dram.delete(keys) == [Removal.REMOVED] * 6
    assert all(DRAM in e.locations for e in client.index.get(keys)), "the premise: the index still names DRAM"
    slots = [client.slot(4 << 20) for _ in keys]
    try:
        with client.load() as load:  # the load stops here, as in the test above
            first = load.fetch(keys[:2], slots[:2], upcoming=list(zip(keys[2:], slots[2:], strict=True))).payloads
        assert [bytes(v) for v in first] == payloads[:2]
        assert [read_meta(slot).key for slot in slots[2:]] == keys[2:], "upcoming chunks were not read ahead"
        assert client.counters.read_from_disk == 2
    finally:
        for slot in slots:
            client.release(slot)


def test_another_nodes_nvme_chunks_are_promoted_in_one_streamed_request(daemon, client):
    """A client elsewhere cannot read the pack files: the holder promotes them, upcoming ones included."""
    keys, payloads = restart_with_nvme_only(daemon, client, list(range(64 * 6)), seed=6)
    config = fetch_config(daemon.url).model_copy(update={"node": "node-elsewhere"})
    remote = CacheClient(config, make_spec(), arena_bytes=64 << 20)
    try:
        slots = [remote.slot(4 << 20) for _ in keys]
        with remote.load() as load:
            first = load.fetch(keys[:2], slots[:2], upcoming=list(zip(keys[2:], slots[2:], strict=True))).payloads
            assert [bytes(v) for v in first] == payloads[:2]
            # the rest arrives without being asked for again
            promoted = wait_for(lambda: all(DRAM in e.locations for e in remote.index.get(keys[2:])))
            assert promoted, "upcoming not promoted"
            assert [bytes(v) for v in load.fetch(keys[2:], slots[2:]).payloads] == payloads[2:]
        assert remote.counters.promoted == 6 and remote.counters.read_from_disk == 0
        for slot in slots:
            remote.release(slot)
    finally:
        remote.close()


@pytest.mark.parametrize("node", ["node-a", "node-elsewhere"])
def test_chunks_read_ahead_are_fetched_without_asking_dram_again(daemon, client, node):
    """What a loader knows DRAM lacks: this node reads it from its pack files, another node has it promoted."""
    keys, payloads = restart_with_nvme_only(daemon, client, list(range(64 * 4)), seed=8)
    reader = CacheClient(fetch_config(daemon.url).model_copy(update={"node": node}), make_spec(), arena_bytes=64 << 20)
    try:
        slots = [reader.slot(4 << 20) for _ in keys]
        with reader.load() as load:
            load.read_ahead(list(zip(keys, slots, strict=True)))
            assert [bytes(v) for v in load.fetch(keys, slots).payloads] == payloads
        expected = (4, 0) if node == "node-a" else (0, 4)
        assert (reader.counters.read_from_disk, reader.counters.promoted) == expected and reader.counters.missing == 0
        for slot in slots:
            reader.release(slot)
    finally:
        reader.close()


def read_in_place(client: CacheClient, keys: list[bytes], payloads: list[bytes], pages: memoryview) -> ScatteredRead:
    """Read each chunk straight into ``pages`` (its header and tokens into a fresh slot), each DRAM part in place, as
    the connector's reads in place do; returns the read, unverified."""
    ends = list(itertools.accumulate(len(p) for p in payloads))
    cut = [
        split_pieces(
            [client.slot(payload_offset(64)), pages[end - len(p) : end]],
            payload_offset(64) + first_part_rows(64) * (len(p) // 64),
        )
        for p, end in zip(payloads, ends, strict=True)
    ]
    read = client.read_in_place(
        [Landed(key, c[0][0], c[0][0], c[0][1:], c[1]) for key, c in zip(keys, cut, strict=True)], time.perf_counter()
    )
    assert read.fetch([True] * len(keys)) == [True] * len(keys)
    return read


def test_a_read_in_place_closed_unverified_gives_its_slots_back_and_reports_no_chunk_intact(client):
    keys, payloads = publish_prompt(client, list(range(64 * 4)), seed=12)
    pages = client.shared_memory(len(b"".join(payloads)))
    free = client.dram.arena.free_bytes
    read = read_in_place(client, keys, payloads, pages)
    assert client.dram.arena.free_bytes < free
    read.close()
    read.close()  # harmless
    assert client.dram.arena.free_bytes == free
    assert read.verdicts == [False] * 4 and client.counters.fetched == 0
    with read_in_place(client, keys, payloads, pages) as verified:
        assert verified.verify() == [True] * 4  # the same chunks, verified, are intact
    assert client.dram.arena.free_bytes == free and client.counters.fetched == 4


def test_an_index_lost_with_redis_is_rebuilt_from_the_nvme_tier(daemon, client, tmp_path):
    tokens = list(range(64 * 3 + 20))
    keys, payloads = publish_prompt(client, tokens, seed=3)
    wait_persisted(client, keys)
    client.close()
    daemon.stop()
    shutil.rmtree(daemon.data_dir / "redis")
    daemon.start()
    rebuilt = connect(daemon)
    try:
        match = rebuilt.lookup(prompt_query(rebuilt.spec.root(), rebuilt.geometry, tokens))
        assert match.keys == keys[:3] and match.partial.key == keys[3]
        assert fetch_payloads(rebuilt, keys) == payloads
    finally:
        rebuilt.close()


def flip_on_disk(data_dir: Path, needle: bytes) -> None:
    for pack in (data_dir / "nvme" / "segments").iterdir():
        data = bytearray(pack.read_bytes())
        at = data.find(needle)
        if at >= 0:
            data[at + len(needle) + 100] ^= 0xFF
            pack.write_bytes(bytes(data))
            return
    raise AssertionError("payload not found on disk")


def test_a_flipped_byte_on_nvme_is_a_miss_not_data(daemon, client):
    keys, payloads = publish_prompt(client, list(range(64)), seed=7)
    wait_persisted(client, keys)
    client.close()
    daemon.stop()
    flip_on_disk(daemon.data_dir, payloads[0][:64])
    daemon.start()
    after = connect(daemon)
    try:
        assert fetch_payloads(after, keys) == [None]
        assert after.index.get(keys) == [None]  # its only copy was bad: the entry is gone
    finally:
        after.close()


def test_a_flipped_byte_in_dram_is_a_miss_and_the_copy_is_deleted(client):
    keys, payloads = publish_prompt(client, list(range(64)), seed=9)
    wait_persisted(client, keys)
    damage_dram_copy(client.dram, keys[0])
    assert fetch_payloads(client, keys) == [payloads[0]]  # the bad DRAM copy missed; NVMe served the chunk
    assert client.counters.corrupt == 1 and client.counters.read_from_disk == 1


def test_two_writers_of_one_chunk_leave_one_copy_and_one_entry(daemon, client):
    other = connect(daemon)
    try:
        tokens = list(range(64 * 2))
        keys_a, payloads = publish_prompt(client, tokens, seed=1)
        keys_b, _ = publish_prompt(other, tokens, seed=2)  # same tokens: same keys; the first copy stays
        assert keys_a == keys_b
        wait_persisted(client, keys_a)
        assert [e.locations for e in client.index.get(keys_a)] == [{DRAM, NVME}] * 2
        assert fetch_payloads(other, keys_a) == payloads
    finally:
        other.close()


def test_dram_over_capacity_demotes_and_every_chunk_still_hits(tmp_path):
    """Demotion keeps DRAM under its mark, never loses a chunk, and leaves leased chunks (the oldest here) alone."""
    daemon = Daemon(tmp_path / "data", dram="128MiB", nvme="1GiB").start()
    client = connect(daemon)
    leases = Leases(redis.Redis.from_url(client.index.url), client.index.keyspace)
    try:
        published = []
        for i in range(40):  # 40 prompts x 8 chunks x 1 MiB: 2.5x the DRAM segment
            published.append(publish_prompt(client, [i] * 64 + list(range(64 * 7)), seed=i, bytes_per_token=16384))
            if i == 0:
                leases.grant(published[0][0], ttl_s=600)  # as a scheduler does for chunks it promised
            wait_persisted(client, published[-1][0])
        entries = [e for keys, _ in published for e in client.index.get(keys)]
        assert all(e is not None and NVME in e.locations for e in entries)  # nothing was lost
        in_dram_mib = sum(e.size_bytes for e in entries if DRAM in e.locations) >> 20
        assert in_dram_mib <= 128 * 0.95, "demotion kept DRAM below the master's eviction mark"
        assert all(DRAM in e.locations for e in client.index.get(published[0][0])), "a leased chunk was demoted"
        assert any(DRAM not in e.locations for e in client.index.get(published[1][0])), "nothing was demoted"
        # The leased prompt, a demoted one (back by promotion) and the newest. Promoting more at once
        # into a segment this full of soft-pinned chunks can fail (a miss) before demotion makes room.
        for keys, payloads in published[:2] + published[-3:]:
            assert fetch_payloads(client, keys) == payloads
    finally:
        client.close()
        daemon.stop()
