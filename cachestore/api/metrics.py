"""``GET /metrics``: the numbers of ``/v1/stats``, the clients' latency histograms and ``/v1/health``'s
components, for Prometheus.

Nothing is counted here: custom collectors read the daemon's state when scraped (tiers, services,
the index's usage counters, the client stats clients add up in Redis, and the health probes), so the exposition,
``/v1/stats`` and ``/v1/health`` can never disagree. While the index does not answer, the figures it holds cannot
be read, and are not tried: the exposition then carries the components' health alone, which says so, within the
probes' time (about 4 s for a frozen index) rather than past a scrape's timeout (10 s by default).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import get_args

import redis
from fastapi import APIRouter, Depends, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.cachestore.api.app import ComponentHealth, HealthProbe, Stats
from prefixcache.cachestore.api.auth import require_reader
from prefixcache.cachestore.client.client_stats import LATENCY_BUCKETS_S, ClientStatsRecord
from prefixcache.cachestore.services.persist_failures import PersistFailureReason
from prefixcache.indexer.errors import IndexUnavailableError

log = logging.getLogger(__name__)

#: The component ``/v1/health`` names the index by (the daemon's probes), which holds most of the figures.
INDEX_COMPONENT = "redis"

#: Client counters exposed per namespace, with their help text.
CLIENT_COUNTERS = {
    "lookups": "index lookups by clients",
    "hits": "lookups that matched at least one token",
    "misses": "lookups that matched nothing",
    "requested_tokens": "prompt tokens looked up",
    "matched_tokens": "tokens served from the cache",
    "fetched_chunks": "chunks fetched and verified",
    "fetch_misses": "chunks a fetch did not find",
    "corrupt_chunks": "fetched chunks that failed verification",
    "mac_failures": "fetched chunks whose MAC did not verify (forged or altered)",
    "published_chunks": "chunks published",
    "publish_failures": "chunks a publish could not store",
    "over_quota_chunks": "chunks a publish left out, their tenant or namespace being at its quota",
    "late_chunks": "chunks whose read from another node passed its deadline (recomputed; that node marked suspect)",
    "skipped_tokens": "cached tokens computed instead of loaded: their path was slower than the engine's prefill",
}


class CacheCollector(Collector):
    """The node's health first, then, while the index answers, the figures of ``/v1/stats`` and the clients'."""

    def __init__(
        self,
        stats: Callable[[], Stats],
        client_stats: Callable[[], dict[bytes, ClientStatsRecord]],
        probes: Mapping[str, HealthProbe],
    ) -> None:
        self._stats = stats
        self._client_stats = client_stats
        self._probes = probes

    def collect(self) -> Iterator[Metric]:
        health = {name: probe() for name, probe in self._probes.items()}
        yield from _health_metrics(health)
        index = health.get(INDEX_COMPONENT)
        if index is not None and not index.ok:
            return  # reading the figures would wait out the index's timeouts again, past a scrape's
        try:
            s = self._stats()
        except (IndexUnavailableError, redis.RedisError) as exc:
            log.debug("metrics without the index's figures: %s", exc)  # prefixcache_component_up says so
            return
        yield from _tier_metrics(s)
        yield from _namespace_metrics(s)
        yield from _quota_metrics(s)
        evicted = CounterMetricFamily("prefixcache_evicted_chunks", "chunks evicted, by reason", labels=["reason"])
        evicted.add_metric(["requested"], s.evictions.requested_chunks)
        evicted.add_metric(["nvme_capacity"], s.evictions.nvme_capacity)
        evicted.add_metric(["dram_demoted"], s.evictions.dram_demoted)
        yield evicted
        corrupt = CounterMetricFamily(
            "prefixcache_corrupt_chunks",
            "chunks that failed verification (deleted), by reason: mac (forged or altered) or damaged",
            labels=["reason"],
        )
        for reason, count in s.corrupt_by_reason.items():
            corrupt.add_metric([reason], count)
        yield corrupt
        failures = CounterMetricFamily(
            "prefixcache_persist_failures",
            "chunks the write-behind failed to persist (kept in DRAM and retried), by reason",
            labels=["reason"],
        )
        for reason in get_args(PersistFailureReason):
            failures.add_metric([reason], s.persist_failures.get(reason, 0))
        yield failures
        queues = GaugeMetricFamily("prefixcache_queue_depth", "work waiting in the daemon's queues", labels=["queue"])
        queues.add_metric(["promotion"], s.queues.promotion)
        queues.add_metric(["write_behind"], s.queues.write_behind)
        queues.add_metric(["eviction_orders"], s.queues.eviction_orders)
        yield queues
        down = GaugeMetricFamily(
            "prefixcache_peer_down",
            "1 while clients skip that node, lost or marked suspect (0 for one stopped on purpose)",
            labels=["peer"],
        )
        marks = CounterMetricFamily(
            "prefixcache_peer_suspect_marks", "times clients could not read from that node", labels=["peer"]
        )
        for peer, state in s.peers.items():
            down.add_metric([peer], int(state.down and not state.stopped))
            marks.add_metric([peer], state.suspect_marks)
        yield down
        yield marks
        yield CounterMetricFamily(
            "prefixcache_master_failovers",
            "times this node found another Mooncake master leading (high-availability mode)",
            value=s.master_failovers,
        )
        restarts = CounterMetricFamily(
            "prefixcache_child_restarts", "restarts of the servers the daemon started", labels=["child"]
        )
        for child, count in s.child_restarts.items():
            restarts.add_metric([child], count)
        yield restarts
        yield CounterMetricFamily("prefixcache_promoted_chunks", "chunks promoted from NVMe to DRAM", value=s.promoted)
        yield CounterMetricFamily(
            "prefixcache_persisted_chunks", "chunks the write-behind persisted", value=s.write_behind.persisted
        )
        yield from _latency_metrics(self._client_stats())


def _health_metrics(health: Mapping[str, ComponentHealth]) -> Iterator[Metric]:
    """``/v1/health``'s components as gauges: whether each answers, and whether it is degraded."""
    up = GaugeMetricFamily(
        "prefixcache_component_up", "1 while the component answers (/v1/health's ok)", labels=["component"]
    )
    degraded = GaugeMetricFamily(
        "prefixcache_component_degraded",
        "1 while the component serves but fails part of its job (/v1/health's degraded)",
        labels=["component"],
    )
    for name, state in health.items():
        up.add_metric([name], int(state.ok))
        degraded.add_metric([name], int(state.degraded))
    yield from (up, degraded)


def _tier_metrics(s: Stats) -> Iterator[Metric]:
    used = GaugeMetricFamily("prefixcache_tier_bytes_used", "bytes this node's tier uses", labels=["tier"])
    capacity = GaugeMetricFamily("prefixcache_tier_capacity_bytes", "capacity of this node's tier", labels=["tier"])
    chunks = GaugeMetricFamily("prefixcache_tier_chunks", "chunks in this node's tier", labels=["tier"])
    for name, tier in (("dram", s.dram), ("nvme", s.nvme)):
        used.add_metric([name], tier.bytes_used)
        capacity.add_metric([name], tier.capacity_bytes)
        if tier.chunks is not None:
            chunks.add_metric([name], tier.chunks)
    yield from (used, capacity, chunks)


def _namespace_metrics(s: Stats) -> Iterator[Metric]:
    chunks = GaugeMetricFamily("prefixcache_namespace_chunks", "chunks indexed per namespace", labels=["namespace"])
    size = GaugeMetricFamily(
        "prefixcache_namespace_bytes",
        "bytes of copies per namespace and tier (all nodes)",
        labels=["namespace", "tier"],
    )
    counters = {
        name: CounterMetricFamily(f"prefixcache_client_{name}", text, labels=["namespace"])
        for name, text in CLIENT_COUNTERS.items()
    }
    for ns, stats in s.namespaces.items():
        chunks.add_metric([ns], stats.chunks)
        for tier, use in stats.tiers.items():
            size.add_metric([ns, tier], use.bytes)
        for name, family in counters.items():
            family.add_metric([ns], getattr(stats.clients, name))
    yield from (chunks, size, *counters.values())


def _quota_metrics(s: Stats) -> Iterator[Metric]:
    """Per scope with a quota (a tenant's usage without one is in ``/v1/stats``: tenants may be many)."""
    labels = ["scope", "id"]
    limit = GaugeMetricFamily("prefixcache_quota_limit_bytes", "bytes the scope may hold", labels=labels)
    used = GaugeMetricFamily(
        "prefixcache_quota_used_bytes", "bytes the scope's chunks hold, pins included", labels=labels
    )
    full = GaugeMetricFamily("prefixcache_quota_at_limit", "1 while the scope's publishes are skipped", labels=labels)
    evicted = CounterMetricFamily(
        "prefixcache_quota_evicted_chunks", "chunks this node evicted to keep the scope within its quota", labels=labels
    )
    for q in s.quotas:
        limit.add_metric([q.scope, q.id], q.limit_bytes)
        used.add_metric([q.scope, q.id], q.used_bytes)
        full.add_metric([q.scope, q.id], int(q.at_quota))
        evicted.add_metric([q.scope, q.id], q.evicted_chunks)
    yield from (limit, used, full, evicted)


def _latency_metrics(records: dict[bytes, ClientStatsRecord]) -> Iterator[Metric]:
    for op in ("lookup", "fetch", "publish"):
        family = HistogramMetricFamily(
            f"prefixcache_client_{op}_seconds", f"{op} latency seen by clients", labels=["namespace"]
        )
        for ns, record in records.items():
            latency = record.latency[op]
            cumulative, buckets = 0, []
            for bound, count in zip((*LATENCY_BUCKETS_S, float("inf")), latency.buckets, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
            family.add_metric([ns.hex()], buckets, latency.sum_s)
        yield family


def metrics_router(
    stats: Callable[[], Stats],
    client_stats: Callable[[], dict[bytes, ClientStatsRecord]],
    probes: Mapping[str, HealthProbe],
) -> APIRouter:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CacheCollector(stats, client_stats, probes))
    router = APIRouter(dependencies=[Depends(require_reader)])

    @router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
    def metrics() -> Response:
        """Prometheus exposition of the node's health, tiers, services, namespaces and client latencies."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router
