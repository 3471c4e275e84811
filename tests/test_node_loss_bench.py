"""The arithmetic of benchmarks/node_loss.py: what one way to lose a node is summed up as."""

from __future__ import annotations

from benchmarks.node_loss import Request, summary

COLD = {0: (1.5, "a"), 1: (2.0, "b")}


def request(phase: str, at_s: float, prompt: int, ttft_s: float, cached: int, same: bool = True, failed: bool = False):
    return Request("frozen", phase, at_s, prompt, ttft_s, cached, same, failed)


def test_a_way_is_summed_up_against_the_cold_recompute_of_each_prompt():
    requests = [
        request("before", -3.0, 0, 0.1, 1099),
        request("before", -2.0, 1, 2.0, 1099),  # a load past its deadline, recomputed: not a hit
        request("before", -1.0, 1, 0.1, 1099),  # the same prompt again, hit: each prompt counts once
        request("lost", 0.0, 0, 3.3, 1099),  # the load under way at the loss: 1.8 s over its cold 1.5 s, no hit
        request("lost", 3.4, 1, 2.3, 0),  # 0.3 s over: skipped, not yet at the cold time
        request("lost", 5.8, 0, 1.5, 0),  # skipped at once
        request("back", 16.0, 1, 2.0, 0),
        request("back", 18.5, 0, 0.1, 1099, same=False),
        request("back", 18.7, 1, 0.0, 0, failed=True),
    ]
    s = summary(requests, COLD, lost_s=15.0)
    assert (s["worst_ttft_s"], s["cold_ttft_s"], s["worst_over_cold_s"]) == (3.3, 1.5, 1.8)
    assert s["skipped_after_s"] == 3.4  # the first that missed within 0.5 s of its cold time
    assert s["hits_while_lost"] == 0  # vLLM counts a failed, recomputed load as cached: not a hit
    assert s["hits_again_after_s"] == 3.5  # 18.5 s after the loss, A back at 15 s
    assert (s["failed"], s["answers_differing"], s["hits_before"], s["requests"]) == (1, 1, 2, 9)
