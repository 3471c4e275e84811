"""Shared fixtures. Every server a test needs is started here, on a free port, in a temp dir."""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

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
from tests.redis_topologies import RedisClusterServers, RedisSentinelServers

_prefixes = itertools.count()

#: The tier of every test module in this folder; every test under tests/e2e is ``e2e`` (tests/e2e/conftest.py marks
#: them: real vLLM engines). ``unit``: pure logic in this process, no server, no process of its own beyond a fresh
#: interpreter's ``python -c`` that starts nothing. ``integration``: real servers (Redis, mooncake_master and the
#: segment owner, RocksDB, a daemon) or processes of its own, no vLLM engine; a module with tests of both kinds is
#: ``integration``. ``make test-unit`` and ``make test-integration`` select by these markers, and a test that ends up
#: with no tier or with two fails the collection: a new module is placed here.
MODULE_TIERS = {
    "unit": {
        "test_arena",
        "test_attachment",  # connections to a socket of its own, found in /proc/net/tcp
        "test_bench_results",
        "test_known_stored",
        "test_burst_bench",
        "test_hit_budget",
        "test_shared_checks",
        "test_node_loss_bench",
        "test_load_costs",
        "test_cli_help",  # typer and rich in this process, at 80 columns
        "test_codec",
        "test_connector_attachment",
        "test_connector_plans",
        "test_connector_settings",
        "test_cpus",
        "test_due_queue",
        "test_docs",
        "test_fingerprint",
        "test_http_guards",
        "test_keys",  # keys computed again in fresh interpreters
        "test_keyspace",  # the generator of the key tables run once as a command
        "test_layered_reads",
        "test_load_reports",
        "test_layering",  # one fresh interpreter importing the client and the connector
        "test_log_limits",
        "test_metrics_exposition",
        "test_missing_extra",  # fresh interpreters without Mooncake
        "test_pages",
        "test_plots",  # one plot drawn (matplotlib, Agg)
        "test_error_family",
        "test_eviction_policy",
        "test_quota_rounds",
        "test_quota_scopes",
        "test_promotion_stream",
        "test_redis_clients",
        "test_redis_replies",
        "test_request_identity",
        "test_secrets_store",
        "test_serving_bench",
        "test_settings_reference",  # the page's generator run as a command, in fresh interpreters
        "test_shared_kv",
        "test_tokens",
        "test_transfer_stats",
        "test_ttft_ratios",
        "test_write_behind_reads",
    },
    "integration": {
        "test_owner_priority",
        "test_admin_cli",
        "test_alert_rules",  # promtool; a real Prometheus with the rules, scraping a daemon
        "test_api_admin",
        "test_api_schema",
        "test_api_security",
        "test_cachestore",
        "test_clustered_index",
        "test_cuda_copies",
        "test_dashboard",  # a real Prometheus scraping two daemons
        "test_data_dir_lock",
        "test_deploy_files",
        "test_dram",
        "test_forged_chunks",
        "test_index",
        "test_index_admin",
        "test_index_deployment",
        "test_kv_events",
        "test_leases",
        "test_listeners",
        "test_lookups",
        "test_master_ha",
        "test_nvme",
        "test_nvme_full",
        "test_nvme_recovery",
        "test_object_store_node",
        "test_object_tier",
        "test_peers",
        "test_private_node",
        "test_processes",
        "test_proxy",
        "test_quotas",
        "test_redis_acl",
        "test_redis_index",
        "test_redis_topologies",
        "test_separate_hosts",
        "test_scheduler_side",  # vLLM's config, request and block classes, no engine
        "test_serve",
        "test_supervision",
        "test_supervisor",
        "test_tier_contract",
        "test_two_nodes",
        "test_vllm_api",  # vLLM 0.33's wheel, downloaded once into .cache/ (tests/vllm_wheel.py), read as a zip
        "test_warmup",
        "test_warmup_api",
        "test_worker_side",
        "test_write_behind_retry",
    },
}
TIERS = ("unit", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test with its module's tier (``MODULE_TIERS``), then check that every test has exactly one. Runs
    after tests/e2e/conftest.py's marking (pytest calls the hook of the conftest loaded last first) and before
    ``-m`` selects."""
    here = Path(__file__).resolve().parent
    tier_of = {module: tier for tier, modules in MODULE_TIERS.items() for module in modules}
    wrong: dict[str, str] = {}  # test module: the tiers its tests got
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.parent == here and path.stem in tier_of:
            item.add_marker(tier_of[path.stem])
        tiers = sorted({mark.name for mark in item.iter_markers()} & set(TIERS))
        if len(tiers) != 1:
            wrong[item.nodeid.split("::")[0]] = " and ".join(tiers) or "no tier"
    if wrong:
        raise pytest.UsageError(
            f"every test needs exactly one tier of {', '.join(TIERS)} (MODULE_TIERS in tests/conftest.py): "
            + "; ".join(f"{module} has {tiers}" for module, tiers in sorted(wrong.items()))
        )


#: Payloads longer than this are compared by what sets them apart, not printed whole.
_LONG_PAYLOAD_BYTES = 64


def pytest_assertrepr_compare(op: str, left: object, right: object) -> list[str] | None:
    """Lists of chunk payloads (bytes, None for a miss) compared with ``==`` are explained by the positions that
    differ and how (a miss, a length, a digest), not byte by byte: every byte of a 128 KiB payload would fill
    thousands of lines and bury the test's name at the end of a CI log."""
    if op != "==" or not (_payload_list(left) and _payload_list(right)):
        return None
    assert isinstance(left, list) and isinstance(right, list)
    lines = [f"{len(left)} payloads != {len(right)} payloads; differing positions:"]
    for i, (got, wanted) in enumerate(itertools.zip_longest(left, right, fillvalue=_absent)):
        if got != wanted:
            lines.append(f"[{i}] {_payload_summary(got)} != {_payload_summary(wanted)}")
    return lines


_absent = object()


def _payload_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and all(item is None or isinstance(item, bytes) for item in value)
        and any(isinstance(item, bytes) and len(item) > _LONG_PAYLOAD_BYTES for item in value)
    )


def _payload_summary(payload: object) -> str:
    if payload is _absent:
        return "(absent)"
    if not isinstance(payload, bytes):
        return "None (a miss)"
    return f"{len(payload)} bytes starting {payload[:4].hex()}, sha256 {hashlib.sha256(payload).hexdigest()[:12]}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """With ``--durations`` (as .ci/run asks), each test module's time too, longest first: its setups, calls and
    teardowns added up, which is what a worker spends on the module (``--dist loadscope``) and what balancing the
    two workers goes by (the Makefile's order of modules)."""
    if config.getoption("durations") is None:
        return
    by_module: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                module = report.nodeid.split("::")[0]
                by_module[module] = by_module.get(module, 0.0) + report.duration
    terminalreporter.write_sep("=", "time per test module (s), longest first")
    for module, seconds in sorted(by_module.items(), key=lambda item: -item[1])[:40]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


def _until_stopped(servers: RedisClusterServers | RedisSentinelServers) -> Iterator:
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A Redis Cluster of 3 masters and 3 replicas shared by the session: tests that kill nodes take
    ``private_redis_cluster``."""
    yield from _until_stopped(RedisClusterServers(tmp_path_factory.mktemp("redis-cluster")))


@pytest.fixture
def private_redis_cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A Redis Cluster of the test's own, for tests that break it."""
    yield from _until_stopped(RedisClusterServers(tmp_path / "redis-cluster"))


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinelServers]:
    """A primary, its replica and three sentinels shared by the session: tests that kill the primary take
    ``private_redis_sentinel``."""
    yield from _until_stopped(RedisSentinelServers(tmp_path_factory.mktemp("redis-sentinel")))


@pytest.fixture
def private_redis_sentinel(tmp_path: Path) -> Iterator[RedisSentinelServers]:
    """A primary, its replica and three sentinels of the test's own, for tests that fail the primary over."""
    yield from _until_stopped(RedisSentinelServers(tmp_path / "redis-sentinel"))


@pytest.fixture
def sent_commands(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every command any Redis connection of this process sends from now on, as sent: round trips counted."""
    sent: list[bytes] = []
    original = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(
        redis.connection.AbstractConnection,
        "send_packed_command",
        lambda conn, command, check_health=True: sent.append(command) or original(conn, command, check_health),
    )
    return sent


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
    yield from _own_prefix(redis_server.url)


@pytest.fixture(params=["embedded", "redis", "cluster", "sentinel"])
def index(request: pytest.FixtureRequest) -> PrefixIndex:
    """Each index test runs against every backend and deployment: they must behave the same."""
    if request.param == "embedded":
        return InMemoryIndex()
    return request.getfixturevalue(
        {"redis": "redis_index", "cluster": "cluster_index", "sentinel": "sentinel_index"}[request.param]
    )


def _own_prefix(url: str) -> Iterator[RedisIndex]:
    index = RedisIndex(url, key_prefix=f"t{next(_prefixes)}")
    yield index
    index.flush()
    index.close()


@pytest.fixture
def cluster_index(redis_cluster: RedisClusterServers) -> Iterator[RedisIndex]:
    """A Redis index on the session's Redis Cluster, under a key prefix of its own."""
    yield from _own_prefix(redis_cluster.url)


@pytest.fixture
def sentinel_index(redis_sentinel: RedisSentinelServers) -> Iterator[RedisIndex]:
    """A Redis index on the primary the session's sentinels name, under a key prefix of its own."""
    yield from _own_prefix(redis_sentinel.url)


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
