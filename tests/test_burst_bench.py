"""benchmarks.burst's pure logic, and the engine spec's bursts (``together`` as group sizes)."""

import json

import pytest

from benchmarks.burst import CEILING, Burst, Runner, Shape, parse_shapes, report
from tests.e2e.run_vllm import SpecError, load_spec


def test_shapes_parse_and_count_the_kv_blocks_a_burst_takes():
    assert parse_shapes("32x1025,8x4097") == [Shape(32, 1025), Shape(8, 4097)]
    # 1025 tokens and the generated one fill 9 blocks of 128; 4095 and one fill 32
    assert Shape(32, 1025).blocks == 32 * 9 and Shape(2, 4095).blocks == 2 * 32
    for bad in ("", "32", "32x", "x1025", "32*1025", "-1x100"):
        with pytest.raises(ValueError):
            parse_shapes(bad)


def test_ratios_compare_medians_over_rounds_and_first_tokens_are_checked_against_cold():
    def bursts(config: str, walls: list[float], first: list[int], shape: str = "2x100") -> list[Burst]:
        return [Burst(shape, config, r, w, w / 2, 99, first) for r, w in enumerate(walls)]

    run = (
        bursts("cold", [4.0], [7, 8])
        + bursts(CEILING, [0.10, 0.30, 0.20], [7, 8])
        + bursts("prefixcache-dram", [0.26, 0.22, 0.90], [7, 9])
    )
    found = report(run, [Shape(2, 100)])
    assert found["ratios"]["prefixcache-dram / vllm-prefix-cache"]["2x100"] == pytest.approx(0.26 / 0.20)
    assert found["ratios"]["vllm-prefix-cache / cold"]["2x100"] == pytest.approx(0.20 / 4.0)
    assert "prefixcache-nvme / vllm-prefix-cache" not in found["ratios"]
    assert found["first_tokens_differ_from_cold"] == ["prefixcache-dram"]


def test_warm_up_bursts_are_sets_of_their_own_recorded_at_most_once(tmp_path):
    run = Runner(tmp_path, tmp_path, [Shape(2, 50), Shape(1, 80)], rounds=3)
    plan = run.warm_ups(runs=2, config="first")
    assert [(str(shape), config) for shape, _, config in plan] == [
        ("2x50", "first"),
        ("2x50", None),
        ("1x80", "first"),
        ("1x80", None),
    ]
    measured = {tuple(p) for shape, round_, _ in run.every_round(None) for p in run.prompts(shape, round_)}
    warm = {tuple(p) for shape, round_, _ in plan for p in run.prompts(shape, round_)}
    assert len(warm) == 3 and not warm & measured  # nothing measured was computed by a warm-up


def test_a_spec_takes_bursts_as_group_sizes_that_add_up_to_its_prompts(tmp_path):
    def spec(together: object, **more: object) -> dict:
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({"model": str(tmp_path), "prompts": [[1], [2], [3]], "together": together, **more}))
        return load_spec(path)

    assert spec([1, 2])["together"] == [1, 2]
    assert spec(True)["together"] is True
    for bad in ([1, 1], [1, 3], [0, 3], [1.0, 2], "yes", [True, 2]):
        with pytest.raises(SpecError, match="spec.together"):
            spec(bad)
    # beside a decode, each group is submitted at once while a decode of its own runs
    decodes = {"max_tokens": 8, "after_tokens": 2}
    assert len(spec([1, 2], beside={"prompts": [[7], [8]], **decodes})["beside"]["prompts"]) == 2
    with pytest.raises(SpecError, match="spec.beside"):
        spec([1, 2], beside={"prompts": [[7], [8], [9]], **decodes})


def test_a_spec_takes_a_bystander_with_its_prompts_sizes_and_cpus(tmp_path):
    def spec(bystander: object, **more: object) -> dict:
        path = tmp_path / "spec.json"
        path.write_text(json.dumps({"model": str(tmp_path), "prompts": [[1], [2]], "bystander": bystander, **more}))
        return load_spec(path)

    good = {"prompts": [1], "copy_bytes": 4, "mac_bytes": 8, "cpus": [0]}
    assert spec(good)["bystander"] == good
    for bad in (
        {**good, "prompts": [2]},
        {**good, "copy_bytes": 9},
        {**good, "copy_bytes": 0},
        {**good, "mac_bytes": 8.0},
        {**good, "cpus": []},
        {**good, "cpus": [-1]},
        {key: value for key, value in good.items() if key != "prompts"},
        {**good, "prompts": 1},
        {**good, "prompts": [True]},
        {**good, "cpus": 0},
        [1],
    ):
        with pytest.raises(SpecError, match="spec.bystander"):
            spec(bad)
    with pytest.raises(SpecError, match="bystander"):
        spec(good, together=True)
