"""What every request passes before an endpoint sees it (``cachestore/api/http_guards.py``), on the API's own app
(``create_app``, in process), and the rules for warm-up children (``cachestore/warmup/policy.py``) as pure logic."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from prefixcache.cachestore.api.app import create_app
from prefixcache.cachestore.api.auth import AccessPolicy
from prefixcache.cachestore.api.http_guards import install_http_guards, trusted_hosts
from prefixcache.cachestore.client.config import ClientConfig, MooncakeConfig
from prefixcache.cachestore.node.settings import Settings
from prefixcache.cachestore.warmup.corpus import read_corpus
from prefixcache.cachestore.warmup.policy import check_engine_options, is_secret_variable, scrubbed_environment

MOONCAKE = MooncakeConfig(
    master="m:1", metadata_url="http://m", protocol="tcp", device_names="", shm_address="s:1", segment="g:1"
)
CONFIG = ClientConfig(
    node="node-a",
    redis_url="redis://127.0.0.1:1/0",
    redis_password_required=False,
    key_prefix="pc",
    chunk_tokens=256,
    mooncake=MOONCAKE,
)


def app(**options) -> TestClient:
    """The API with its health and config endpoints (no stack behind it); ``/v1/lookup`` is there as no endpoint:
    the guards answer before routing."""
    return TestClient(
        create_app(CONFIG, {}, lambda: None, access=AccessPolicy(), **options), base_url="http://127.0.0.1"
    )


def test_only_known_host_names_are_answered():
    api = app(allowed_hosts=trusted_hosts("0.0.0.0", "node-a", extra=["cache.example.internal"]))
    for host in ("127.0.0.1", "localhost", "[::1]:8600", "node-a", "NODE-A:8600", "cache.example.internal"):
        assert api.get("/v1/config", headers={"Host": host}).status_code == 200, host
    for host in ("evil.example", "evil.example:8600", "0.0.0.0", "127.0.0.1.evil.example", "", "[::2]"):
        answer = api.get("/v1/health", headers={"Host": host})
        assert answer.status_code == 400 and answer.text == "Invalid host header", host


def test_trusted_hosts_names_loopback_the_bind_address_and_the_node():
    assert trusted_hosts("10.0.0.5", "gpu-1") == ["localhost", "127.0.0.1", "[::1]", "10.0.0.5", "gpu-1"]
    assert trusted_hosts("::", "gpu-1", extra=["fe80::1"]) == ["localhost", "127.0.0.1", "[::1]", "gpu-1", "[fe80::1]"]


def test_a_body_over_the_limit_is_refused_before_it_is_read():
    api = app(max_body_bytes=4096)
    declared = api.post("/v1/lookup", content=b"x" * 5000)
    assert declared.status_code == 413 and "at most 4096 bytes" in declared.text

    def chunks():
        for _ in range(10):
            yield b"x" * 1000

    streamed = api.post("/v1/lookup", content=chunks())  # no Content-Length: chunked
    assert streamed.status_code == 413
    assert api.post("/v1/lookup", content=b"x" * 4096).status_code == 404  # at the limit: on to routing


def test_a_chunked_body_under_the_limit_reaches_the_endpoint_whole():
    echo = FastAPI()
    install_http_guards(echo, ["testserver"], 4096)

    @echo.post("/echo")
    async def body(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    def chunks():
        yield b"a" * 1000
        yield b"b" * 3000

    assert TestClient(echo).post("/echo", content=chunks()).json() == {"bytes": 4000}


def test_settings_for_hosts_bodies_and_warm_up(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_ALLOWED_HOSTS", "cache.example, 10.0.0.7")
    monkeypatch.setenv("PREFIXCACHE_WARMUP_ROOTS", f"{tmp_path}{os.pathsep}{tmp_path}/../{tmp_path.name}")
    s = Settings(data_dir=tmp_path)
    assert s.allowed_hosts == ["cache.example", "10.0.0.7"] and s.warmup_roots == [tmp_path.resolve()] * 2
    assert s.max_body_bytes == 16 << 20 and not s.warmup_allow_trust_remote_code and s.admin_token is None
    for bad in (
        {"allowed_hosts": ["evil/path"]},
        {"warmup_roots": ["relative"]},
        {"warmup_roots": [str(tmp_path / "missing")]},
        {"max_body_bytes": 10},
    ):
        with pytest.raises(ValueError):
            Settings(data_dir=tmp_path, **bad)


def test_the_childs_environment_carries_no_secret():
    daemon_env = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "PREFIXCACHE_DATA_DIR": "/data",
        "PREFIXCACHE_ADMIN_TOKEN": "t0ken",
        "PREFIXCACHE_REDIS_PASSWORD": "pw",
        "PREFIXCACHE_REDIS_URL": "redis://:pw@x",
        "PREFIXCACHE_CHUNK_SIGNING_KEY": "k",
        "PREFIXCACHE_ADMIN_TOKEN_FILE": "/s",
        "prefixcache_some_secret": "s",
        "PREFIXCACHE_WEBHOOK_PASSWORD": "p",
        "PREFIXCACHE_NODE": "node-a",
    }
    child = scrubbed_environment(daemon_env)
    assert child == {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "PREFIXCACHE_DATA_DIR": "/data",
        "PREFIXCACHE_NODE": "node-a",
    }
    assert not any(is_secret_variable(name) for name in child)
    assert not {"pw", "t0ken", "k", "s", "p"} & set(child.values())


def test_engine_option_values_are_checked():
    check_engine_options(["--dtype=half", "--max-model-len", "32k", "--max-num-batched-tokens", "8192"])
    bad_values = [
        ["--dtype", "int3"],
        ["--block-size", "0"],
        ["--gpu-memory-utilization", "2"],
        ["--seed", "-1"],
        ["--served-model-name", "a b"],
        ["--enforce-eager=yes"],
        ["--max-model-len"],
        ["--tokenizer-mode", "custom"],
    ]
    for bad in bad_values:
        with pytest.raises(ValueError):
            check_engine_options(bad)


def test_a_folder_corpus_reads_only_regular_files_inside_it(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the daemon user's private file")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "other.txt").write_text("another folder's prompt")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("first prompt")
    (corpus / "sub" / "b.txt").write_text("second prompt")
    (corpus / "sub" / "inside-link.txt").symlink_to(corpus / "a.txt")
    (corpus / "leak.txt").symlink_to(secret)
    (corpus / "linked-dir").symlink_to(tmp_path / "outside", target_is_directory=True)
    (corpus / ".hidden").write_text("left out")
    os.mkfifo(corpus / "fifo")
    read = read_corpus(corpus)
    assert [p.key for p in read.prompts] == ["a.txt", "sub/b.txt"] and read.problems == []
    assert all("private" not in (p.text or "") and "another" not in (p.text or "") for p in read.prompts)


def test_folder_corpus_order_and_digest_are_those_of_path_order(tmp_path: Path):
    for name in ("a-b", "a/b", "a/c", "b"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    assert [p.key for p in read_corpus(tmp_path).prompts] == ["a/b", "a/c", "a-b", "b"]
