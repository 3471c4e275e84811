"""The write-behind retries, in the running daemon, the feed events of a step that failed: here, the index's
Redis refusing writes (out of memory under ``noeviction``), then allowed again."""

from __future__ import annotations

import httpx
import redis

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.cachestore.services.write_behind import GROUP
from tests.daemon_harness import Daemon, make_spec, publish_prompt, wait_for, wait_persisted
from tests.test_cachestore import NVME


def test_events_of_a_step_the_index_refused_are_retried_without_a_restart(tmp_path) -> None:
    # The daemon's own redis-server refuses CONFIG to its clients, so the index is one of the test's, with an
    # admin user that can make it refuse writes.
    server = EmbeddedRedis(tmp_path / "redis", admin=True)
    server.start()
    # a hold long enough that the write-behind reads the events before Redis starts refusing writes
    daemon = Daemon(tmp_path / "data", "--redis-url", server.url, env={"PREFIXCACHE_WRITE_BEHIND_HOLD_S": "1.0"})
    daemon.start()
    admin = redis.Redis.from_url(server.admin_url)

    def stats() -> dict:
        return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()

    try:
        client = CacheClient.connect(daemon.url, make_spec(), arena_bytes=64 << 20, redis_password=server.password)
        keys, _ = publish_prompt(client, list(range(64 * 8)))
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        try:
            assert wait_for(lambda: stats()["persist_failures"].get("index", 0) > 0)
            report = httpx.get(daemon.url + "/v1/health")
            assert (report.status_code, report.json()["status"]) == (200, "degraded")
            assert "index" in report.json()["components"]["nvme"]["detail"]
            assert not any(NVME in e.locations for e in client.index.get(keys))
            stream = next(iter(admin.scan_iter(match="*f:node-a")))
            assert admin.xpending(stream, GROUP)["pending"] >= len(keys)
        finally:
            admin.config_set("maxmemory", "0")
        pid = daemon.proc.pid
        wait_persisted(client, keys, timeout_s=15)
        assert wait_for(lambda: admin.xpending(stream, GROUP)["pending"] == 0)
        assert wait_for(lambda: httpx.get(daemon.url + "/v1/health").json()["status"] == "ready")
        assert daemon.proc.pid == pid and daemon.proc.poll() is None  # no restart
        client.close()
    finally:
        admin.close()
        daemon.stop()
        server.stop()
