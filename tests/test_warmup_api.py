"""``/v1/warmup`` with a real job manager and real child processes (no engine: these jobs fail or are cancelled)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from cachestore.auth import AccessPolicy, install_access_policy
from cachestore.processes import free_port
from cachestore.warmup.api import warmup_router
from cachestore.warmup.jobs import WarmupJobs, local_url

TOKEN = "s3cret-token"


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[WarmupJobs]:
    manager = WarmupJobs(tmp_path / "jobs", local_url("0.0.0.0", free_port()), tmp_path / "state")  # nobody listens
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"token_ids": [5, 6, 7]}\n')
    return path


def client(jobs: WarmupJobs, token: str | None = None) -> TestClient:
    app = FastAPI()
    install_access_policy(app, AccessPolicy(admin_token=SecretStr(token) if token else None))
    app.include_router(warmup_router(jobs))
    return TestClient(app)


def wait_finished(api: TestClient, job_id: str) -> dict:
    deadline = time.monotonic() + 120  # a stuck job fails the test instead of hanging it
    while time.monotonic() < deadline:
        job = api.get(f"/v1/warmup/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never finished")


def test_a_job_that_fails_reports_its_exit_code_and_the_end_of_its_log(jobs: WarmupJobs, corpus: Path) -> None:
    api = client(jobs)
    submitted = api.post("/v1/warmup", json={"corpus": str(corpus), "model": "m", "tenant": "acme"})
    assert submitted.status_code == 202
    assert submitted.json()["request"]["tenant"] == "***"  # the salt is never echoed
    job = wait_finished(api, submitted.json()["id"])
    assert (job["status"], job["exit_code"], job["report"]) == ("failed", 2, None)
    assert "cannot read the attach settings" in job["error"]
    assert [j["id"] for j in api.get("/v1/warmup").json()] == [job["id"]]
    assert api.delete(f"/v1/warmup/{job['id']}").status_code == 409


def test_queued_jobs_can_be_cancelled_before_they_start(jobs: WarmupJobs, corpus: Path) -> None:
    api = client(jobs)
    ids = [api.post("/v1/warmup", json={"corpus": str(corpus), "model": "m"}).json()["id"] for _ in range(3)]
    cancelled = api.delete(f"/v1/warmup/{ids[2]}").json()
    assert cancelled["status"] == "cancelled"
    assert [wait_finished(api, i)["status"] for i in ids] == ["failed", "failed", "cancelled"]
    assert wait_finished(api, ids[2])["started_s"] is None  # never ran


def test_bad_requests_are_refused_with_the_field_named(jobs: WarmupJobs, corpus: Path) -> None:
    api = client(jobs)
    cases = [
        ({"corpus": "relative.jsonl", "model": "m"}, "absolute path"),
        ({"corpus": str(corpus.parent / "missing.jsonl"), "model": "m"}, "neither a file nor a folder"),
        ({"corpus": str(corpus), "model": "m", "batch_size": 0}, "greater than or equal to 1"),
        ({"corpus": str(corpus), "model": "m", "on_error": "ignore"}, "'skip' or 'fail'"),
        ({"corpus": str(corpus), "model": "m", "engine_options": ["--dtype\0"]}, "without NUL"),
        ({"corpus": str(corpus), "model": "m", "surprise": 1}, "Extra inputs"),
    ]
    for body, message in cases:
        answer = api.post("/v1/warmup", json=body)
        assert answer.status_code == 422, body
        assert message in answer.text, answer.text
    assert api.get("/v1/warmup").json() == []
    assert api.get("/v1/warmup/0123456789ab").status_code == 404
    assert api.delete("/v1/warmup/0123456789ab").status_code == 404
    assert api.get("/v1/warmup/not-an-id").status_code == 422


def test_submitting_and_cancelling_need_the_admin_token(jobs: WarmupJobs, corpus: Path) -> None:
    api = client(jobs, TOKEN)
    body = {"corpus": str(corpus), "model": "m"}
    assert api.post("/v1/warmup", json=body).status_code == 401
    assert api.get("/v1/warmup").status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    job = api.post("/v1/warmup", json=body, headers=auth).json()
    assert api.delete(f"/v1/warmup/{job['id']}").status_code == 401
    assert api.get(f"/v1/warmup/{job['id']}", headers=auth).status_code == 200


def test_local_url_reaches_a_wildcard_bind_on_loopback() -> None:
    assert local_url("0.0.0.0", 8600) == "http://127.0.0.1:8600"
    assert local_url("10.0.0.5", 8600) == "http://10.0.0.5:8600"
    assert local_url("::1", 8600) == "http://[::1]:8600"
