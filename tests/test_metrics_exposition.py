"""``/metrics``'s collectors as pure logic: the health gauges, and an exposition that keeps them while the index,
which holds the other figures, does not answer."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.cachestore.api.app import ComponentHealth, Stats
from prefixcache.cachestore.api.metrics import CacheCollector
from prefixcache.indexer.errors import IndexUnavailableError

INDEX_DOWN = ComponentHealth(ok=False, detail="connection refused")
NVME_DEGRADED = ComponentHealth(ok=True, detail="0 chunks", degraded=True)


def _exposition(index: ComponentHealth, stats: Callable[[], Stats]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(stats, dict, {"redis": lambda: index, "nvme": lambda: NVME_DEGRADED}))
    return generate_latest(registry).decode()


def _index_down() -> Stats:
    raise IndexUnavailableError("connection refused")


def _unread() -> Stats:
    raise AssertionError("the figures were read while the index was down")


def test_without_the_index_the_exposition_says_which_component_is_down():
    text = _exposition(INDEX_DOWN, _unread)
    assert 'prefixcache_component_up{component="redis"} 0.0' in text
    assert 'prefixcache_component_up{component="nvme"} 1.0' in text
    assert 'prefixcache_component_degraded{component="nvme"} 1.0' in text
    assert 'prefixcache_component_degraded{component="redis"} 0.0' in text
    assert "prefixcache_tier_bytes_used" not in text


def test_an_index_lost_between_the_probe_and_the_figures_leaves_the_health():
    text = _exposition(ComponentHealth(ok=True, detail="answering"), _index_down)
    assert 'prefixcache_component_up{component="redis"} 1.0' in text and "prefixcache_tier" not in text
