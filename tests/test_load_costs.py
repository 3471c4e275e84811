"""Whether a hit pays (connector/load_costs.py): the rates learned, and where a hit is cut."""

from __future__ import annotations

import pytest

from prefixcache.cachestore.client.cache_client import READ_DEADLINE_FLOOR_S, read_deadline_s
from prefixcache.cachestore.client.moving_rate import MovingRate
from prefixcache.connector.load_costs import PREFILL_SAMPLE_TOKENS, HitPart, LoadCosts
from prefixcache.connector.plans import hit_parts
from prefixcache.indexer.index import PartialHit, PrefixMatch

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def costs_of(clock: Clock, tokens_per_s: float | None = 1000.0, bytes_per_token: int = 1024) -> LoadCosts:
    costs = LoadCosts(bytes_per_token, clock=clock)
    if tokens_per_s is not None:
        costs.observe_step(4096, 4096 / tokens_per_s)
    return costs


def test_a_rate_follows_its_recent_samples_and_is_forgotten_when_none_come():
    clock = Clock()
    rate = MovingRate(half_life=1, forget_s=60, clock=clock)
    assert rate.per_second is None
    rate.add(100, 1.0)
    assert rate.per_second == pytest.approx(100)
    rate.add(10, 1.0)  # the older sample weighs half: (50 + 10) / (0.5 + 1)
    assert rate.per_second == pytest.approx(40)
    rate.add(0, 1.0)  # nothing moved: not a sample
    assert rate.per_second == pytest.approx(40)
    clock.now = 61
    assert rate.per_second is None
    rate.add(5, 1.0)  # a sample after a silence starts afresh
    assert rate.per_second == pytest.approx(5)


def test_steps_too_small_to_be_prefills_teach_nothing():
    costs = costs_of(Clock(), tokens_per_s=None)
    costs.observe_step(PREFILL_SAMPLE_TOKENS - 1, 10.0)
    assert costs.prefill_tokens_per_s is None
    costs.observe_step(2 * PREFILL_SAMPLE_TOKENS, 1.0)
    assert costs.prefill_tokens_per_s == pytest.approx(2 * PREFILL_SAMPLE_TOKENS)


def test_a_hit_loads_whole_while_nothing_says_it_costs_more_than_it_saves():
    clock = Clock()
    parts = [HitPart(1000, "local_dram"), HitPart(1000, "remote_dram")]
    assert costs_of(clock, tokens_per_s=None).paying_tokens(parts) == 2000  # the prefill rate is unknown
    assert costs_of(clock).paying_tokens(parts) == 2000  # neither path measured


def test_a_hit_stops_before_the_path_slower_than_computing():
    costs = costs_of(Clock())  # 1000 tokens/s, 1 KiB per token: a path pays above 1 MiB/s or so
    costs.observe_reads({"local_dram": (1000 * MIB, 0.1), "remote_dram": (MIB, 2.0)})  # 0.5 MiB/s across
    assert costs.bandwidth("remote_dram") == pytest.approx(MIB / 2)
    parts = [HitPart(1000, "local_dram"), HitPart(1000, "remote_dram")]
    assert costs.paying_tokens(parts) == 1000
    assert costs.paying_tokens([HitPart(1000, "remote_dram")]) == 0
    costs.observe_reads({"remote_dram": (100 * MIB, 0.1)})  # the link is fast again
    assert costs.paying_tokens(parts) == 2000


def test_a_slow_part_between_fast_ones_is_loaded_where_the_whole_still_pays():
    costs = costs_of(Clock())
    costs.observe_reads({"local_dram": (1000 * MIB, 0.1), "nvme": (MIB, 2.0)})  # 0.5 MiB/s: slower than computing
    parts = [HitPart(1000, "local_dram"), HitPart(200, "nvme"), HitPart(1000, "local_dram")]
    assert costs.paying_tokens(parts) == 2200  # the NVMe part costs 0.19 s more than computing it; the rest saves 2 s
    parts[2] = HitPart(100, "local_dram")
    assert costs.paying_tokens(parts) == 1000  # what follows it saves less than it costs: the hit stops before it


def test_a_hits_parts_follow_the_path_of_each_chunk_on_any_rank():
    first = PrefixMatch(
        keys=[b"a", b"b", b"c", b"d"],
        chunk_tokens=100,
        partial=PartialHit(b"e", 50, 100, in_dram=False),
        remote_dram=frozenset({2}),
    )
    second = PrefixMatch(keys=[b"A", b"B", b"C", b"D"], chunk_tokens=100, without_dram=frozenset({1}))
    assert hit_parts([first, second], 30, 449) == [
        HitPart(70, "local_dram"),
        HitPart(100, "nvme"),
        HitPart(100, "remote_dram"),
        HitPart(100, "local_dram"),
        HitPart(49, "nvme"),
    ]


def test_a_read_across_the_network_is_given_its_bytes_at_half_the_bandwidth_such_reads_had():
    assert read_deadline_s(0) == READ_DEADLINE_FLOOR_S
    assert read_deadline_s(500_000_000) == pytest.approx(READ_DEADLINE_FLOOR_S + 1.0)  # 500 MB/s until measured
    assert read_deadline_s(125_000_000, bandwidth=125e6) == pytest.approx(READ_DEADLINE_FLOOR_S + 2.0)  # 1 GbE
    assert read_deadline_s(10_000_000_000, bandwidth=10e9) == pytest.approx(READ_DEADLINE_FLOOR_S + 2.0)
