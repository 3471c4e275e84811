"""A real daemon with an admin token, a client attached to it, and helpers the admin API tests share."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from cachestore.client import CacheClient
from indexer.index import Location
from tests.daemon_harness import Daemon, make_spec

TOKEN = "s3cret-admin-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NVME = Location("nvme", "node-a")


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


def wait_persisted(client: CacheClient, keys: list[bytes], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(e is not None and NVME in e.locations for e in client.index.get(keys)):
            return
        time.sleep(0.05)
    raise AssertionError("chunks were not persisted in time")
