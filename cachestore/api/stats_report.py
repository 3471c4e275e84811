"""``/v1/stats`` sections built from the index's usage counters and the client stats of this node."""

from __future__ import annotations

from prefixcache.cachestore.api.app import ClientStats, NamespaceStats
from prefixcache.cachestore.api.models import tier_use
from prefixcache.cachestore.chunks.codec import RejectCounts
from prefixcache.cachestore.client.client_stats import ClientStatsRecord
from prefixcache.indexer.index import NamespaceUsage


def client_stats(record: ClientStatsRecord) -> ClientStats:
    return ClientStats(**record.counters)


def all_client_stats(records: dict[bytes, ClientStatsRecord]) -> ClientStats:
    """The client stats of every namespace, summed."""
    overall = ClientStatsRecord()
    for record in records.values():
        overall.add(record)
    return client_stats(overall)


def corrupt_by_reason(clients: ClientStats, *services: RejectCounts) -> dict[str, int]:
    """Chunks refused on this node, by ``ChunkError`` reason: clients' fetches and the daemon's services."""
    mac = clients.mac_failures + sum(s.mac for s in services)
    total = clients.corrupt_chunks + sum(s.total for s in services)
    return {"mac": mac, "damaged": total - mac}


def namespace_stats(
    usage: dict[bytes, NamespaceUsage], records: dict[bytes, ClientStatsRecord]
) -> dict[str, NamespaceStats]:
    """Per namespace digest (hex): what it holds, and what clients did with it."""
    out = {}
    for ns in sorted(usage.keys() | records.keys()):
        held = usage.get(ns)
        out[ns.hex()] = NamespaceStats(
            chunks=held.entries.chunks if held else 0,
            bytes=held.entries.bytes if held else 0,
            tiers=tier_use(held),
            clients=client_stats(records.get(ns) or ClientStatsRecord()),
        )
    return out
