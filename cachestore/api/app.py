"""The daemon's REST API (management only; KV bytes never pass through it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Response
from pydantic import BaseModel, Field

from prefixcache.cachestore.api.admin_routes import install_error_handlers
from prefixcache.cachestore.api.auth import AccessPolicy, install_access_policy, require_reader
from prefixcache.cachestore.api.http_guards import LOOPBACK_HOSTS, install_http_guards
from prefixcache.cachestore.api.models import Quota
from prefixcache.cachestore.client.config import ClientConfig
from prefixcache.cachestore.node.settings import DEFAULT_MAX_BODY_BYTES
from prefixcache.indexer.index import Tier, Usage


class ComponentHealth(BaseModel):
    ok: bool
    detail: str
    degraded: bool = Field(default=False, description="serving, but failing part of its job (detail says which)")


class Health(BaseModel):
    status: Literal["ready", "degraded", "unavailable"] = Field(
        description="ready: every component ok; degraded: every one serving, some failing part of its job (HTTP "
        "200: the node still serves); unavailable: some component down (HTTP 503)"
    )
    components: dict[str, ComponentHealth]


class TierStats(BaseModel):
    bytes_used: int
    capacity_bytes: int
    chunks: int | None = None


class WriteBehindStats(BaseModel):
    """How fast chunks published to DRAM become persistent (delay from registration to the NVMe copy)."""

    persisted: int
    corrupt: int
    vanished: int
    delay_p50_s: float
    delay_p99_s: float
    delay_max_s: float


class ClientStats(BaseModel):
    """What clients (connectors, warm-up jobs) attached to this node did: lookups, hits, tokens, fetches (their
    client stats, cachestore/client/client_stats.py)."""

    lookups: int
    hits: int = Field(description="lookups that matched at least one token")
    misses: int
    requested_tokens: int
    matched_tokens: int = Field(description="tokens served from the cache")
    fetched_chunks: int
    fetch_misses: int
    corrupt_chunks: int
    mac_failures: int = Field(description="fetched chunks whose MAC did not verify: forged, or altered since signed")
    published_chunks: int
    publish_failures: int
    over_quota_chunks: int = Field(
        default=0, description="chunks publishes left out: their tenant or namespace was at quota"
    )
    late_chunks: int = Field(
        default=0, description="chunks whose read from another node passed its deadline: recomputed, the node suspect"
    )
    skipped_tokens: int = Field(
        default=0, description="cached tokens computed instead of loaded: their path was slower than the prefill"
    )


class EvictionStats(BaseModel):
    requested_chunks: int = Field(description="removed from every tier and the index through the API")
    requested_bytes: int
    nvme_capacity: int = Field(description="chunks the NVMe tier evicted to make room")
    dram_demoted: int = Field(description="chunks moved out of DRAM above its watermark (kept on NVMe)")


class QueueDepths(BaseModel):
    promotion: int = Field(description="promotion requests waiting for this node")
    write_behind: int = Field(description="feed events the write-behind has not handled yet")
    eviction_orders: int = Field(description="other nodes' eviction orders waiting for this node")


class NamespaceStats(BaseModel):
    chunks: int
    bytes: int
    tiers: dict[Tier, Usage] = Field(description="copies per tier, over all nodes")
    clients: ClientStats


class ObjectStats(BaseModel):
    """The object tier (``object_store_url``): what the shared bucket holds, and how this node's copies to it go."""

    chunks: int = Field(
        description="bucket locations the index records, every node's (a chunk located by two nodes counts twice)"
    )
    bytes: int = Field(description="their bytes as stored on NVMe (sealing adds 32 per object)")
    copied: int = Field(description="chunks this node copied to the bucket")
    backlog: int = Field(description="chunks this node persisted whose copy to the bucket is pending or retried")
    copy_failures: dict[str, int] = Field(
        default_factory=dict, description="chunks a copy failed for (kept on NVMe, retried), by reason"
    )
    rejected: int = Field(description="objects read from the bucket that did not open (tampered, swapped): misses")
    late_reads: int = Field(description="reads from the bucket abandoned at their deadline: misses")
    reachable: bool = Field(description="false while the bucket's circuit breaker is open")


class PeerStats(BaseModel):
    down: bool = Field(description="clients read nothing from it now: its heartbeat lapsed, or it is marked suspect")
    stopped: bool = Field(description="its daemon stopped on purpose")
    suspect_marks: int = Field(description="times a client could not read from it and marked it suspect")


class Stats(BaseModel):
    node: str
    dram: TierStats
    nvme: TierStats
    write_behind: WriteBehindStats
    promoted: int
    promotion_failures: int
    demoted: int
    evictions: EvictionStats
    corrupt_chunks: int = Field(description="found by the write-behind, promotions and clients; each was deleted")
    corrupt_by_reason: dict[str, int] = Field(
        default_factory=dict, description="the same by reason: 'mac' (forged or altered), 'damaged' (anything else)"
    )
    persist_failures: dict[str, int] = Field(
        default_factory=dict,
        description="chunks the write-behind failed to persist (kept in DRAM, retried), by reason: 'enospc' (no "
        "room on the NVMe tier), 'eio' (the disk failed a write), 'index' (the index refused a write), 'error'",
    )
    queues: QueueDepths
    clients: ClientStats
    namespaces: dict[str, NamespaceStats]
    tenants: dict[str, Usage] = Field(
        default_factory=dict, description="what each tenant holds (by tenant id; 'none': no cache_salt), over all nodes"
    )
    quotas: list[Quota] = Field(default_factory=list, description="every quota and what its scope holds (/v1/quotas)")
    child_restarts: dict[str, int] = Field(
        default_factory=dict, description="restarts of each server the daemon started (cachestore/node/supervisor.py)"
    )
    peers: dict[str, PeerStats] = Field(
        default_factory=dict, description="the cluster's other nodes as the index's table of peers has them"
    )
    master_failovers: int = Field(
        default=0,
        description="times this node found another Mooncake master leading (masters in high-availability mode)",
    )
    object_store: ObjectStats | None = Field(default=None, description="the object tier; none where it is not set")


HealthProbe = Callable[[], ComponentHealth]


def create_app(
    config: ClientConfig,
    probes: dict[str, HealthProbe],
    stats: Callable[[], Stats],
    *,
    routers: Sequence[APIRouter] = (),
    access: AccessPolicy | None = None,
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The API: health and config (always open), stats, and the given routers (which declare their auth), behind
    the Host check and the body limit (``http_guards``). No access policy: nothing but health and config answers."""
    app = FastAPI(
        title="prefixcache",
        summary="Persistent prefix KV cache for vLLM: inspect, evict and pin cached prefixes.",
        version="0.1.0",
    )
    install_access_policy(app, access or AccessPolicy())
    install_error_handlers(app)
    install_http_guards(app, allowed_hosts, max_body_bytes)

    @app.get("/v1/health", response_model=Health, responses={503: {"model": Health}})
    def health(response: Response) -> Health:
        """Ready when every component answers, degraded (still 200) when one fails part of its job; each is
        named with its state."""
        components = {name: probe() for name, probe in probes.items()}
        serving = all(c.ok for c in components.values())
        response.status_code = 200 if serving else 503
        if not serving:
            return Health(status="unavailable", components=components)
        degraded = any(c.degraded for c in components.values())
        return Health(status="degraded" if degraded else "ready", components=components)

    @app.get("/v1/stats", response_model=Stats, dependencies=[Depends(require_reader)])
    def node_stats() -> Stats:
        """This node's tiers and background services."""
        return stats()

    @app.get("/v1/config", response_model=ClientConfig)
    def client_config() -> ClientConfig:
        """Addresses and settings a client attaches with."""
        return config

    for router in routers:
        app.include_router(router)
    return app
