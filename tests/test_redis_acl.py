"""The least-privileged Redis user deploy/GUIDE.md documents for a shared index: the index suites' operations and a
whole daemon (publish, persist, fetch, evict, KV events, restart) run with only its commands, and Redis logs no
command it refused (background services only log their errors, so the server's ACL LOG is what proves it)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

import tests.test_index as index_tests
import tests.test_index_admin as index_admin_tests
import tests.test_leases as lease_tests
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.host.processes import ManagedProcess, find_executable, free_port
from prefixcache.cachestore.node.redis_server import INDEX_USER_COMMANDS, index_user_acl
from prefixcache.indexer.quotas import QUOTA_REFRESH_S
from prefixcache.indexer.redis_clients import with_password
from prefixcache.indexer.redis_index import RedisIndex
from tests.daemon_harness import Daemon, fetch_payloads, make_spec, publish_prompt, wait_persisted
from tests.test_deploy_files import DEPLOY
from tests.test_redis_index import (  # noqa: F401 - collected here too, with this module's fixtures
    test_lookup_is_one_round_trip,
    test_unacknowledged_feed_events_are_delivered_again_after_a_restart,
)

USER = "prefixcache"
ADMIN_TOKEN = "acl-test-admin-token-0123456789"

# The index suites again, in this module: their ``index`` / ``redis_server`` fixtures are this module's (below).
globals().update(
    {
        name: test
        for module in (index_tests, index_admin_tests, lease_tests)
        for name, test in vars(module).items()
        if name.startswith("test_")
    }
)
leases = lease_tests.leases


class AclRedis(ManagedProcess):
    """A shared index as an operator runs one: no default user, the project's user as the guide has it (with
    ``key_prefix``), and an ``admin`` user for the test's own look at what Redis refused."""

    def __init__(self, directory: Path, key_prefix: str) -> None:
        self.port = free_port()
        self.password, self.admin_password = secrets.token_hex(16), secrets.token_hex(16)
        conf = directory / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    "bind 127.0.0.1",
                    f"port {self.port}",
                    f'dir "{directory}"',
                    'save ""',
                    "appendonly no",
                    "user default off",
                    index_user_acl(USER, self.password, key_prefix),
                    f"user admin on >{self.admin_password} ~* &* +@all",
                ]
            )
            + "\n"
        )
        super().__init__(
            "redis-server",
            [find_executable("redis-server"), str(conf)],
            directory / "redis.log",
            self._answers,
            listens_on=[("127.0.0.1", self.port)],
        )

    @property
    def url(self) -> str:
        return with_password(f"redis://{USER}@127.0.0.1:{self.port}/0", self.password)

    def admin(self) -> redis.Redis:
        return redis.Redis(port=self.port, username="admin", password=self.admin_password)

    def refused(self) -> list[str]:
        """What the project's user was refused (commands, keys), since the last call."""
        with self.admin() as admin:
            log = admin.acl_log()
            admin.acl_log_reset()
        return [f"{e['reason']} {e['object']} ({e['username']})" for e in log]

    def _answers(self) -> bool:
        try:
            with self.admin() as admin:
                return bool(admin.ping())
        except redis.RedisError:
            return False


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    """The index suites use key prefixes of their own (``t0``, ``lease3``...): the user may reach any prefix."""
    server = AclRedis(tmp_path_factory.mktemp("acl-redis"), key_prefix="*")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def index(redis_index: RedisIndex) -> RedisIndex:
    return redis_index


@pytest.fixture(autouse=True)
def _nothing_refused(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "redis_server" in request.fixturenames:
        assert request.getfixturevalue("redis_server").refused() == []


def test_the_guide_gives_the_users_acl_line():
    guide = (DEPLOY / "GUIDE.md").read_text()
    assert index_user_acl(USER, "PASSWORD", "pc") in guide
    assert INDEX_USER_COMMANDS in index_user_acl(USER, "PASSWORD", "pc")


def test_the_user_may_not_run_what_the_project_never_needs(redis_server):
    with redis.Redis.from_url(redis_server.url) as client:
        for command in (("FLUSHALL",), ("CONFIG", "GET", "*"), ("KEYS", "*"), ("INFO",), ("SHUTDOWN",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
    redis_server.refused()  # those were meant to be refused


def test_a_daemon_runs_on_the_guides_user(tmp_path):
    """Everything a node does with its index, with the exact line of the guide (key prefix ``pc``), a quota's
    rounds and a publisher's spending of its room included."""
    server = AclRedis(tmp_path, key_prefix="pc")
    server.start()
    daemon = Daemon(
        tmp_path / "data",
        "--redis-url",
        server.url,
        "--admin-token",
        ADMIN_TOKEN,
        "--kv-events-endpoint",
        f"tcp://127.0.0.1:{free_port()}",
    )
    client = None
    try:
        daemon.start()
        client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=server.password)
        tokens = list(range(64 * 3 + 40))
        keys, payloads = publish_prompt(client, tokens)
        wait_persisted(client, keys)
        assert client.lookup(client.hasher().extend(tokens).query()).matched_tokens == len(tokens)
        assert fetch_payloads(client, keys) == payloads
        with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30) as api:
            assert api.get("/v1/stats").status_code == 200 and api.get("/metrics").status_code == 200
            assert api.get("/v1/chunks").json()["chunks"]
            assert api.post("/v1/evict", json={"keys": [keys[-1].hex()]}).json()["chunks"] == 1
            assert api.put("/v1/quotas/tenant/none", json={"limit_bytes": "1GiB"}).status_code == 200
        time.sleep(2 * QUOTA_REFRESH_S)  # a quota round has written the room, and the client reads it again
        publish_prompt(client, [t + 10_000 for t in tokens])  # admitted through the round's spending counter
        client.close()
        client = None
        daemon.stop()
        daemon.start()  # reconciles the index with the NVMe tier
        client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=server.password)
        assert fetch_payloads(client, keys[:-1]) == payloads[:-1]  # promoted from NVMe
        time.sleep(1.5)  # client statistics are written every second
    finally:
        if client is not None:
            client.close()
        daemon.stop()
        refused = server.refused()
        server.stop()
    assert refused == []
    log = daemon.log_path.read_text()
    assert "NOPERM" not in log and "NoPermission" not in log, log
