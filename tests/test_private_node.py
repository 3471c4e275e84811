"""A default ``prefixcache serve`` tried as another local user would: its index answers nobody without the
password and refuses what could wipe or reconfigure it, and nothing under its data dir is readable but by its user."""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.config import fetch_config
from prefixcache.cachestore.host.secret_files import secrets_dir
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_persisted


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("private") / "data").start()
    yield daemon
    daemon.stop()


def redis_cli(daemon: Daemon, *command: str, password: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
    if password is not None:
        env["REDISCLI_AUTH"] = password  # as -a would, without the warning (or the password in ps)
    result = subprocess.run(
        ["redis-cli", "-p", str(daemon.port + 1), *command], capture_output=True, text=True, timeout=10, env=env
    )
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
    for command in (
        ["CONFIG", "GET", "*"],
        ["CONFIG", "SET", "appendonly", "no"],
        ["FLUSHALL"],
        ["FLUSHDB"],
        ["SHUTDOWN", "NOSAVE"],
        ["MODULE", "LIST"],
        ["BGSAVE"],
        ["ACL", "SETUSER", "default", "+@all"],
        ["REPLICAOF", "127.0.0.1", "1"],
        ["MONITOR"],
        ["KEYS", "*"],
    ):
        assert "NOPERM" in redis_cli(node, *command, password=password), command
    assert httpx.get(node.url + "/v1/health").json()["status"] == "ready"  # SHUTDOWN did not


def test_the_config_names_the_password_file_and_never_the_password(node):
    config = httpx.get(node.url + "/v1/config").json()
    password = password_of(node)
    assert config["redis_password_required"] is True
    assert config["secret_files"]["redis_password"] == str(secrets_dir(node.data_dir) / "redis-password")
    assert password not in str(config) and password not in node.log_path.read_text()
    redis_argv = [
        Path(f"/proc/{pid}/cmdline").read_bytes()
        for pid in os.listdir("/proc")
        if pid.isdigit() and Path(f"/proc/{pid}/comm").exists() and b"redis-server" in _comm(pid)
    ]
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


def _not_private(root: Path) -> list[str]:
    wrong = []
    for directory, dirs, files in os.walk(root):
        for name in dirs:
            mode = stat.S_IMODE(os.lstat(os.path.join(directory, name)).st_mode)
            if mode != 0o700:
                wrong.append(f"{os.path.join(directory, name)} {mode:04o}")
        for name in files:
            mode = stat.S_IMODE(os.lstat(os.path.join(directory, name)).st_mode)
            if mode != 0o600:
                wrong.append(f"{os.path.join(directory, name)} {mode:04o}")
    return wrong


def test_every_file_the_daemon_writes_is_its_users_alone(tmp_path):
    """Pack files hold tokens in clear, the AOF every prompt's probes: after publishing, persisting and a restart,
    every file under the data dir is 0600 and every directory 0700, whatever the umask the daemon started with."""
    data = tmp_path / "data"
    daemon = Daemon(data, env={})
    old = os.umask(0o022)  # the daemon inherits a umask that leaves files world-readable
    try:
        daemon.start()
    finally:
        os.umask(old)
    try:
        for round_ in range(2):
            client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=16 << 20)
            try:
                keys, _ = publish_prompt(client, list(range(round_ * 1000, round_ * 1000 + 64 * 3 + 40)), seed=round_)
                wait_persisted(client, keys)
            finally:
                client.close()
            daemon.stop()  # the AOF and the manifest are written out
            if round_ == 0:
                daemon.start()
    finally:
        daemon.stop()
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    written = {str(p.relative_to(data)) for p in data.rglob("*")}
    assert {
        "redis/appendonlydir/appendonly.aof.1.incr.aof",
        "redis/redis.conf",
        "redis/redis.log",
        "secrets/redis-password",
        "nvme/manifest/CURRENT",
        "nvme/segments/00000001.seg",
        "logs/mooncake_master.log",
        "logs/mooncake_client.log",
    } <= written
    assert _not_private(data) == []


def test_an_older_builds_world_readable_files_are_made_private_at_start(tmp_path):
    data = tmp_path / "data"
    (data / "nvme" / "segments").mkdir(parents=True, mode=0o755)
    (data / "logs").mkdir(mode=0o755)
    (data / "logs" / "old.log").write_text("tokens\n")
    os.chmod(data / "logs" / "old.log", 0o644)
    os.chmod(data, 0o755)
    daemon = Daemon(data).start()
    daemon.stop()
    assert _not_private(data) == []


def test_an_unauthenticated_client_of_the_index_gets_no_data(node):
    with redis.Redis(port=node.port + 1) as anonymous, pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.hgetall("pc:ns")
