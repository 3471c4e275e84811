"""The index as a vLLM scheduler uses it: lookups, leases on the chunks it promised, and its client stats.

A scheduler moves no bytes. It asks the index how much of each prompt is cached, skipping copies on nodes that
are down (indexer/peers.py), leases the chunks it plans for its workers to load (indexer/leases.py), asks this
node's daemon where those that only its NVMe holds lie, so that the workers find the answer waiting
(node_requests.py), and records what it took from the cache, for the daemon's ``/v1/stats`` and ``/metrics``
(client_stats.py). It attaches as every client does, from the node's ``ClientConfig`` (config.py), but needs
neither DRAM nor the NVMe tier: this is the part of the client library it uses, and the connector's scheduler side
reaches Redis through nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import redis

from prefixcache.cachestore.client.client_stats import ClientStatsRecorder
from prefixcache.cachestore.client.config import ClientConfig, index_url
from prefixcache.cachestore.client.node_requests import ExtentsAsked, ask_extents
from prefixcache.indexer.index import PrefixIndex, attach_namespace
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.peers import PeerRegistry, PeerView
from prefixcache.indexer.redis_clients import RedisClient, redis_client
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.client")
#: Socket timeouts of the connection for leases and statistics, which run off the scheduler's thread.
LEASE_TIMEOUT_S = 1.0


@dataclass
class SchedulerIndex:
    """What a scheduler reaches the index through, once attached (``attach``); ``close`` it when done."""

    index: PrefixIndex
    leases: Leases  # held on a connection of its own, with short timeouts (LEASE_TIMEOUT_S)
    recorder: ClientStatsRecorder  # on the same connection as the leases
    peers: PeerView  # the nodes lookups skip, read by a thread of its own on the same connection
    node: str  # this engine's node
    requests: RedisClient  # the connection of the leases, for requests to this node's daemon (``ask_extents``)
    keyspace: Keyspace

    @classmethod
    def attach(
        cls, config: ClientConfig, namespaces: Sequence[NamespaceSpec], redis_password: str | None = None
    ) -> SchedulerIndex:
        """Connect to the index of ``config``'s node and register every one of ``namespaces``; raises while Redis
        does not answer (a scheduler without its index would only miss)."""
        index = RedisIndex(index_url(config, redis_password), key_prefix=config.key_prefix)
        try:
            for namespace in namespaces:
                attach_namespace(index, namespace, log)
        except Exception:
            index.close()
            raise
        bookkeeping = redis_client(index.url, socket_timeout_s=LEASE_TIMEOUT_S, connect_timeout_s=LEASE_TIMEOUT_S)
        return cls(
            index=index,
            leases=Leases(bookkeeping, index.keyspace),
            recorder=ClientStatsRecorder(bookkeeping, index.keyspace, config.node),
            peers=PeerView(PeerRegistry(bookkeeping, index.keyspace), config.node).start(),
            node=config.node,
            requests=bookkeeping,
            keyspace=index.keyspace,
        )

    def avoid(self) -> AbstractSet[str]:
        """The nodes whose copies lookups skip now (down or suspect: indexer/peers.py)."""
        return self.peers.down

    def here(self) -> str:
        """This engine's node, for lookups to tell which DRAM copies lie on other nodes ("": it has no other)."""
        return "" if self.peers.alone else self.node

    def lease(self, keys: Sequence[bytes]) -> None:
        """Lease chunks promised to the workers (indexer/leases.py); raises ``IndexUnavailableError``."""
        self.leases.grant(keys)

    def ask_extents(self, key_groups: Sequence[Sequence[bytes]]) -> list[ExtentsAsked]:
        """Ask this node's daemon where its NVMe tier holds each group of chunks, for the worker that will read them
        (``CacheClient.disk_extents``), which then finds the answers waiting; one round trip. Nothing where Redis
        does not answer: the worker asks itself."""
        try:
            return ask_extents(self.requests, self.keyspace, self.node, key_groups)
        except redis.RedisError as exc:
            log.debug("asking where chunks lie on this node's NVMe failed: %s", exc)
            return []

    def record_lookup(self, namespace: bytes, requested_tokens: int, hit_tokens: int, seconds: float) -> None:
        """Record one lookup of ``namespace``: ``hit_tokens`` of ``requested_tokens`` taken from the cache, found in
        ``seconds`` (client_stats.py)."""
        self.recorder.record_lookup(namespace, requested_tokens, hit_tokens, seconds)

    def record_skipped(self, namespace: bytes, tokens: int) -> None:
        """Record ``tokens`` of ``namespace`` cached but computed instead (slower to load than to compute)."""
        self.recorder.record_skipped(namespace, tokens)

    def close(self) -> None:
        self.peers.close()
        self.recorder.close()
        self.index.close()
