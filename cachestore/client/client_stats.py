"""Client stats: cache use as clients see it (hits, tokens served, latencies), summed per node in Redis.

Lookups, fetches and publishes happen in client processes (connectors, warm-up jobs), never in the
daemon, so each client counts in memory and a background thread adds its counts to one Redis hash
per node every ``interval_s`` (one pipelined round trip). The daemon reads that hash for
``/v1/stats`` and ``/metrics``. Recording costs a dict update and never waits on Redis; if Redis is
unreachable the counts of that interval are dropped: statistics may lag or miss, callers never wait.

Layout: ``P:cs:<node>`` HASH with fields ``<namespace hex>:<counter>``, and per operation
``<namespace hex>:lat:<op>:<i>`` (observations in bucket i, not cumulative), ``...:sum_us`` and ``...:count``.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Literal, cast

import redis

from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.periodic_flusher import PeriodicFlusher
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import text

log = logging.getLogger("prefixcache.client_stats")

Operation = Literal["lookup", "fetch", "publish"]
OPERATIONS: tuple[Operation, ...] = ("lookup", "fetch", "publish")
#: Upper bounds (seconds) of the latency buckets; a last, unbounded bucket follows.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
COUNTERS = (
    "lookups",
    "hits",
    "misses",
    "requested_tokens",
    "matched_tokens",
    "fetched_chunks",
    "fetch_misses",
    "corrupt_chunks",
    "mac_failures",
    "published_chunks",
    "publish_failures",
    "over_quota_chunks",
    "late_chunks",
    "skipped_tokens",
)


class ClientStatsRecorder(PeriodicFlusher):
    """One per client process: ``record_*`` from any thread, added to the node's client stats in the background."""

    name = "prefixcache-client-stats"

    def __init__(self, client: RedisClient, keyspace: Keyspace, node: str, interval_s: float = 1.0) -> None:
        super().__init__(interval_s)
        self._client = client
        self._key = keyspace.client_stats(node)
        self._pending: Counter[str] = Counter()
        self._lock = threading.Lock()

    def record_lookup(self, namespace: bytes, requested_tokens: int, matched_tokens: int, seconds: float) -> None:
        """One lookup of ``requested_tokens`` of which the caller takes ``matched_tokens`` from the cache."""
        ns = namespace.hex()
        self._add(
            ns,
            seconds,
            "lookup",
            lookups=1,
            hits=int(matched_tokens > 0),
            misses=int(matched_tokens == 0),
            requested_tokens=requested_tokens,
            matched_tokens=matched_tokens,
        )

    def record_fetch(self, namespace: bytes, fetched: int, missing: int, corrupt: int, seconds: float) -> None:
        self._add(
            namespace.hex(), seconds, "fetch", fetched_chunks=fetched, fetch_misses=missing, corrupt_chunks=corrupt
        )

    def record_rejected_after_fetch(self, namespace: bytes) -> None:
        """A chunk an earlier ``record_fetch`` counted fetched failed its check afterwards (a client that checks
        chunks on other threads while it fetches the next): it was a corrupt chunk, and a miss."""
        self._count(namespace.hex(), {"fetched_chunks": -1, "fetch_misses": 1, "corrupt_chunks": 1})

    def record_mac_failure(self, namespace: bytes) -> None:
        """A chunk counted corrupt (by ``record_fetch`` or ``record_rejected_after_fetch``) failed its MAC."""
        self._count(namespace.hex(), {"mac_failures": 1})

    def record_publish(self, namespace: bytes, stored: int, failed: int, seconds: float) -> None:
        self._add(namespace.hex(), seconds, "publish", published_chunks=stored, publish_failures=failed)

    def record_over_quota(self, namespace: bytes, chunks: int) -> None:
        """Chunks a publish left out: their tenant or namespace had no room left in its quota."""
        self._count(namespace.hex(), {"over_quota_chunks": chunks})

    def record_late(self, namespace: bytes, chunks: int) -> None:
        """Chunks whose read from another node passed its deadline (a miss, recomputed)."""
        self._count(namespace.hex(), {"late_chunks": chunks})

    def record_skipped(self, namespace: bytes, tokens: int) -> None:
        """Cached tokens a hit left to be computed: loading them would have taken longer (connector/load_costs.py)."""
        self._count(namespace.hex(), {"skipped_tokens": tokens})

    def _add(self, ns: str, seconds: float, op: Operation, **counts: int) -> None:
        bucket = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
        self._count(
            ns, counts, {f"lat:{op}:{bucket}": 1, f"lat:{op}:sum_us": round(seconds * 1e6), f"lat:{op}:count": 1}
        )

    def _count(self, ns: str, *counts: dict[str, int]) -> None:
        if self.closed:
            return
        with self._lock:
            for group in counts:
                for name, value in group.items():
                    if value:
                        self._pending[f"{ns}:{name}"] += value
        self._started()

    def flush(self) -> None:
        """Add what was recorded so far to the node's client stats now (tests, shutdown)."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
        if not pending:
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            for name, value in pending.items():
                pipe.hincrby(self._key, name, value)
            pipe.execute()
        except redis.RedisError as exc:
            log.debug("dropped client statistics of one interval: %s", exc)


@dataclass
class Latency:
    """One operation's latency histogram: observations per bucket (not cumulative), their sum and count."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0


@dataclass
class ClientStatsRecord:
    """The client stats of one namespace on one node: what its clients recorded since the index was created."""

    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    latency: dict[Operation, Latency] = field(default_factory=lambda: {op: Latency() for op in OPERATIONS})

    def add(self, other: ClientStatsRecord) -> None:
        for name, value in other.counters.items():
            self.counters[name] += value
        for op, theirs in other.latency.items():
            ours = self.latency[op]
            ours.buckets = [a + b for a, b in zip(ours.buckets, theirs.buckets, strict=True)]
            ours.sum_s += theirs.sum_s
            ours.count += theirs.count


def read_client_stats(client: RedisClient, keyspace: Keyspace, node: str) -> dict[bytes, ClientStatsRecord]:
    """The client stats of ``node``, per namespace digest."""
    records: defaultdict[bytes, ClientStatsRecord] = defaultdict(ClientStatsRecord)
    for raw_name, raw_value in client.hgetall(keyspace.client_stats(node)).items():
        try:
            _read_field(records, text(raw_name), int(raw_value))
        except (ValueError, KeyError, IndexError):  # not written by a client of this version: skip
            log.debug("ignored client statistics field %r", raw_name)
    return dict(records)


def _read_field(records: defaultdict[bytes, ClientStatsRecord], name: str, value: int) -> None:
    ns, _, counter = name.partition(":")
    entry = records[bytes.fromhex(ns)]
    if not counter.startswith("lat:"):
        entry.counters[counter] = value
        return
    _, op, part = counter.split(":")
    latency = entry.latency[cast(Operation, op)]
    if part == "sum_us":
        latency.sum_s = value / 1e6
    elif part == "count":
        latency.count = value
    else:
        latency.buckets[int(part)] = value
