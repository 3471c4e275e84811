"""``/metrics``'s collectors as pure logic: the health gauges, and an exposition that keeps them while the index,
which holds the other figures, does not answer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.cachestore.api.app import ComponentHealth, Stats
from prefixcache.cachestore.api.metrics import CacheCollector, HealthCollector
from prefixcache.indexer.errors import IndexUnavailableError

PROBES = {
    "redis": lambda: ComponentHealth(ok=False, detail="connection refused"),
    "nvme": lambda: ComponentHealth(ok=True, detail="0 chunks", degraded=True),
}


def _index_down() -> Stats:
    raise IndexUnavailableError("connection refused")


def test_without_the_index_the_exposition_says_which_component_is_down():
    registry = CollectorRegistry(auto_describe=False)
    registry.register(HealthCollector(PROBES))
    registry.register(CacheCollector(_index_down, dict))
    text = generate_latest(registry).decode()
    assert 'prefixcache_component_up{component="redis"} 0.0' in text
    assert 'prefixcache_component_up{component="nvme"} 1.0' in text
    assert 'prefixcache_component_degraded{component="nvme"} 1.0' in text
    assert 'prefixcache_component_degraded{component="redis"} 0.0' in text
    assert "prefixcache_tier_bytes_used" not in text
