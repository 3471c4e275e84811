"""benchmarks.ttft's ratios (rows paired in one engine are compared pair by pair, other rows by their medians) and
its unmeasured prompts."""

import statistics

from benchmarks.ttft import (
    AFTER_PUBLISHING,
    BYPASSED,
    CEILING,
    LMCACHE_REACH,
    PUBLISHING,
    Case,
    Runner,
    first_tokens_differing_from_cold,
    medians,
    paired_ratio,
    ratios,
    ratios_by_pass,
)


def cases(config: str, times: list[float], tokens: int = 4097) -> list[Case]:
    return [Case(tokens, config, t, 0, 1) for t in times]


def test_paired_rows_take_the_median_of_their_pairs_ratios_not_the_ratio_of_their_medians():
    # the committed run's publishing pairs at 8065 tokens: a slow first pair skews the medians' ratio
    run = cases(PUBLISHING, [6.639, 5.625, 6.109]) + cases(BYPASSED, [5.635, 5.521, 6.282])
    found = ratios(medians(run), run, [4097])
    (publishing,) = (values for name, values in found.items() if name.startswith(f"{PUBLISHING} / {BYPASSED}"))
    assert publishing[4097] == paired_ratio(run, PUBLISHING, BYPASSED, 4097)
    assert round(publishing[4097], 3) == 1.019  # 6.109 / 5.635 = 1.084 as a ratio of medians


def test_rows_from_different_engines_compare_their_medians():
    run = cases("prefixcache-dram", [0.030, 0.040, 0.036]) + cases(CEILING, [0.020, 0.030, 0.028])
    found = ratios(medians(run), run, [4097])
    assert found["prefixcache-dram / vllm-prefix-cache (target <= 1.25)"][4097] == 0.036 / 0.028


def test_a_paired_ratio_needs_as_many_cases_on_each_side():
    run = cases(PUBLISHING, [1.0, 1.1]) + cases(BYPASSED, [1.0])
    assert paired_ratio(run, PUBLISHING, BYPASSED, 4097) is None
    assert paired_ratio(run, PUBLISHING, BYPASSED, 1025) is None


def test_each_size_has_an_unmeasured_prompt_of_its_own(tmp_path):
    run = Runner(tmp_path, tmp_path, [1025, 4097], repeats=3, server_cpus=None)
    assert [len(p) for p in run.warm_ups] == [1025, 4097]
    assert not {tuple(p) for p in run.warm_ups} & {tuple(p) for p in run.prompts}


def test_each_pass_has_ratios_of_its_own_beside_the_pooled_ones():
    first = cases("prefixcache-dram", [0.030, 0.031, 0.032]) + cases(CEILING, [0.020, 0.021, 0.022])
    second = cases("prefixcache-dram", [0.040, 0.041, 0.042]) + cases(CEILING, [0.030, 0.031, 0.032])
    for case in second:
        case.run_pass = 1
    name = "prefixcache-dram / vllm-prefix-cache (target <= 1.25)"
    by_pass = ratios_by_pass(first + second, [4097])
    assert by_pass[0][name][4097] == 0.031 / 0.021
    assert by_pass[1][name][4097] == 0.041 / 0.031
    pooled = ratios(medians(first + second), first + second, [4097])[name][4097]
    ours, ceiling = [0.030, 0.031, 0.032, 0.040, 0.041, 0.042], [0.020, 0.021, 0.022, 0.030, 0.031, 0.032]
    assert pooled == statistics.median(ours) / statistics.median(ceiling)


def test_each_pass_runs_in_a_directory_of_its_own(tmp_path):
    run = Runner(tmp_path, tmp_path, [1025], repeats=1, server_cpus=None)
    run.start_pass(0)
    first = run.workdir
    run.start_pass(1)
    assert first != run.workdir and first.is_dir() and run.workdir.is_dir() and run.run_pass == 1


def test_the_fresh_series_is_apart_from_every_other_prompt_and_from_the_cold_rows_check(tmp_path):
    run = Runner(tmp_path, tmp_path, [1025, 4097], repeats=3, server_cpus=None)
    assert [len(p) for p in run.fresh_prompts] == [len(p) for p in run.prompts]
    others = {tuple(p[:256]) for p in [*run.prompts, *run.warm_ups]}  # a chunk shared would be a hit, not a publish
    assert not {tuple(p[:256]) for p in run.fresh_prompts} & others
    cold = cases("cold", [1.0, 1.1, 1.2])
    after = [Case(4097, AFTER_PUBLISHING, 0.02, 4096, first_token=99) for _ in range(3)]
    assert first_tokens_differing_from_cold(cold + after) == []
    assert first_tokens_differing_from_cold(cold + cases("prefixcache-dram", [0.02] * 3)) == []
    assert first_tokens_differing_from_cold(cold + [Case(4097, "prefixcache-dram", 0.02, 4096, 99)] * 3) == [
        "prefixcache-dram"
    ]


def test_the_run_says_how_far_lmcache_over_ours_could_reach():
    # LMCache's hits far slower than vLLM's own, ours close to it: LMCache over ours stays below its reach
    run = [
        *cases("lmcache-mp", [0.037], 1025),
        *cases(CEILING, [0.0123], 1025),
        *cases("prefixcache-dram", [0.0149], 1025),
    ]
    found = ratios(medians(run), run, [1025])
    assert found[LMCACHE_REACH][1025] == 0.037 / 0.0123
    assert found["lmcache-mp / prefixcache-dram (target >= 3)"][1025] < found[LMCACHE_REACH][1025]
