"""Leases: chunks promised to a vLLM scheduler stay where they are until they have been loaded.

When the connector's scheduler side answers ``get_num_new_matched_tokens`` with a hit, the engine
commits to loading those chunks in its next step. Demotion (DRAM) and eviction (NVMe) skip leased
chunks, so capacity pressure cannot take a chunk away between the promise and the load. A lease
ends by itself after its time to live, so an engine that dies mid-request never holds chunks for
long. Leases are kept apart from pins: a pin is an operator's decision, and neither may end the
other.

One sorted set per key prefix and shard (``<prefix>:lease`` on one Redis; on a Cluster one per master, under
that master's tag, holding the keys whose own slot it serves) maps chunk key to expiry (Unix seconds). Expired
members are dropped whenever a lease is granted, so a set stays as small as the leases in flight. Expiries
are set and compared by the shard's clock (``lease.lua``, and ``TIME`` beside the read), never by a
client's: a scheduler whose clock runs ahead would otherwise drop other engines' leases as expired.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import suppress

import redis

from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_index import load_script
from prefixcache.indexer.redis_shards import Shard, shards_of

#: Long enough to cover the step between the promise and the load many times over, short enough
#: that a crashed engine's leases do not hold capacity for long.
DEFAULT_LEASE_S = 30.0


class Leases:
    def __init__(self, client: RedisClient, keyspace: Keyspace) -> None:
        self._shards = shards_of(client, keyspace)
        self._grant = load_script(client, "lease", with_common=False)

    def _by_shard(self, keys: Sequence[bytes]) -> dict[str, tuple[Shard, list[int]]]:
        """Positions of ``keys`` per shard: each key's lease lies on the shard of its own slot."""
        groups: dict[str, tuple[Shard, list[int]]] = {}
        for i, key in enumerate(keys):
            shard = self._shards.of_anchor(key.hex() if self._shards.clustered else "")
            groups.setdefault(shard.shared, (shard, []))[1].append(i)
        return groups

    def grant(self, keys: Sequence[bytes], ttl_s: float = DEFAULT_LEASE_S) -> None:
        """Hold ``keys`` for ``ttl_s`` seconds (a longer lease already held is kept)."""
        if not keys:
            return
        try:
            for shard, positions in self._by_shard(keys).values():
                self._grant(
                    keys=[Keyspace.lease(shard.shared)],
                    args=[ttl_s, *(keys[i] for i in positions)],
                    client=shard.client,
                )
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            self._shards_changed()
            raise IndexUnavailableError(f"cannot lease chunks: {exc}") from exc

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is under an unexpired lease."""
        held = [False] * len(keys)
        try:
            for shard, positions in self._by_shard(keys).values():
                with shard.client.pipeline(transaction=True) as pipe:
                    pipe.time()
                    # redis-py's stub types the members as str; Redis takes bytes alike
                    pipe.zmscore(Keyspace.lease(shard.shared), [keys[i] for i in positions])  # type: ignore[misc]
                    (seconds, microseconds), expiries = pipe.execute()
                now = seconds + microseconds / 1e6
                for i, expiry in zip(positions, expiries, strict=True):
                    held[i] = expiry is not None and expiry > now
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            self._shards_changed()
            raise IndexUnavailableError(f"cannot read leases: {exc}") from exc
        return held

    def _shards_changed(self) -> None:
        with suppress(redis.RedisError, redis.exceptions.RedisClusterException):  # still failing over: next time
            self._shards.refresh()
