"""What the connector's scheduler side reaches the store through, once attached (connector/attachment.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.cachestore.client.usage_stats import ClientStatsRecorder
from prefixcache.connector.lookups import BatchedLookups
from prefixcache.connector.plans import Geometry
from prefixcache.connector.settings import ConnectorSettings, namespace_for
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import attach_namespace
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_clients import redis_client
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.connector")
#: Socket timeouts of the connection for leases and statistics, which run off the scheduler's thread.
LEASE_TIMEOUT_S = 1.0


@dataclass
class SchedulerStore:
    geometry: ChunkGeometry
    plan_geometry: Geometry
    namespaces: list[NamespaceSpec]  # one per shard (NamespaceSpec.shards)
    index: RedisIndex
    lookups: BatchedLookups  # the requests vLLM adds together are looked up together
    leases: Leases
    stats: ClientStatsRecorder  # what this engine took from the cache, for the daemon's /v1/stats and /metrics

    @classmethod
    def attach(cls, vllm_config: Any, kv_cache_spec: Any, settings: ConnectorSettings) -> SchedulerStore:
        """Ask the daemon how to attach and register every shard's namespace; raises while the daemon or Redis
        does not answer (a store without Redis would only miss)."""
        config = fetch_config(settings.service_url)
        block_tokens = kv_cache_spec.block_size
        first = namespace_for(vllm_config, kv_cache_spec, config.chunk_tokens, tp_rank=0, pp_rank=0)
        namespaces = first.shards()
        index = RedisIndex(index_url(config, settings.redis_password), key_prefix=config.key_prefix)
        try:
            for namespace in namespaces:
                attach_namespace(index, namespace, log)
        except Exception:
            index.close()
            raise
        # a second connection, with short timeouts, for leases and statistics
        bookkeeping = redis_client(index.url, socket_timeout_s=LEASE_TIMEOUT_S, connect_timeout_s=LEASE_TIMEOUT_S)
        return cls(
            geometry=ChunkGeometry(config.chunk_tokens, block_tokens=block_tokens),
            plan_geometry=Geometry(config.chunk_tokens, block_tokens),
            namespaces=namespaces,
            index=index,
            lookups=BatchedLookups(index),
            leases=Leases(bookkeeping, config.key_prefix),
            stats=ClientStatsRecorder(bookkeeping, config.key_prefix + ":", config.node),
        )

    def close(self) -> None:
        self.stats.close()
        self.index.close()
