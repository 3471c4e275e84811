"""The library the connector and warm-up jobs use: look up, publish and fetch chunks.

The hot path goes from the calling process straight to Redis (index) and Mooncake (bytes, through
this node's segment owner over shared memory); the daemon's REST API is asked once, for the
addresses. Every failure (Redis or Mooncake unreachable, a damaged or vanished chunk) is a miss:
callers recompute, never load wrong KV.

Buffers: ``stage`` hands out slots of the client's registered arena. Build an object in place
(payload at ``meta.payload_offset``), ``publish`` it, then ``release`` the slot; ``fetch`` fills
slots and returns views of the verified payloads.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import redis

from cachestore.api import ClientConfig
from cachestore.client_stats import ClientStatsRecorder
from cachestore.codec import ChunkError, ChunkMeta, decode, write_header
from cachestore.dram import MooncakeTier
from cachestore.promotion import request_promotion
from indexer.chunking import ChunkGeometry
from indexer.errors import ConfigError, IndexUnavailableError
from indexer.index import ChunkRecord, Location, NamespaceCheck, PrefixMatch, attach_namespace
from indexer.keys import PrefixHasher, PrefixQuery
from indexer.namespace import NamespaceSpec, tenant_id
from indexer.redis_index import RedisIndex, with_password

log = logging.getLogger("prefixcache.client")
#: How long a new chunk is shielded from the master's eviction: far longer than the write-behind
#: needs to persist it (well under a second), after which the daemon's demotion manages it.
UNPERSISTED_PROTECTION_S = 60.0


@dataclass
class ClientStats:
    lookups: int = 0
    lookup_errors: int = 0
    published: int = 0
    publish_failures: int = 0
    fetched: int = 0
    missing: int = 0
    corrupt: int = 0
    promoted: int = 0


def fetch_config(service_url: str, timeout_s: float = 5.0) -> ClientConfig:
    """Ask a node's daemon how to attach (``GET /v1/config``)."""
    try:
        response = httpx.get(service_url.rstrip("/") + "/v1/config", timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot read the attach settings from {service_url}: {exc}") from exc
    return ClientConfig.model_validate(response.json())


class CacheClient:
    def __init__(self, config: ClientConfig, spec: NamespaceSpec, *, arena_bytes: int = 256 << 20,
                 redis_password: str | None = None, promote_timeout_s: float = 2.0) -> None:  # fmt: skip
        self.config = config
        self.spec = spec
        self.node = config.node
        self.geometry = ChunkGeometry(spec.chunk_tokens)
        self.location = Location("dram", config.node)
        self.stats = ClientStats()
        redis_url = with_password(config.redis_url, redis_password) if redis_password else config.redis_url
        self.index = RedisIndex(redis_url, key_prefix=config.key_prefix)
        self._redis = redis.Redis.from_url(self.index.url, socket_timeout=promote_timeout_s + 1)
        self._prefix = config.key_prefix + ":"
        self.recorder = ClientStatsRecorder(self._redis, self._prefix, config.node)  # the daemon reports these
        self._promote_timeout_s = promote_timeout_s
        self.dram = MooncakeTier(config.mooncake.shm_address, arena_bytes=arena_bytes, object_prefix=config.key_prefix,
                                 preferred_segment=config.mooncake.segment)  # fmt: skip
        self.namespace_check: NamespaceCheck | None = None
        try:
            self.namespace_check = attach_namespace(self.index, spec, log)
        except IndexUnavailableError as exc:
            log.warning("index unreachable at start-up (%s); lookups miss until it answers", exc)

    @classmethod
    def connect(cls, service_url: str, spec: NamespaceSpec, **options: object) -> CacheClient:
        return cls(fetch_config(service_url), spec, **options)  # type: ignore[arg-type]

    def hasher(self, tenant_salt: str | None = None) -> PrefixHasher:
        return PrefixHasher(self.spec.root(tenant_salt), self.geometry)

    def lookup(self, query: PrefixQuery) -> PrefixMatch:
        """Longest cached prefix; an unreachable index is a miss."""
        self.stats.lookups += 1
        started = time.perf_counter()
        try:
            match = self.index.lookup(query)
        except IndexUnavailableError as exc:
            self.stats.lookup_errors += 1
            log.debug("lookup missed: %s", exc)
            match = PrefixMatch(keys=[], chunk_tokens=query.chunk_tokens)
        self.recorder.record_lookup(self.spec.digest, query.num_tokens, match.matched_tokens,
                                    time.perf_counter() - started)  # fmt: skip
        return match

    def stage(self, meta: ChunkMeta) -> memoryview:
        """An arena slot for one encoded object; write the payload at ``meta.payload_offset``."""
        return self.dram.arena.alloc(meta.encoded_size)

    def slot(self, size: int) -> memoryview:
        return self.dram.arena.alloc(size)

    def release(self, view: memoryview) -> None:
        self.dram.arena.free(view)

    def publish(self, chunks: Sequence[tuple[ChunkMeta, memoryview]], tenant_salt: str | None = None) -> list[bool]:
        """Store each (meta, slot holding its payload) in DRAM, then register what was stored."""
        if not chunks:
            return []
        started = time.perf_counter()
        objects = [(meta.key, slot[: write_header(slot, meta)]) for meta, slot in chunks]
        stored = self.dram.put(objects, soft_pin_s=UNPERSISTED_PROTECTION_S)
        records = [
            ChunkRecord.of(parent=meta.parent, packed_tokens=meta.tokens, root=meta.root, namespace=meta.namespace,
                           size_bytes=meta.encoded_size, location=self.location, tenant=tenant_id(tenant_salt))
            for (meta, _), ok in zip(chunks, stored, strict=True) if ok
        ]  # fmt: skip
        try:
            self.index.register(records)
        except IndexUnavailableError as exc:
            log.warning("published chunks not registered (%s); they will not be found", exc)
            stored = [False] * len(chunks)
        self.stats.published += sum(stored)
        self.stats.publish_failures += len(chunks) - sum(stored)
        self.recorder.record_publish(self.spec.digest, sum(stored), len(chunks) - sum(stored),
                                     time.perf_counter() - started)  # fmt: skip
        return stored

    def fetch(self, keys: Sequence[bytes], slots: Sequence[memoryview]) -> list[memoryview | None]:
        """Each chunk's verified payload (a view into its slot), or None: a miss the caller recomputes.

        A chunk missing from DRAM, or whose DRAM copy fails verification (and is deleted), is promoted
        from the NVMe tier of a node that holds it, then read and verified again.
        """
        started, corrupt_before = time.perf_counter(), self.stats.corrupt
        sizes = self.dram.get_into(keys, slots)
        out = [self._verified(key, slot, size) for key, slot, size in zip(keys, slots, sizes, strict=True)]
        again = [i for i, view in enumerate(out) if view is None]
        if again:
            retried = self._promote_and_retry([keys[i] for i in again], [slots[i] for i in again])
            for i, size in zip(again, retried, strict=True):
                out[i] = self._verified(keys[i], slots[i], size)
        fetched = sum(1 for v in out if v is not None)
        self.stats.fetched += fetched
        self.stats.missing += len(out) - fetched
        self.recorder.record_fetch(self.spec.digest, fetched, len(out) - fetched, self.stats.corrupt - corrupt_before,
                                   time.perf_counter() - started)  # fmt: skip
        return out

    def _promote_and_retry(self, keys: list[bytes], slots: list[memoryview]) -> list[int]:
        """Chunks not in DRAM but on some node's NVMe: ask those daemons to promote, then read again."""
        try:
            entries = self.index.get(keys)
        except IndexUnavailableError:
            return [-1] * len(keys)
        by_node: defaultdict[str, list[int]] = defaultdict(list)
        for i, entry in enumerate(entries):
            nvme = sorted(loc.node for loc in (entry.locations if entry else ()) if loc.tier == "nvme")
            if nvme:
                by_node[nvme[0]].append(i)
        sizes = [-1] * len(keys)
        for node, positions in by_node.items():
            try:
                done = request_promotion(self._redis, self._prefix, node, [keys[i] for i in positions],
                                         self._promote_timeout_s)  # fmt: skip
            except redis.RedisError as exc:
                log.debug("promotion request to %s failed: %s", node, exc)
                continue
            ready = [i for i, ok in zip(positions, done, strict=True) if ok]
            self.stats.promoted += len(ready)
            for i, size in zip(ready, self.dram.get_into([keys[i] for i in ready], [slots[i] for i in ready]),
                               strict=True):  # fmt: skip
                sizes[i] = size
        return sizes

    def _verified(self, key: bytes, slot: memoryview, size: int) -> memoryview | None:
        if size < 0:
            return None
        try:
            _, payload = decode(slot[:size], key=key, namespace=self.spec.digest)
        except ChunkError as exc:
            self.stats.corrupt += 1
            log.warning("chunk %s failed verification (%s): deleted, recomputing", key.hex(), exc)
            self._discard(key)
            return None
        return payload

    def _discard(self, key: bytes) -> None:
        """Remove a damaged DRAM copy so no one else loads it, and say so in the index."""
        self.dram.delete([key])
        try:
            entry = self.index.get([key])[0]
            for location in entry.locations if entry else ():
                if location.tier == "dram":
                    self.index.drop_location([key], location)
        except IndexUnavailableError:
            pass

    def close(self) -> None:
        self.recorder.close()
        self.dram.close()
        self.index.close()
        self._redis.close()
