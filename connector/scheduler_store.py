"""What the connector's scheduler side reaches the store through, once attached (connector/attachment.py): the
client library's scheduler view of the index (cachestore/client/scheduler_index.py), and the geometry of the
chunks in vLLM's blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefixcache.cachestore.client.config import fetch_config
from prefixcache.cachestore.client.node_requests import ExtentsAsked
from prefixcache.cachestore.client.scheduler_index import SchedulerIndex
from prefixcache.connector.known_stored import KnownStored
from prefixcache.connector.lookups import BatchedLookups
from prefixcache.connector.settings import ConnectorSettings, namespace_for
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.namespace import NamespaceSpec


@dataclass
class SchedulerStore:
    geometry: ChunkGeometry
    namespaces: list[NamespaceSpec]  # one per shard (NamespaceSpec.shards)
    lookups: BatchedLookups  # the requests vLLM adds together are looked up together
    known: KnownStored  # chunks found stored or published a moment ago: what loads nothing needs no lookup
    # lookups, leases, and what this engine took from the cache (client stats): reached through the methods below
    _index: SchedulerIndex

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
            lookups=BatchedLookups(index.index, avoid=index.avoid, here=index.here),
            known=KnownStored(),
            _index=index,
        )

    def record_lookup(self, requested_tokens: int, hit_tokens: int, seconds: float) -> None:
        """Record one lookup of the first shard's namespace: ``hit_tokens`` of ``requested_tokens`` taken from the
        cache, found in ``seconds``."""
        self._index.record_lookup(self.namespaces[0].digest, requested_tokens, hit_tokens, seconds)

    def record_skipped(self, tokens: int) -> None:
        """Record ``tokens`` cached but computed instead (slower to load than to compute)."""
        self._index.record_skipped(self.namespaces[0].digest, tokens)

    def lease(self, keys: list[bytes]) -> None:
        """Lease chunks promised to the workers (indexer/leases.py); raises ``IndexUnavailableError``."""
        self._index.lease(keys)

    def ask_extents(self, key_groups: list[list[bytes]]) -> list[ExtentsAsked]:
        """Ask this node's daemon where its NVMe tier holds each group of chunks, for the workers that will read them
        (``SchedulerIndex.ask_extents``); nothing where Redis does not answer."""
        return self._index.ask_extents(key_groups)

    def close(self) -> None:
        self._index.close()
