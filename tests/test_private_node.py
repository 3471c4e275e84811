"""A default ``prefixcache serve`` tried as another local user would: its index answers nobody without the
password and refuses what could wipe or reconfigure it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from cachestore.client import CacheClient, fetch_config
from cachestore.secrets_store import secrets_dir
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("private") / "data").start()
    yield daemon
    daemon.stop()


def redis_cli(daemon: Daemon, *command: str, password: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password  # as -a would, without the warning (or the password in ps)
    result = subprocess.run(["redis-cli", "-p", str(daemon.port + 1), *command], capture_output=True, text=True,
                            timeout=10, env=env)  # fmt: skip
    return result.stdout + result.stderr


def password_of(daemon: Daemon) -> str:
    return (secrets_dir(daemon.data_dir) / "redis-password").read_text().strip()


def test_the_embedded_index_answers_nobody_without_the_password(node):
    assert "NOAUTH" in redis_cli(node, "GET", "pc:ns")
    assert "NOAUTH" in redis_cli(node, "FLUSHALL")
    assert "WRONGPASS" in redis_cli(node, "PING", password="guessed")
    assert redis_cli(node, "PING", password=password_of(node)).strip() == "PONG"


def test_with_the_password_what_could_wipe_or_reconfigure_the_index_is_refused(node):
    password = password_of(node)
    for command in (["CONFIG", "GET", "*"], ["CONFIG", "SET", "appendonly", "no"], ["FLUSHALL"], ["FLUSHDB"],
                    ["SHUTDOWN", "NOSAVE"], ["MODULE", "LIST"], ["BGSAVE"], ["ACL", "SETUSER", "default", "+@all"],
                    ["REPLICAOF", "127.0.0.1", "1"], ["MONITOR"], ["KEYS", "*"]):  # fmt: skip
        assert "NOPERM" in redis_cli(node, *command, password=password), command
    assert httpx.get(node.url + "/v1/health").json()["status"] == "ready"  # SHUTDOWN did not


def test_the_config_names_the_password_file_and_never_the_password(node):
    config = httpx.get(node.url + "/v1/config").json()
    password = password_of(node)
    assert config["redis_password_required"] is True
    assert config["secret_files"]["redis_password"] == str(secrets_dir(node.data_dir) / "redis-password")
    assert password not in str(config) and password not in node.log_path.read_text()
    redis_argv = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in os.listdir("/proc") if pid.isdigit()
                  and Path(f"/proc/{pid}/comm").exists() and b"redis-server" in _comm(pid)]  # fmt: skip
    assert redis_argv and not any(password.encode() in argv for argv in redis_argv)  # not in ps


def _comm(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes()
    except OSError:
        return b""


def test_a_client_finds_the_password_in_the_file_the_daemon_names(node):
    client = CacheClient.connect(node.url, make_spec(), arena_bytes=16 << 20)
    try:
        assert client.index.url != fetch_config(node.url).redis_url  # the password was added
        keys, payloads = publish_prompt(client, list(range(64 * 2)))
        assert fetch_payloads(client, keys) == payloads
    finally:
        client.close()


def test_an_unauthenticated_client_of_the_index_gets_no_data(node):
    with redis.Redis(port=node.port + 1) as anonymous, pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.hgetall("pc:ns")
