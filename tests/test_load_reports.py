"""Loads over and failed, from reports aggregated as vLLM does: a request is over once every rank is, while each
rank's damaged blocks come in the step that rank reported them."""

from prefixcache.connector.load_reports import LoadReports


def test_a_synchronous_load_is_over_with_its_step_and_fails_by_its_own_blocks():
    reports = LoadReports()
    reports.start_step({"a": frozenset({1, 2}), "b": frozenset({3})})
    assert reports.report((), {2, 9}) == {"a": {2}}
    assert reports.report((), {3}) == {}  # b's step is over: a later report is not b's


def test_a_rank_that_fails_before_the_others_are_over_fails_the_load_once_when_it_is_over():
    reports = LoadReports()
    reports.start_async("a", frozenset({4, 5, 6}))
    reports.start_async("b", frozenset({7}))
    assert reports.report((), {5}) == {}  # one rank failed; the others still load
    assert reports.in_flight("a") and reports.any_in_flight()
    assert reports.report((), {5, 6}) == {}  # another rank fails, still before the last is over
    assert reports.report({"a"}, ()) == {"a": {5, 6}}
    assert not reports.in_flight("a") and reports.report({"b"}, ()) == {}
    assert not reports.any_in_flight()


def test_a_load_is_failed_by_blocks_reported_with_its_end():
    reports = LoadReports()
    reports.start_async("a", frozenset({1}))
    assert reports.report({"a"}, {1}) == {"a": {1}}
    reports.start_async("a", frozenset({1}))  # tried again
    assert reports.report({"a"}, ()) == {}  # the first try's failure counted once
