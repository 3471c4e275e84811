"""The e2e harness itself: the tiny model loads in vLLM, greedy decoding is deterministic, comparisons work."""

from __future__ import annotations

import pytest

from tests.e2e.compare import NEAR_TIE_LOGPROB, ONE_BF16_STEP, compare_runs, same_greedy_output
from tests.e2e.tinymodel import random_prompt

pytestmark = pytest.mark.e2e

PROMPT = random_prompt(seed=1, length=600)


def test_reference_engine_is_deterministic(run_vllm, tiny_model):
    """One engine, the same 600-token prompt twice (vLLM's prefix cache off): two identical, uncached answers."""
    out = run_vllm({"model": str(tiny_model), "prompts": [PROMPT, PROMPT], "max_tokens": 4})
    first, second = out["outputs"]
    for result in (first, second):
        assert len(result["token_ids"]) == 4
        assert result["num_cached_tokens"] == 0
        assert [len(position) for position in result["logprobs"]] == [2, 2, 2, 2]  # top-2 at every position
        assert all(token < 2048 for token in result["token_ids"])
    assert first["token_ids"] == second["token_ids"]
    assert first["logprobs"] == second["logprobs"]  # bit-identical, not just the same tokens
    assert same_greedy_output(first, second) == (True, "identical 4 tokens (max logprob diff 0)")
    print(
        f"\nengine start {out['engine_start_s']:.1f} s (import {out['import_s']:.1f} s); per prompt: "
        + ", ".join(f"ttft {r['ttft_s']:.2f} s wall {r['wall_s']:.2f} s" for r in out["outputs"])
    )


def test_a_bad_spec_fails_with_its_reason(run_vllm, tmp_path):
    with pytest.raises(AssertionError, match="bad spec"):
        run_vllm({"model": str(tmp_path / "missing"), "prompts": [[5, 6, 7]]})
    with pytest.raises(AssertionError, match="beside needs"):
        run_vllm(
            {
                "model": str(tmp_path),
                "prompts": [[5, 6, 7]],
                "beside": {"prompts": [[1, 2]], "max_tokens": 8, "after_tokens": 8},
            }
        )


def _output(tokens: list[int], tops: list[tuple[float, float]], alternatives: list[int] | None = None) -> dict:
    alternatives = alternatives or [t + 1 for t in tokens]
    return {
        "token_ids": tokens,
        "logprobs": [{str(t): a, str(alt): b} for t, alt, (a, b) in zip(tokens, alternatives, tops, strict=True)],
    }


def test_same_greedy_output_accepts_only_near_ties():
    ref = _output([10, 20, 30], [(-0.5, -2.0), (-0.70, -0.70 - NEAR_TIE_LOGPROB / 2), (-0.1, -3.0)])
    assert same_greedy_output(ref, ref)[0]
    # The candidate took the reference's second choice where the reference was nearly tied: fine.
    flipped = _output([10, 21, 40], [(-0.5, -2.0), (-0.69, -0.70), (-0.2, -3.0)])
    ok, reason = same_greedy_output(ref, flipped)
    assert ok and "near tie at token 1" in reason
    # A clear winner replaced: a real divergence.
    wrong = _output([11, 20, 30], [(-0.5, -2.0), (-0.7, -0.8), (-0.1, -3.0)])
    ok, reason = same_greedy_output(ref, wrong)
    assert not ok and "diverged at token 0" in reason
    # A near tie, but the candidate's token was neither of the reference's two choices.
    odd = _output([10, 99, 30], [(-0.5, -2.0), (-0.7, -0.8), (-0.1, -3.0)])
    assert not same_greedy_output(ref, odd)[0]
    # Same tokens, shifted logprobs: only the strict check notices.
    shifted = _output([10, 20, 30], [(-0.6, -2.0), (-0.70, -0.71), (-0.1, -3.0)])
    assert same_greedy_output(ref, shifted)[0]
    ok, reason = same_greedy_output(ref, shifted, logprob_atol=1e-3)
    assert not ok and "logprobs differ by 0.1" in reason
    assert not same_greedy_output(ref, _output([10, 20], [(-0.5, -2.0), (-0.7, -0.8)]))[0]  # shorter
    # A one-step tie across batches: accepted only when the candidate saw the same two tokens, swapped, as close.
    step = _output([10, 20, 30], [(-0.5, -2.0), (-2.0, -2.0 - 0.125), (-0.1, -3.0)], alternatives=[11, 21, 31])
    swapped = _output([10, 21, 30], [(-0.5, -2.0), (-2.0, -2.125), (-0.1, -3.0)], alternatives=[11, 20, 31])
    assert not same_greedy_output(step, swapped)[0]
    assert same_greedy_output(step, swapped, ONE_BF16_STEP, mirrored_tie=True)[0]
    sure = _output([10, 21, 30], [(-0.5, -2.0), (-1.5, -2.5), (-0.1, -3.0)], alternatives=[11, 20, 31])
    ok, reason = same_greedy_output(step, sure, ONE_BF16_STEP, mirrored_tie=True)
    assert not ok and "not the same tie" in reason
    assert compare_runs({"outputs": [ref, ref]}, {"outputs": [ref, wrong]}) == [
        "prompt 1: " + same_greedy_output(ref, wrong)[1]
    ]
