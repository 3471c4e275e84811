"""Shared fixtures. Every server a test needs is started here, on a free port, in a temp dir."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.cachestore.tiers.dram import MooncakeTier
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import PrefixIndex
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex

from tests.daemon_harness import Daemon, connect
from tests.in_memory_index import InMemoryIndex
from tests.mooncake_pool import LocalMooncakePool

_prefixes = itertools.count()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


class MooncakeNode(LocalMooncakePool):
    """A master and this node's segment owner, as the daemon runs them, plus tiers attached to them."""

    def tier(self, arena_bytes: int = 64 << 20, **options) -> MooncakeTier:
        return MooncakeTier(
            self.owner.shm_address,
            arena_bytes=arena_bytes,
            preferred_segment=self.owner.segment,
            metrics_url=self.metrics_url,
            **options,
        )


@pytest.fixture(scope="session")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeNode]:
    node = MooncakeNode(tmp_path_factory.mktemp("mooncake"))
    yield node
    node.stop()


@pytest.fixture
def client(daemon: Daemon) -> Iterator[CacheClient]:
    """A client of the ``daemon`` fixture's node, closed after the test."""
    c = connect(daemon)
    yield c
    c.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A ``prefixcache serve`` of the test's own: the whole stack, as a node runs it."""
    d = Daemon(tmp_path / "data").start()
    yield d
    d.stop()


@pytest.fixture
def private_mooncake(tmp_path: Path) -> Iterator[MooncakeNode]:
    """A node of the test's own, for tests that break or fill it."""
    node = MooncakeNode(tmp_path / "mooncake", segment_bytes=64 << 20)
    yield node
    node.stop()


@pytest.fixture
def redis_index(redis_server: EmbeddedRedis) -> Iterator[RedisIndex]:
    """A Redis index under a key prefix of its own, so tests share one server without sharing keys."""
    index = RedisIndex(redis_server.url, key_prefix=f"t{next(_prefixes)}")
    yield index
    index.flush()
    index.close()


@pytest.fixture(params=["embedded", "redis"])
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    """Each index test runs against both backends: they must behave the same."""
    if request.param == "embedded":
        return InMemoryIndex()
    return request.getfixturevalue("redis_index")


@pytest.fixture
def spec() -> NamespaceSpec:
    return NamespaceSpec(
        model="tiny-llama", model_fingerprint="f" * 32, kv_dtype="bfloat16", kv_layout="chunk-v1", chunk_tokens=64
    )


@pytest.fixture
def geometry(spec: NamespaceSpec) -> ChunkGeometry:
    return ChunkGeometry(chunk_tokens=spec.chunk_tokens, block_tokens=16)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
