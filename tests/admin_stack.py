"""A real daemon with an admin token, a client attached to it, and helpers the admin API tests share."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from tests.daemon_harness import Daemon, make_spec

TOKEN = "s3cret-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("admin") / "data", "--admin-token", TOKEN).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[CacheClient]:
    c = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20)
    yield c
    c.close()


@pytest.fixture
def api(daemon: Daemon, client: CacheClient) -> Iterator[httpx.Client]:
    """An authorised HTTP client on an empty cache (every test starts from nothing)."""
    with httpx.Client(base_url=daemon.url, headers=AUTH, timeout=60) as http:
        yield http
        assert http.post("/v1/evict", json={"all": True, "force": True}).status_code == 200
