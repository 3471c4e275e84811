"""The rate limit on errors a loop meets again and again."""

from __future__ import annotations

import logging

from prefixcache.indexer.log_limits import RepeatedErrors


def test_the_same_error_is_logged_once_per_interval_with_a_count_of_the_others(caplog):
    now = [0.0]
    errors = RepeatedErrors(quiet_s=30, clock=lambda: now[0])
    logger = logging.getLogger("test.limits")
    logged = []
    for second in range(65):
        now[0] = float(second)
        logged.append(errors.log(logger, ConnectionError("refused"), "step failed"))
        errors.log(logger, ValueError(f"other {second // 40}"), "another")
    assert [i for i, yes in enumerate(logged) if yes] == [0, 30, 60]
    messages = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step failed")]
    assert messages == ["step failed", *["step failed (29 more of this error not logged in the last 30s)"] * 2]
    assert all(r.exc_info is not None for r in caplog.records)
    others = [str(r.exc_info[1]) for r in caplog.records if r.getMessage().startswith("another")]
    assert others == ["other 0", "other 0", "other 1"]  # at 0 and 30 s, then another message at once (40 s)
