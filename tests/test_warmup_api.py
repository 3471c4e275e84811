"""``/v1/warmup`` with a real job manager and real child processes (no engine: these jobs fail or are cancelled),
and the operator's rules a job must pass before it is queued (``cachestore/warmup/policy.py``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from prefixcache.cachestore.api.admin_routes import install_error_handlers
from prefixcache.cachestore.api.auth import AccessPolicy, install_access_policy
from prefixcache.cachestore.api.warmup_routes import warmup_router
from prefixcache.cachestore.host.processes import free_port
from prefixcache.cachestore.warmup.jobs import WarmupJobs, WarmupRequest, local_url
from prefixcache.cachestore.warmup.policy import WarmupPolicy, WarmupRefusedError

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """The one warm-up root: the corpus and the model lie here."""
    (tmp_path / "root" / "model").mkdir(parents=True)
    return tmp_path / "root"


@pytest.fixture
def jobs(tmp_path: Path, root: Path) -> Iterator[WarmupJobs]:
    manager = WarmupJobs(
        tmp_path / "jobs", local_url("0.0.0.0", free_port()), tmp_path / "state", policy=WarmupPolicy((root,))
    )  # nobody listens
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture
def corpus(root: Path) -> Path:
    path = root / "corpus.jsonl"
    path.write_text('{"token_ids": [5, 6, 7]}\n')
    return path


@pytest.fixture
def model(root: Path) -> str:
    return str(root / "model")


def client(jobs: WarmupJobs, authorised: bool = True) -> TestClient:
    """The warm-up API; ``authorised``: every request sends the admin token."""
    app = FastAPI()
    install_access_policy(app, AccessPolicy(admin_token=SecretStr(TOKEN)))
    install_error_handlers(app)
    app.include_router(warmup_router(jobs))
    return TestClient(app, headers=AUTH if authorised else None)


def wait_finished(api: TestClient, job_id: str) -> dict:
    deadline = time.monotonic() + 120  # a stuck job fails the test instead of hanging it
    while time.monotonic() < deadline:
        job = api.get(f"/v1/warmup/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} never finished")


def test_a_job_that_fails_reports_its_exit_code_and_the_end_of_its_log(jobs, corpus, model) -> None:
    api = client(jobs)
    submitted = api.post("/v1/warmup", json={"corpus": str(corpus), "model": model, "tenant": "acme"})
    assert submitted.status_code == 202
    assert submitted.json()["request"]["tenant"] == "***"  # the salt is never echoed
    job = wait_finished(api, submitted.json()["id"])
    assert (job["status"], job["exit_code"], job["report"]) == ("failed", 2, None)
    assert "cannot read the attach settings" in job["error"]
    assert [j["id"] for j in api.get("/v1/warmup").json()] == [job["id"]]
    assert api.delete(f"/v1/warmup/{job['id']}").status_code == 409


def test_queued_jobs_can_be_cancelled_before_they_start(jobs, corpus, model) -> None:
    api = client(jobs)
    ids = [api.post("/v1/warmup", json={"corpus": str(corpus), "model": model}).json()["id"] for _ in range(3)]
    cancelled = api.delete(f"/v1/warmup/{ids[2]}").json()
    assert cancelled["status"] == "cancelled"
    assert [wait_finished(api, i)["status"] for i in ids] == ["failed", "failed", "cancelled"]
    assert wait_finished(api, ids[2])["started_s"] is None  # never ran


def test_bad_requests_are_refused_with_the_field_named(jobs, corpus, model) -> None:
    api = client(jobs)
    cases = [
        ({"corpus": str(corpus), "model": model, "batch_size": 0}, "greater than or equal to 1"),
        ({"corpus": str(corpus), "model": model, "on_error": "ignore"}, "'skip' or 'fail'"),
        ({"corpus": str(corpus), "model": model, "engine_options": ["--dtype\0"]}, "without NUL"),
        ({"corpus": str(corpus), "model": model, "surprise": 1}, "Extra inputs"),
    ]
    for body, message in cases:
        answer = api.post("/v1/warmup", json=body)
        assert answer.status_code == 422, body
        assert message in answer.text, answer.text
    assert api.get("/v1/warmup").json() == []
    assert api.get("/v1/warmup/0123456789ab").status_code == 404
    assert api.delete("/v1/warmup/0123456789ab").status_code == 404
    assert api.get("/v1/warmup/not-an-id").status_code == 422


def test_submitting_and_cancelling_need_the_admin_token(jobs, corpus, model) -> None:
    anonymous, api = client(jobs, authorised=False), client(jobs)
    body = {"corpus": str(corpus), "model": model}
    assert anonymous.post("/v1/warmup", json=body).status_code == 401
    assert anonymous.get("/v1/warmup").status_code == 401
    job = api.post("/v1/warmup", json=body).json()
    assert anonymous.delete(f"/v1/warmup/{job['id']}").status_code == 401
    assert api.get(f"/v1/warmup/{job['id']}").status_code == 200


@pytest.mark.parametrize(
    "option",
    [
        ["--trust-remote-code"],
        ["--worker-cls", "evil.Worker"],
        ["--scheduler-cls", "evil.Scheduler"],
        ["--logits-processors", "evil.Processor"],
        ["--hf-overrides", '{"architectures": ["Evil"]}'],
        ["--worker_cls=evil.Worker"],
        ["--config", "/etc/evil.yaml"],
        ["--dtype", "--trust-remote-code"],
        ["-O3"],
        ["positional"],
    ],
    ids=lambda option: option[0],
)
def test_engine_options_outside_the_allowlist_are_refused(jobs, corpus, model, option) -> None:
    answer = client(jobs).post("/v1/warmup", json={"corpus": str(corpus), "model": model, "engine_options": option})
    assert answer.status_code == 400, answer.text
    assert "engine option" in answer.json()["detail"]
    assert client(jobs).get("/v1/warmup").json() == []  # nothing was queued


def test_trust_remote_code_passes_only_when_the_daemon_allows_it(tmp_path, root, corpus, model) -> None:
    allowing = WarmupJobs(
        tmp_path / "jobs",
        "http://127.0.0.1:1",
        tmp_path / "state",
        policy=WarmupPolicy((root,), allow_trust_remote_code=True),
    )
    request = WarmupRequest(corpus=str(corpus), model=model, engine_options=["--trust-remote-code", "--dtype", "half"])
    assert allowing.admit(request).engine_options == request.engine_options
    with pytest.raises(WarmupRefusedError, match="--warmup-allow-trust-remote-code"):
        WarmupPolicy((root,)).check_options(request.engine_options)


def test_allowed_engine_options_pass_as_given(jobs, corpus, model) -> None:
    options = [
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--enforce-eager",
        "--max-num-seqs",
        "4",
        "--kv-cache-dtype=fp8",
        "-tp",
        "2",
        "--gpu-memory-utilization",
        "0.5",
        "--no-enable-prefix-caching",
        "--block_size",
        "16",
        "--seed",
        "7",
    ]
    answer = client(jobs).post("/v1/warmup", json={"corpus": str(corpus), "model": model, "engine_options": options})
    assert answer.status_code == 202 and answer.json()["request"]["engine_options"] == options


def test_paths_outside_the_roots_are_refused_alike_whether_they_exist_or_not(jobs, tmp_path, root, corpus, model):
    api = client(jobs)
    outside = tmp_path / "outside.jsonl"
    outside.write_text('{"token_ids": [5, 6, 7]}\n')
    (root / "escape").symlink_to(tmp_path)  # resolved before it is checked
    answers = {
        name: api.post("/v1/warmup", json=body)
        for name, body in {
            "outside": {"corpus": str(outside), "model": model},
            "through a symlink": {"corpus": str(root / "escape" / "outside.jsonl"), "model": model},
            "dot-dot": {"corpus": f"{root}/../outside.jsonl", "model": model},
            "missing inside": {"corpus": str(root / "missing.jsonl"), "model": model},
            "missing outside": {"corpus": str(tmp_path / "missing.jsonl"), "model": model},
            "relative": {"corpus": "corpus.jsonl", "model": model},
        }.items()
    }
    assert {name: a.status_code for name, a in answers.items()} == dict.fromkeys(answers, 400)
    assert len({a.json()["detail"] for a in answers.values()}) == 1  # nothing tells what exists where
    assert str(tmp_path) not in answers["outside"].text
    for field, value in (("model", "/etc"), ("tokenizer", str(tmp_path)), ("model", "facebook/opt-125m")):
        body = {"corpus": str(corpus), "model": model, field: value}
        answer = api.post("/v1/warmup", json=body)
        assert answer.status_code == 400 and answer.json()["detail"].startswith(field), answer.text
    assert api.get("/v1/warmup").json() == []


def test_without_warm_up_roots_every_job_is_refused(tmp_path, corpus, model) -> None:
    nowhere = WarmupJobs(tmp_path / "jobs", "http://127.0.0.1:1", tmp_path / "state")
    answer = client(nowhere).post("/v1/warmup", json={"corpus": str(corpus), "model": model})
    assert answer.status_code == 400 and "--warmup-root" in answer.json()["detail"]


def test_a_422_never_echoes_what_was_sent(jobs, corpus, model) -> None:
    secret = "very-secret-value-" + "x" * 5000
    answers = [
        client(jobs).post("/v1/warmup", json={"corpus": str(corpus), "model": model, "batch_size": secret}),
        client(jobs).post("/v1/warmup", json={"corpus": str(corpus), "model": model, secret: 1}),
        client(jobs).post("/v1/warmup", json={"corpus": str(corpus), "model": secret + "y" * 5000}),
    ]
    assert [a.status_code for a in answers] == [422] * 3
    assert all("very-secret" not in a.text and len(a.text) < 1000 for a in answers[:1] + answers[2:])


def test_local_url_reaches_a_wildcard_bind_on_loopback() -> None:
    assert local_url("0.0.0.0", 8600) == "http://127.0.0.1:8600"
    assert local_url("10.0.0.5", 8600) == "http://10.0.0.5:8600"
    assert local_url("::1", 8600) == "http://[::1]:8600"


def test_a_job_gets_the_index_password_on_stdin_and_none_of_the_daemons_secrets(
    tmp_path, root, corpus, model, monkeypatch
) -> None:
    """The job's command is replaced by a script that records what it was given."""
    dump = tmp_path / "dump"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nenv > {dump}.env\necho "$@" > {dump}.argv\ncat > {dump}.stdin\n')
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    secrets = {
        "PREFIXCACHE_ADMIN_TOKEN": "admin-secret-0123456789",
        "PREFIXCACHE_REDIS_PASSWORD": "env-password",
        "PREFIXCACHE_REDIS_URL": "redis://:url-password@127.0.0.1:1/0",
        "PREFIXCACHE_CHUNK_KEY": "k3y-value",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    jobs = WarmupJobs(
        tmp_path / "jobs",
        "http://127.0.0.1:1",
        tmp_path / "state",
        policy=WarmupPolicy((root,)),
        redis_password="index-password",
    )
    jobs.start()
    try:
        api = client(jobs)
        job = api.post("/v1/warmup", json={"corpus": str(corpus), "model": model, "tenant": "acme"}).json()
        assert wait_finished(api, job["id"])["exit_code"] == 0
    finally:
        jobs.stop()
    assert Path(f"{dump}.stdin").read_text() == "index-password\n"
    assert "--redis-password-stdin" in Path(f"{dump}.argv").read_text()
    env = Path(f"{dump}.env").read_text()
    assert "PREFIXCACHE_WARMUP_TENANT=acme" in env and "PATH=" in env
    assert not [value for value in (*secrets.values(), "url-password", "index-password") if value in env]
