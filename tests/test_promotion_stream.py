"""Pure logic of streamed promotion: how the daemon cuts its answers, and how loads are cut into runs."""

from __future__ import annotations

from prefixcache.cachestore.chunks.runs import runs_of_about
from prefixcache.cachestore.services.promotion import _Request

A, B, C, D = (bytes([i]) * 16 for i in range(1, 5))


def test_a_request_is_answered_in_order_and_only_for_a_contiguous_decided_run():
    request = _Request("P:pr:1", [A, B, C, D])
    assert request.next_fragment({B: True}) is None  # A is not decided yet: nothing can be said
    assert request.next_fragment({A: True, B: True}) == "0:11"
    assert request.next_fragment({A: True, B: True}) is None  # already answered
    assert request.next_fragment({A: True, B: True, C: False, D: True}) == "2:01"
    assert request.answered == 4


def test_runs_close_once_they_reach_the_limit_and_always_hold_an_item():
    sizes = {"a": 3, "b": 3, "c": 10, "d": 1}
    assert runs_of_about(list("abcd"), sizes.__getitem__, 5) == [["a", "b"], ["c"], ["d"]]
    assert runs_of_about([], sizes.__getitem__, 5) == []
