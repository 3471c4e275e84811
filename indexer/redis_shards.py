"""Where the index's keys live: one Redis, or the masters of a Redis Cluster, each a ``Shard``.

On one Redis (standalone, or the primary that Sentinel names) there is one shard and every key sits under the
index's prefix R. On a Cluster (``redis+cluster://``) the keys of one chain carry the chain's anchor as hash
tag, so they share a slot and a lookup reads one master; the keys that many chains share (the listing set,
usage counters, change feeds, leases, the key directory) exist once per master, under a tag that master
serves, so that no single key is written by every registration of the fleet. ``indexer/lua/common.lua``
describes the layout. Scripts run on one master's own connection, each touching keys of that master only.

Resharding moves slots, and with them some of the shared keys' tags, to other masters: the map is rebuilt
whenever a master stops answering or refuses a key (``refresh``). Entries follow their slots; a change feed
left on a master whose tag moved is still read, as long as this process has seen that tag.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from itertools import count
from typing import Protocol

import redis
import redis.cluster
from redis.crc import key_slot

from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient


@dataclass(frozen=True)
class Shard:
    """One master: its connection, and the prefix of the keys it shares between chains."""

    name: str  # '' on one Redis; the shared keys' tag on a Cluster
    client: redis.Redis
    shared: str  # S in common.lua: R, or R{<name>}:


class Shards(Protocol):
    """The shards of one index and how a chain's keys are routed to them."""

    keyspace: Keyspace  # the key names, R among them

    @property
    def router(self) -> RedisClient:
        """For single-key commands: a cluster client routes each by its key."""

    clustered: bool

    def all(self) -> list[Shard]:
        """Every shard, each once: for scans, listings, usage and operations by key alone."""

    def seen(self) -> list[Shard]:
        """``all`` plus shards whose tag this process saw before a resharding moved it (their feeds)."""

    def of_anchor(self, anchor: str) -> Shard:
        """The shard that holds the chain anchored at ``anchor`` (hex; '' on one Redis)."""

    def chain_prefix(self, anchor: str) -> str:
        """C in common.lua: where the keys of the chain anchored at ``anchor`` live."""

    def refresh(self) -> None:
        """Learn the topology again (after a failover or a resharding); a no-op on one Redis."""


class SingleRedis:
    """The one shard of a standalone or Sentinel-managed Redis."""

    clustered = False

    def __init__(self, client: redis.Redis, keyspace: Keyspace) -> None:
        self.keyspace, self.router = keyspace, client
        self._shard = Shard("", client, keyspace.root)

    def all(self) -> list[Shard]:
        return [self._shard]

    def seen(self) -> list[Shard]:
        return [self._shard]

    def of_anchor(self, anchor: str) -> Shard:
        return self._shard

    def chain_prefix(self, anchor: str) -> str:
        return self.keyspace.root

    def refresh(self) -> None:
        pass


class ClusterShards:
    """The masters of a Redis Cluster, found through ``client`` and kept up to date by ``refresh``."""

    clustered = True

    def __init__(self, client: redis.cluster.RedisCluster, keyspace: Keyspace) -> None:
        self.keyspace, self.router = keyspace, client
        self._lock = threading.Lock()
        self._by_node: dict[str, Shard] = {}
        self._seen: dict[str, Shard] = {}  # tag -> shard, as last routed
        self._built = False

    def _ensure(self) -> None:
        if not self._built:
            self.refresh(reinitialize=False)

    def refresh(self, reinitialize: bool = True) -> None:
        with self._lock:
            if reinitialize:
                self.router.nodes_manager.initialize()
            slots = self.router.nodes_manager.slots_cache
            owners = {slot: nodes[0] for slot, nodes in slots.items() if nodes}
            by_node: dict[str, Shard] = {}
            for node in {n.name: n for n in owners.values()}.values():
                tag = _tag_served_by(node.name, owners)
                by_node[node.name] = Shard(tag, self.router.get_redis_connection(node), self.keyspace.shard(tag))
            self._by_node = by_node
            for shard in by_node.values():
                self._seen[shard.name] = shard
            self._built = True

    def all(self) -> list[Shard]:
        self._ensure()
        return list(self._by_node.values())

    def seen(self) -> list[Shard]:
        """Shards of tags seen before, routed to the master that serves each tag's slot now."""
        self._ensure()
        current = {shard.name for shard in self._by_node.values()}
        moved = [self._reroute(tag) for tag in self._seen if tag not in current]
        return self.all() + [shard for shard in moved if shard is not None]

    def _reroute(self, tag: str) -> Shard | None:
        try:
            node = self.router.nodes_manager.get_node_from_slot(key_slot(tag.encode()))
        except redis.exceptions.RedisClusterException:
            return None
        return Shard(tag, self.router.get_redis_connection(node), self.keyspace.shard(tag))

    def of_anchor(self, anchor: str) -> Shard:
        self._ensure()
        node = self.router.nodes_manager.get_node_from_slot(key_slot(anchor.encode()))
        shard = self._by_node.get(node.name)
        if shard is None:  # a master this map has not met: the topology changed
            self.refresh()
            shard = self._by_node[self.router.nodes_manager.get_node_from_slot(key_slot(anchor.encode())).name]
        return shard

    def chain_prefix(self, anchor: str) -> str:
        return self.keyspace.chain(anchor)


def _tag_served_by(node_name: str, owners: dict[int, redis.cluster.ClusterNode]) -> str:
    """The first of "s0", "s1", ... whose slot ``node_name`` serves: the same tag in every process."""
    for i in count():
        tag = f"s{i}"
        owner = owners.get(key_slot(tag.encode()))
        if owner is not None and owner.name == node_name:
            return tag
    raise AssertionError("unreachable")  # pragma: no cover: count() never ends


def shards_of(client: RedisClient, keyspace: Keyspace) -> Shards:
    """The shards behind ``client`` (as ``redis_client`` made it) for an index under ``keyspace``."""
    if isinstance(client, redis.cluster.RedisCluster):
        return ClusterShards(client, keyspace)
    return SingleRedis(client, keyspace)
