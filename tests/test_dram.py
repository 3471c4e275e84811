"""The DRAM tier against a real mooncake_master and segment owner."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest


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
        assert reader.delete([k, os.urandom(16)]) == 1
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
        assert tier.get_into([k], [out]) == [-1]
        assert tier.put([(os.urandom(16), b"b" * 4096)]) == [False]
        for _ in range(20):  # with the breaker open, each miss is immediate
            assert tier.get_into([k], [out]) == [-1]
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
