"""What the connector's scheduler side reaches the store through, once attached (connector/attachment.py): the
client library's scheduler view of the index (cachestore/client/scheduler_index.py), and the geometry of the
chunks in vLLM's blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.cachestore.client.config import fetch_config
from prefixcache.cachestore.client.scheduler_index import SchedulerIndex
from prefixcache.connector.lookups import BatchedLookups
from prefixcache.connector.settings import ConnectorSettings, namespace_for
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.namespace import NamespaceSpec


@dataclass
class SchedulerStore:
    geometry: ChunkGeometry
    namespaces: list[NamespaceSpec]  # one per shard (NamespaceSpec.shards)
    index: SchedulerIndex  # lookups, leases, and what this engine took from the cache (client stats)
    lookups: BatchedLookups  # the requests vLLM adds together are looked up together

    @classmethod
    def attach(cls, vllm_config: Any, kv_cache_spec: Any, settings: ConnectorSettings) -> SchedulerStore:
        """Ask the daemon how to attach and register every shard's namespace; raises while the daemon or Redis
        does not answer (a store without Redis would only miss)."""
        config = fetch_config(settings.service_url)
        block_tokens = kv_cache_spec.block_size
        first = namespace_for(vllm_config, kv_cache_spec, config.chunk_tokens, tp_rank=0, pp_rank=0)
        namespaces = first.shards()
        index = SchedulerIndex.attach(config, namespaces, settings.redis_password)
        return cls(
            geometry=ChunkGeometry(config.chunk_tokens, block_tokens=block_tokens),
            namespaces=namespaces,
            index=index,
            lookups=BatchedLookups(
                index.index,
                avoid=lambda: index.peers.down,
                here=lambda: "" if index.peers.alone else config.node,
            ),
        )

    def close(self) -> None:
        self.index.close()
