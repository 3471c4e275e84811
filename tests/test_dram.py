"""The DRAM tier against a real mooncake_master and segment owner."""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np
import pytest

from prefixcache.cachestore.chunks.codec import ChunkMeta, encode, payload_offset, read_meta
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.tiers import dram
from prefixcache.cachestore.tiers.dram import FAILED, first_part_rows, split_at, split_offset, split_pieces
from prefixcache.cachestore.tiers.tier import Removal
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import CallCounter, wait_for
from tests.netns import freeze_processes


@pytest.fixture
def tier(mooncake):
    tier = mooncake.tier()
    yield tier
    tier.close()


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_round_trip_through_arena_slots_without_staging(tier):
    data = [os.urandom(1 << 20), os.urandom(3 * 4096 + 5)]
    slots = [tier.arena.alloc(len(d)) for d in data]
    for slot, d in zip(slots, data, strict=True):
        slot[:] = d
    keys = [os.urandom(16) for _ in data]
    assert tier.put(list(zip(keys, slots, strict=True))) == [True, True]
    out = [tier.arena.alloc(len(d)) for d in data]
    assert tier.get_into(keys, out) == [len(d) for d in data]
    assert [bytes(o) for o in out] == data


def test_plain_buffers_are_staged_and_misses_are_minus_one(tier):
    k = os.urandom(16)
    data = os.urandom(100_000)
    assert tier.put([(k, data)]) == [True]
    out = bytearray(200_000)
    assert tier.get_into([k, os.urandom(16)], [memoryview(out), memoryview(bytearray(10))]) == [100_000, -1]
    assert bytes(out[:100_000]) == data
    assert tier.arena.free_bytes == tier.arena.size  # staging slots returned


def test_delete_and_objects_outlive_the_tier_that_put_them(mooncake):
    writer = mooncake.tier(arena_bytes=8 << 20)
    k = os.urandom(16)
    assert writer.put([(k, b"x" * 5000)]) == [True]
    writer.close()
    reader = mooncake.tier(arena_bytes=8 << 20)
    try:
        out = bytearray(5000)
        assert reader.get_into([k], [memoryview(out)]) == [5000] and out == b"x" * 5000
        assert reader.delete([k, os.urandom(16)]) == [Removal.REMOVED, Removal.ABSENT]
        assert reader.get_into([k], [memoryview(out)]) == [-1]
    finally:
        reader.close()


def test_usage_reports_this_nodes_segment(tier, mooncake):
    tier.put([(os.urandom(16), os.urandom(1 << 20))])
    usage = tier.usage()
    assert usage.capacity_bytes == mooncake.segment_bytes and usage.bytes_used >= 1 << 20


def test_a_full_segment_evicts_rather_than_rejecting_puts(private_mooncake):
    tier = private_mooncake.tier(arena_bytes=8 << 20)
    try:
        results = [tier.put([(os.urandom(16), os.urandom(1 << 20))])[0] for _ in range(160)]  # 2.5x the segment
        assert all(results)
    finally:
        tier.close()


def test_master_stopped_means_fast_misses_then_recovery(private_mooncake):
    tier = private_mooncake.tier(arena_bytes=8 << 20, breaker_s=0.5)
    try:
        k = os.urandom(16)
        assert tier.put([(k, b"a" * 4096)]) == [True]
        private_mooncake.master.kill()
        started = time.monotonic()
        out = memoryview(bytearray(4096))
        assert tier.get_into([k], [out]) == [FAILED]  # not absent: the pool may hold it still
        assert tier.put([(os.urandom(16), b"b" * 4096)]) == [False]
        for _ in range(20):  # with the breaker open, each miss is immediate
            assert tier.get_into([k], [out]) == [FAILED]
        assert time.monotonic() - started < 10
        private_mooncake.restart_master()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and tier.put([(k, b"c" * 4096)]) != [True]:
            time.sleep(0.5)
        assert tier.get_into([k], [out]) == [4096] and bytes(out) == b"c" * 4096
    finally:
        tier.close()


def test_use_after_close_raises_instead_of_crashing(mooncake):
    tier = mooncake.tier(arena_bytes=4 << 20)
    tier.close()
    with pytest.raises(RuntimeError, match="after close"):
        tier.get_into([os.urandom(16)], [memoryview(bytearray(10))])


def test_shared_memory_is_handed_out_zeroed_after_the_owner_wrote_every_page(tier):
    memory = tier.shared_memory(16 << 20)  # the owner's pre-fault reads each window and writes it back
    assert not np.frombuffer(memory, dtype=np.uint8).any()
    k, data = key(99), os.urandom(3 << 20)
    assert tier.put([(k, data)]) == [True]
    assert tier.get_scattered([k], [[memory[5 << 20 : 6 << 20], memory[10 << 20 : 12 << 20]]]) == [3 << 20]
    assert bytes(memory[5 << 20 : 6 << 20]) + bytes(memory[10 << 20 : 12 << 20]) == data


def chunk_object(layers: int, layer_bytes: int = 3 * 4096 + 8) -> tuple[bytes, bytes]:
    """A chunk's stored form, its payload ``layers`` rows (the connector's layers) of random bytes: (key, object)."""
    meta = ChunkMeta(
        os.urandom(16), os.urandom(16), os.urandom(16), pack_tokens(list(range(40))), "uint8", (layers, layer_bytes)
    )
    return meta.key, bytes(encode(meta, os.urandom(layers * layer_bytes), ChunkMacKey(os.urandom(32))))


def test_a_chunk_is_two_objects_its_first_layers_and_the_rest_joined_again_on_the_way_out(tier):
    """A load fetches a chunk's first layers, lets the forward pass start on them and fetches the rest meanwhile,
    so the tier cuts each chunk there; whole-object reads join the parts again."""
    k, obj = chunk_object(layers=4)
    at = split_offset(read_meta(obj))
    assert at == payload_offset(40) + first_part_rows(4) * (3 * 4096 + 8) and 0 < first_part_rows(4) < 4
    assert tier.put([(k, obj)]) == [True]
    first, second = tier.arena.alloc(at), tier.arena.alloc(len(obj) - at)
    assert tier.get_scattered([k, k], [[first], [second]], [False, True]) == [at, len(obj) - at]
    assert bytes(first) + bytes(second) == obj
    out = tier.arena.alloc(len(obj) + 5000)  # a slot larger than the object, as the slots of loads are
    assert tier.get_into([k], [out]) == [len(obj)] and bytes(out[: len(obj)]) == obj
    plain = bytearray(len(obj))  # staged through the arena
    assert tier.get_into([k], [memoryview(plain)]) == [len(obj)] and plain == obj
    # a chunk of one layer, and any other object, is one object
    one_key, one = chunk_object(layers=1)
    assert split_offset(read_meta(one)) is None
    assert tier.put([(one_key, one)]) == [True]
    assert tier.get_scattered([one_key], [[tier.arena.alloc(len(one))]]) == [len(one)]
    assert tier.get_scattered([one_key], [[tier.arena.alloc(len(one))]], [True]) == [-1]


def test_a_reader_that_knows_where_chunks_are_cut_reads_both_parts_in_one_call(tier):
    """A GPU's loads read every hit through slots, a group per call: the second part must not cost a round trip
    more. A wrong cut is a miss, never bytes of another layout."""
    (k, obj), (one_key, one) = chunk_object(layers=4), chunk_object(layers=1)
    assert tier.put([(k, obj), (one_key, one)]) == [True, True]
    meta = read_meta(obj)
    at = split_at(meta.payload_offset, 4, meta.payload_bytes)
    assert at == split_offset(meta) and split_at(meta.payload_offset, 1, meta.payload_bytes) is None
    tier._store = counter = CallCounter(tier._store)
    slots = [tier.arena.alloc(len(obj) + 5000), tier.arena.alloc(len(one))]
    assert tier.get_into([k, one_key], slots, [at, None]) == [len(obj), len(one)]
    assert counter.reads == 1
    assert bytes(slots[0][: len(obj)]) == obj and bytes(slots[1]) == one
    plain = bytearray(len(obj))  # staged through the arena
    assert tier.get_into([k], [memoryview(plain)], [at]) == [len(obj)] and plain == obj
    assert tier.get_into([k], [tier.arena.alloc(len(obj))]) == [len(obj)]  # not known: a second call
    assert counter.reads == 4
    for wrong in (at - 8, at + 8):
        assert tier.get_into([k], [tier.arena.alloc(len(obj))], [wrong])[0] < 0  # a miss
    with pytest.raises(ValueError, match="one cut per key"):
        tier.get_into([k], [tier.arena.alloc(len(obj))], [at, at])


def test_a_chunk_whose_second_part_the_master_evicted_is_a_miss_and_delete_removes_both(tier):
    k, obj = chunk_object(layers=4)
    assert tier.put([(k, obj)]) == [True]
    assert tier._store.batch_remove([tier._names(k)[1]], True) == [0]  # what the master's eviction may do to one part
    assert tier.get_into([k], [tier.arena.alloc(len(obj))]) == [-1]
    assert tier.contains([k]) == [True]  # its first part is still there: the read that needs the rest misses
    assert tier.delete([k]) == [Removal.REMOVED]
    assert tier.contains([k]) == [False] and tier.delete([k]) == [Removal.ABSENT]
    k, obj = chunk_object(layers=4)
    assert tier.put([(k, obj)]) == [True]
    assert tier.delete([k]) == [Removal.REMOVED]
    assert tier._store.batch_is_exist(list(tier._names(k))) == [0, 0]


def test_a_chunk_put_from_pieces_is_cut_where_a_whole_one_is(tier):
    """A chunk read from NVMe into a KV cache's pages goes into DRAM from those pages, in pieces of any size."""
    k, obj = chunk_object(layers=4)
    memory = tier.shared_memory(1 << 20)
    cuts = [0, payload_offset(40), payload_offset(40) + 5000, len(obj) - 7, len(obj)]  # head, then pages
    pieces = [memory[start + i * 4096 : end + i * 4096] for i, (start, end) in enumerate(itertools.pairwise(cuts))]
    for piece, (start, end) in zip(pieces, itertools.pairwise(cuts), strict=True):
        piece[:] = obj[start:end]
    assert tier.put_scattered([k], [pieces]) == [True]
    at = split_offset(read_meta(obj))
    first, second = tier.arena.alloc(at), tier.arena.alloc(len(obj) - at)
    assert tier.get_scattered([k, k], [[first], [second]], [False, True]) == [at, len(obj) - at]
    assert bytes(first) + bytes(second) == obj


def test_pieces_are_cut_at_a_byte_inside_or_between_them():
    data = memoryview(bytes(range(100)))
    pieces = [data[0:10], data[10:30], data[30:100]]
    for at in (5, 10, 29, 30, 99):
        first, second = split_pieces(pieces, at)
        assert b"".join(first) == bytes(range(at)) and b"".join(second) == bytes(range(at, 100))
        assert all(len(piece) for piece in first + second)
    assert split_pieces(pieces, None) == [pieces]


def test_a_read_past_its_deadline_is_late_and_its_slot_held_until_mooncake_returns(private_mooncake, monkeypatch):
    """The segment owner frozen (SIGSTOP): a read with a deadline answers LATE at it, not after Mooncake's 30 s; the
    slot it targeted is not handed out again until the call has returned and the margin passed."""
    monkeypatch.setattr(dram, "LATE_WRITE_MARGIN_S", 0.2)
    tier = private_mooncake.tier(arena_bytes=8 << 20)
    owner = private_mooncake.owner.pid
    try:
        k = os.urandom(16)
        assert tier.put([(k, b"a" * 4096)]) == [True]
        slot = tier.arena.alloc(4096)
        held_at = tier.arena.offset_of(slot)

        def handed_out_again() -> bool:
            probe = tier.arena.alloc(4096)
            tier.arena.free(probe)
            return tier.arena.offset_of(probe) == held_at

        assert tier.get_into([k], [slot], deadline_s=5) == [4096]  # in time: as without a deadline
        freeze_processes([owner])
        try:
            started = time.monotonic()
            assert tier.get_into([k], [slot], deadline_s=0.3) == [dram.LATE]
            assert time.monotonic() - started < 5
            assert tier.late_reads == 1
            tier.arena.free(slot)
            time.sleep(0.5)  # past the margin, but the call is still in Mooncake: the slot stays held
            assert not handed_out_again()
        finally:
            os.kill(owner, signal.SIGCONT)
        assert wait_for(handed_out_again, timeout_s=60), "the slot stayed held after Mooncake's call returned"
    finally:
        tier.close()
