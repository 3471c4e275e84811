"""benchmarks.serving's pure logic: the clients' outputs read as results, and the ratios with their goals."""

import pytest

from benchmarks.serving import (
    BESIDE_FINISHES,
    LMCACHE,
    MULTI_ROUND_CHAT,
    NO_CACHE,
    PREFIXCACHE,
    PREFIXCACHE_WARM,
    PUBLISHING_OFF,
    PUBLISHING_ON,
    SCALE_OUT,
    Result,
    Streamed,
    from_blocks,
    from_lmcache_bench,
    from_vllm_bench,
    ratios,
)


def request(ttft: float, first: float, finish: float, tokens: int, ok: bool = True) -> dict[str, str]:
    """A row of lmcache bench engine's bench_results.csv, as csv.DictReader gives it."""
    return {
        "successful": str(ok),
        "ttft": str(ttft),
        "num_input_tokens": "100",
        "num_output_tokens": str(tokens),
        "first_token_time": str(first),
        "finish_time": str(finish),
    }


def test_lmcache_tpot_is_decode_time_over_the_tokens_after_the_first_and_failures_are_counted_apart():
    summary = {"results": {"mean_ttft_ms": 250.0, "p99_ttft_ms": 400.0, "elapsed_time": 4.0}}
    rows = [
        request(0.2, 10.0, 10.9, 10),  # 9 tokens in 0.9 s: 100 ms each
        request(2.5, 20.0, 20.6, 4),  # 3 tokens in 0.6 s: 200 ms each; its first past the TTFT bound
        request(0.1, 30.0, 30.0, 1),  # one token: no TPOT
        request(-1.0, 0.0, 0.0, 0, ok=False),
    ]
    result = from_lmcache_bench("row", MULTI_ROUND_CHAT, summary, rows)
    assert (result.requests, result.failed, result.input_tokens) == (3, 1, 300)
    assert result.mean_tpot_ms == pytest.approx(150.0)
    assert result.p99_tpot_ms == pytest.approx(200.0)
    assert (result.mean_ttft_ms, result.p99_ttft_ms) == (250.0, 400.0)
    assert result.requests_per_s == pytest.approx(0.75)
    assert result.goodput_per_s == pytest.approx(0.5)  # two of the three within 2 s, over 4 s


def test_vllm_bench_results_keep_goodput():
    out = {
        "completed": 9,
        "failed": 0,
        "total_input_tokens": 900,
        "mean_ttft_ms": 1.0,
        "p99_ttft_ms": 2.0,
        "mean_tpot_ms": 3.0,
        "p99_tpot_ms": 4.0,
        "request_throughput": 0.5,
        "request_goodput": 0.25,
    }
    result = from_vllm_bench("row", "prefix-repetition @ 1 req/s", out)
    assert (result.requests, result.goodput_per_s, result.p99_tpot_ms) == (9, 0.25, 4.0)


def result(row: str, ttft: float, tpot: float = 10.0, workload: str = MULTI_ROUND_CHAT) -> Result:
    return Result(row, workload, 1, 0, 1, ttft, ttft, tpot, tpot, 1.0, None)


def test_ratios_are_of_the_rows_that_ran_each_against_its_goal():
    found = ratios(
        [
            result(NO_CACHE, 1000.0),
            result(PREFIXCACHE, 400.0, tpot=10.4),
            result(PREFIXCACHE_WARM, 400.0),
            result(SCALE_OUT, 600.0),
            result(PUBLISHING_ON, 450.0, tpot=10.4, workload=BESIDE_FINISHES),
            result(PUBLISHING_OFF, 450.0, tpot=10.0, workload=BESIDE_FINISHES),
        ]
    )
    assert found["prefixcache / no-cache, multi-round-chat mean TTFT"] == {"value": 0.4, "goal": 0.5, "met": True}
    assert found["scale-out / prefixcache-warm, multi-round-chat mean TTFT"]["met"] is False  # 1.5 > 1.25
    tpot = found["decode publishing on / off, mean TPOT beside finishing answers (one engine)"]
    assert tpot["value"] == pytest.approx(1.04) and tpot["met"]
    assert not any(LMCACHE in name for name in found)  # its row did not run
    assert not any("long-doc-qa" in name for name in found)


def test_a_ratio_without_a_goal_is_reported_not_judged():
    found = ratios(
        [
            Result(row, "long-doc-qa", 1, 0, 1, ttft, ttft, 1.0, 1.0, 1.0, None)
            for row, ttft in [(NO_CACHE, 2.0), (PREFIXCACHE, 1.0)]
        ]
    )
    assert found == {"prefixcache / no-cache, long-doc-qa mean TTFT": {"value": 0.5, "goal": None, "met": None}}


def test_an_arm_is_judged_by_its_long_answers_the_short_ones_beside_them_only_count_as_requests():
    blocks = [
        [Streamed(100.0, 50.0, 192, 90), Streamed(80.0, 70.0, 48, 95), Streamed(90.0, 75.0, 48, 91)],
        [Streamed(300.0, 60.0, 192, 93), Streamed(80.0, 90.0, 48, 92)],
    ]
    arm = from_blocks(PUBLISHING_ON, blocks, elapsed_s=10.0)
    assert (arm.workload, arm.requests, arm.requests_per_s) == (BESIDE_FINISHES, 5, 0.5)
    assert arm.input_tokens == 461
    assert (arm.mean_ttft_ms, arm.mean_tpot_ms, arm.p99_tpot_ms) == (200.0, 55.0, 60.0)
