"""The REST API as an attacker on the same host meets it: real ``prefixcache serve`` processes, started as an
operator would (a default start, and one with open reads on a wildcard bind).

Every operation of the daemon's own OpenAPI schema is tried, so an endpoint added later is covered too."""

from __future__ import annotations

import http.client
import json
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.api.auth import admin_token_path
from prefixcache.cachestore.host.secret_files import secrets_dir
from tests.daemon_harness import Daemon, make_spec, run_cli

OPEN = {("GET", "/v1/health"), ("GET", "/v1/live"), ("GET", "/v1/config")}
#: Read-only operations that are not GETs (a lookup takes its prompt as a body); every other non-GET changes state.
READS_BY_POST = {("POST", "/v1/lookup")}
OPERATOR_TOKEN = "operator-set-token-0123456789"
BODIES = {
    "/v1/evict": {"all": True, "force": True},
    "/v1/pin": {"keys": ["0" * 32]},
    "/v1/unpin": {"keys": ["0" * 32]},
    "/v1/warmup": {"corpus": "/etc/passwd", "model": "/", "engine_options": ["--trust-remote-code"]},
    "/v1/lookup": {"namespace": "0" * 32, "token_ids": [1]},
}


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon started with no security setting at all."""
    d = Daemon(tmp_path_factory.mktemp("default") / "data").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Open reads, an operator's token, every address, one more Host name, a 1 MiB body limit."""
    options = [
        "--open-reads",
        "--admin-token",
        OPERATOR_TOKEN,
        "--host",
        "0.0.0.0",
        "--allowed-host",
        "cache.example.internal",
        "--max-body-bytes",
        "1MiB",
    ]
    d = Daemon(tmp_path_factory.mktemp("opened") / "data", *options).start()
    yield d
    d.stop()


def operations(daemon: Daemon) -> list[tuple[str, str]]:
    """(method, path with its parameters filled in) of every operation the daemon documents."""
    schema = httpx.get(daemon.url + "/openapi.json").json()
    filled = {"{key}": "0" * 32, "{job_id}": "0123456789ab"}
    found = []
    for path, methods in schema["paths"].items():
        for name, value in filled.items():
            path = path.replace(name, value)
        found += [(method.upper(), path) for method in methods]
    return sorted(found)


def call(daemon: Daemon, method: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = BODIES.get(path) if method != "GET" else None
    return httpx.request(method, daemon.url + path, json=body, headers=headers, timeout=30)


def test_every_call_but_the_probes_and_config_needs_the_token_on_a_default_start(default):
    tried = [op for op in operations(default) if op not in OPEN]
    mutating = [(m, p) for m, p in tried if m != "GET" and (m, p) not in READS_BY_POST]
    assert {("POST", "/v1/warmup"), ("POST", "/v1/evict"), ("DELETE", "/v1/chunks/" + "0" * 32)} <= set(mutating)
    for method, path in tried:
        for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": "Basic eDp5"}):
            answer = call(default, method, path, headers)
            assert answer.status_code == 401, (method, path, headers, answer.text)
            assert answer.headers["www-authenticate"] == "Bearer"
    for method, path in OPEN:
        assert call(default, method, path).status_code == 200
    authorised = call(default, "POST", "/v1/evict", default.headers)
    assert authorised.status_code == 200 and authorised.json()["dry_run"] is False
    print(f"unauthenticated calls accepted: 0 of {len(tried)} tried ({len(mutating)} mutating, warm-up included)")


def test_open_reads_open_reads_only(opened):
    tried = [op for op in operations(opened) if op not in OPEN]
    reads = [(m, p) for m, p in tried if m == "GET" or (m, p) in READS_BY_POST]
    for method, path in tried:
        answer = call(opened, method, path)
        if (method, path) in reads:
            assert answer.status_code != 401, (method, path, answer.text)
        else:
            assert answer.status_code == 401, (method, path, answer.text)
    assert call(opened, "POST", "/v1/evict", {"Authorization": f"Bearer {OPERATOR_TOKEN}"}).status_code == 200


def test_the_generated_token_is_private_kept_across_restarts_and_never_logged(default):
    path = admin_token_path(secrets_dir(default.data_dir))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = default.token
    assert len(token) >= 32
    config = httpx.get(default.url + "/v1/config").json()
    assert config["secret_files"]["admin_token"] == str(path) and token not in json.dumps(config)
    default.stop()
    default.start()
    assert default.token == token and httpx.get(default.url + "/v1/stats", headers=default.headers).status_code == 200
    log = "".join(default.log_path.read_text().split())  # rich wraps long lines
    assert f"admintokenin{path}" in log and token not in log


def test_the_cli_finds_the_generated_token_without_being_told(default):
    stats = run_cli(default, "stats", "--json")
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["node"] == "node-a"
    assert "would evict 0 chunks" in run_cli(default, "evict", "--all", "--dry-run").stdout


def test_the_cli_says_what_to_do_when_it_has_no_token(opened):
    refused = run_cli(opened, "evict", "--all")
    assert refused.returncode == 2
    message = " ".join(refused.stderr.split())
    assert "operator-set admin token: pass --token or set PREFIXCACHE_ADMIN_TOKEN" in message
    assert len(refused.stderr.strip().splitlines()) == 1 and OPERATOR_TOKEN not in refused.stderr
    assert run_cli(opened, "stats").returncode == 0  # open reads need none
    assert "evicted 0 chunks" in run_cli(opened, "evict", "--all", token=OPERATOR_TOKEN).stdout


def test_foreign_host_names_are_refused_on_any_bind_address(default, opened):
    for daemon, allowed in (
        (default, ["localhost", "127.0.0.1", "node-a"]),
        (opened, ["localhost", "127.0.0.1", "node-a", "cache.example.internal"]),
    ):
        for host in allowed:
            assert httpx.get(daemon.url + "/v1/health", headers={"Host": f"{host}:{daemon.port}"}).status_code == 200
        for host in ("evil.example", f"evil.example:{daemon.port}", "0.0.0.0", "cache.example.internal.evil"):
            answer = httpx.post(daemon.url + "/v1/evict", json={"all": True}, headers={"Host": host, **daemon.headers})
            assert answer.status_code == 400 and answer.text == "Invalid host header", (daemon.args, host)


def raw_request(daemon: Daemon, head: list[str], body_parts: list[bytes] = ()) -> tuple[int, bytes]:
    """Status and body of a request written by hand: its head, then what of its body is given (maybe not all)."""
    connection = http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)
    connection.putrequest("POST", "/v1/lookup", skip_accept_encoding=True)
    for line in head:
        connection.putheader(*line.split(": ", 1))
    connection.putheader("Authorization", daemon.headers["Authorization"])
    connection.endheaders()
    for part in body_parts:
        connection.send(part)
    response = connection.getresponse()
    try:
        return response.status, response.read()
    finally:
        connection.close()


def rss_bytes(pid: int) -> int:
    (line,) = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:")]
    return int(line.split()[1]) << 10


def test_a_body_over_the_limit_gets_413_before_it_is_read(default, opened):
    before = rss_bytes(default.proc.pid)
    status, body = raw_request(default, ["Content-Type: application/json", f"Content-Length: {200 << 20}"])
    assert status == 413 and b"at most 16777216 bytes" in body  # answered with none of the 200 MiB sent
    assert rss_bytes(default.proc.pid) - before < 32 << 20
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b" " * (64 << 10))  # 17 chunks of 64 KiB pass the 1 MiB limit
    status, body = raw_request(opened, ["Content-Type: application/json", "Transfer-Encoding: chunked"], [chunk] * 17)
    assert status == 413 and b"at most 1048576 bytes" in body
    fits = b'{"namespace": "' + b"0" * 32 + b'", "token_ids": [1]}'
    status, _ = raw_request(
        opened,
        ["Content-Type: application/json", "Transfer-Encoding: chunked"],
        [b"%x\r\n%s\r\n0\r\n\r\n" % (len(fits), fits)],
    )
    assert status == 404  # read whole, on to the endpoint: no such namespace


def test_a_422_never_echoes_the_input_and_tiny_chunks_are_refused(default):
    secret = "pasted-secret-" + "z" * 100_000
    both = {"namespace": "0" * 32, "text": secret, "token_ids": [1]}
    answers = [
        httpx.post(default.url + "/v1/evict", json={"keys": [secret]}, headers=default.headers),
        httpx.post(default.url + "/v1/lookup", json=both, headers=default.headers),
        httpx.post(default.url + "/v1/pin", content=b'{"keys": ["' + secret.encode(), headers=default.headers),
    ]
    assert [a.status_code for a in answers] == [422] * 3
    assert all("pasted-secret" not in a.text and len(a.text) < 2000 for a in answers), [a.text for a in answers]
    spec = {**make_spec(1).model_dump(), "chunk_tokens": 1}
    tiny = httpx.post(
        default.url + "/v1/evict",
        json={"prefix": {"spec": spec, "token_ids": list(range(10_000))}, "dry_run": True},
        headers=default.headers,
    )
    assert tiny.status_code == 422 and "chunk_tokens must be at least 16" in tiny.text
    assert (
        httpx.post(
            default.url + "/v1/lookup",
            json={"spec": make_spec(16).model_dump(), "token_ids": [1] * 64},
            headers=default.headers,
        ).status_code
        == 200
    )
