"""Schemathesis over the generated OpenAPI schema against a real daemon: no request may cause a 5xx."""

# ruff: noqa: F811 - the shared fixtures are imported by name
from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.admin_stack import AUTH, daemon  # noqa: F401 - fixtures

EXAMPLES_PER_OPERATION = 25
#: Schemathesis waits 10 s for an answer by default; the first lookup by text imports transformers, which took
#: longer than that on a 2-core machine running vLLM engines beside this test.
RESPONSE_TIMEOUT_S = 60


def test_no_request_makes_the_daemon_fail(daemon):
    """Every operation, authorised. Warm-up included: this daemon has no warm-up roots, so it refuses every job
    (400) before an engine could start."""
    schema = schemathesis.openapi.from_url(daemon.url + "/openapi.json")
    checked = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/evict", "/v1/chunks/{key}", "/v1/lookup", "/metrics", "/v1/warmup"} <= {op.path for op in checked}
    for operation in checked:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        def no_server_error(case):
            case.call_and_validate(headers=AUTH, checks=[not_a_server_error], timeout=RESPONSE_TIMEOUT_S)

        no_server_error()
