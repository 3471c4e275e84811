"""Comparing greedy outputs of two engine runs (items of ``run_vllm``'s ``outputs``).

Two correct ways of computing a prompt (a full prefill, or a prefix loaded from the cache plus the rest) need not
be bit-identical: different prefill chunk boundaries round differently in bf16 (measured on the tiny model: up to
0.11 in a logprob; a prefix loaded from vLLM's own cache at the same chunk boundaries: exactly 0). So greedy
outputs are "the same" when their tokens are equal, or when they first differ where the reference itself was
undecided: its top two logprobs within ``NEAR_TIE_LOGPROB`` and the candidate took the reference's second choice.
"""

from __future__ import annotations

NEAR_TIE_LOGPROB = 0.05
"""At a divergence, the reference's top-1 minus top-2 logprob below this counts as a tie (rounding may flip it).

bf16 logits of the tiny model (initializer_range 0.2) are a few tens in size, so they are multiples of 0.125 or
0.25 and a real gap is at least that: below 0.05 means an exact tie of the bf16 logits."""

ONE_BF16_STEP = 0.13
"""A lead of one bf16 step of a logit in [16, 32) (0.125), for comparisons of KV computed in different batches.

A warm-up job computes a prompt's KV inside a batch with other prompts; a lone prefill of the same tokens takes
other GEMM shapes. On this project's AVX2-only CI machine the two differ by up to 0.18 in a logprob (measured:
the first token of a 512-token prompt served from chunks a warm-up batch computed), enough to swap a one-step
lead. Used only with ``mirrored_tie``: the candidate must then see the same two tokens, swapped, as close."""


def _position(logprobs: dict) -> list[tuple[int, float]]:
    """One position's alternatives, best first; keys may be ints or (from JSON) strings."""
    return sorted(((int(t), float(lp)) for t, lp in logprobs.items()), key=lambda item: -item[1])


def first_divergence(reference: dict, candidate: dict) -> int | None:
    """Index of the first generated token that differs (or where one output is shorter), else None."""
    a, b = reference["token_ids"], candidate["token_ids"]
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def max_logprob_diff(reference: dict, candidate: dict, upto: int | None = None) -> float:
    """Largest difference of the chosen tokens' logprobs over the first ``upto`` positions (default: all shared)."""
    n = min(len(reference["logprobs"]), len(candidate["logprobs"]))
    if upto is not None:
        n = min(n, upto)
    worst = 0.0
    for i in range(n):
        ref, cand = reference["logprobs"][i], candidate["logprobs"][i]
        token = str(reference["token_ids"][i])
        ref_lp = ref.get(token, ref.get(int(token)))
        cand_lp = cand.get(token, cand.get(int(token)))
        if ref_lp is not None and cand_lp is not None:
            worst = max(worst, abs(float(ref_lp) - float(cand_lp)))
    return worst


def same_greedy_output(
    reference: dict,
    candidate: dict,
    tolerance: float = NEAR_TIE_LOGPROB,
    logprob_atol: float | None = None,
    mirrored_tie: bool = False,
) -> tuple[bool, str]:
    """Whether ``candidate`` generated what ``reference`` did, up to near-ties; returns (ok, reason).

    ``reference`` and ``candidate`` are per-prompt outputs (``{"token_ids", "logprobs", ...}``). With
    ``logprob_atol``, the chosen tokens' logprobs must also agree within it up to the first divergence (a stricter
    check that catches wrong KV which happens not to change the greedy tokens). With ``mirrored_tie``, a near tie
    counts only if the candidate's own top two are the reference's two, swapped, within ``tolerance`` too.
    """
    at = first_divergence(reference, candidate)
    upto = at if at is not None else len(reference["token_ids"])
    diff = max_logprob_diff(reference, candidate, upto)
    if logprob_atol is not None and diff > logprob_atol:
        return False, f"logprobs differ by {diff:.4g} > {logprob_atol} before token {upto}"
    if at is None:
        return True, f"identical {len(reference['token_ids'])} tokens (max logprob diff {diff:.4g})"
    ref_ids, cand_ids = reference["token_ids"], candidate["token_ids"]
    if at >= len(ref_ids) or at >= len(cand_ids):
        return False, f"lengths differ: reference {len(ref_ids)} tokens, candidate {len(cand_ids)}"
    if at >= len(reference["logprobs"]):
        return False, f"token {at} differs ({ref_ids[at]} vs {cand_ids[at]}) and the reference has no logprobs there"
    alternatives = _position(reference["logprobs"][at])
    if len(alternatives) < 2:
        return False, f"token {at} differs ({ref_ids[at]} vs {cand_ids[at]}); reference lacks top-2 logprobs"
    (top1, lp1), (top2, lp2) = alternatives[0], alternatives[1]
    gap = lp1 - lp2
    where = (
        f"token {at}: reference {ref_ids[at]}, candidate {cand_ids[at]}; "
        f"reference top-2 {top1}:{lp1:.4f} {top2}:{lp2:.4f}"
    )
    if gap >= tolerance or cand_ids[at] not in (top1, top2):
        return False, f"diverged at {where} (gap {gap:.4f} >= {tolerance})"
    if mirrored_tie:
        theirs = _position(candidate["logprobs"][at]) if at < len(candidate["logprobs"]) else []
        if len(theirs) < 2 or [t for t, _ in theirs[:2]] != [top2, top1] or theirs[0][1] - theirs[1][1] >= tolerance:
            return False, f"diverged at {where}; the candidate's top-2 {theirs[:2]} is not the same tie, swapped"
    return True, f"near tie at {where} (gap {gap:.4f} < {tolerance})"


def compare_runs(
    reference: dict, candidate: dict, tolerance: float = NEAR_TIE_LOGPROB, logprob_atol: float | None = None
) -> list[str]:
    """Compare every prompt of two ``run_vllm`` results; returns the problems, one line each (empty: same)."""
    refs, cands = reference["outputs"], candidate["outputs"]
    if len(refs) != len(cands):
        return [f"{len(refs)} reference outputs vs {len(cands)} candidate outputs"]
    problems = []
    for i, (ref, cand) in enumerate(zip(refs, cands, strict=True)):
        ok, reason = same_greedy_output(ref, cand, tolerance, logprob_atol)
        if not ok:
            problems.append(f"prompt {i}: {reason}")
    return problems
