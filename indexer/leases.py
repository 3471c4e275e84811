"""Leases: chunks promised to a vLLM scheduler stay where they are until they have been loaded.

When the connector's scheduler side answers ``get_num_new_matched_tokens`` with a hit, the engine
commits to loading those chunks in its next step. Demotion (DRAM) and eviction (NVMe) skip leased
chunks, so capacity pressure cannot take a chunk away between the promise and the load. A lease
ends by itself after its time to live, so an engine that dies mid-request never holds chunks for
long. Leases are kept apart from pins: a pin is an operator's decision, and neither may end the
other.

One sorted set per key prefix (``<prefix>:lease``) maps chunk key to expiry (Unix seconds). Expired
members are dropped whenever a lease is granted, so the set stays as small as the leases in flight.
Expiries are set and compared by Redis's clock (``lease.lua``, and ``TIME`` beside the read), never by a
client's: a scheduler whose clock runs ahead would otherwise drop other engines' leases as expired.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.redis_index import load_script

#: Long enough to cover the step between the promise and the load many times over, short enough
#: that a crashed engine's leases do not hold capacity for long.
DEFAULT_LEASE_S = 30.0


class Leases:
    def __init__(self, client: redis.Redis, key_prefix: str) -> None:
        self._redis = client
        self._key = f"{key_prefix}:lease"
        self._grant = load_script(client, "lease", with_common=False)

    def grant(self, keys: Sequence[bytes], ttl_s: float = DEFAULT_LEASE_S) -> None:
        """Hold ``keys`` for ``ttl_s`` seconds (a longer lease already held is kept)."""
        if not keys:
            return
        try:
            self._grant(keys=[self._key], args=[ttl_s, *keys])
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"cannot lease chunks: {exc}") from exc

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is under an unexpired lease."""
        if not keys:
            return []
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                (seconds, microseconds), expiries = pipe.time().zmscore(self._key, list(keys)).execute()
        except redis.RedisError as exc:
            raise IndexUnavailableError(f"cannot read leases: {exc}") from exc
        now = seconds + microseconds / 1e6
        return [expiry is not None and expiry > now for expiry in expiries]
