"""``/v1/stats`` sections built from the index's usage counters and the clients' recorded totals."""

from __future__ import annotations

from prefixcache.cachestore.api.app import ClientUse, NamespaceStats
from prefixcache.cachestore.api.models import tier_use
from prefixcache.cachestore.chunks.codec import RejectCounts
from prefixcache.cachestore.client.usage_stats import ClientTotals
from prefixcache.indexer.index import NamespaceUsage


def client_use(total: ClientTotals) -> ClientUse:
    return ClientUse(**total.counters)


def all_clients(totals: dict[bytes, ClientTotals]) -> ClientUse:
    overall = ClientTotals()
    for total in totals.values():
        overall.add(total)
    return client_use(overall)


def corrupt_by_reason(clients: ClientUse, *services: RejectCounts) -> dict[str, int]:
    """Chunks refused on this node, by ``ChunkError`` reason: clients' fetches and the daemon's services."""
    mac = clients.mac_failures + sum(s.mac for s in services)
    total = clients.corrupt_chunks + sum(s.total for s in services)
    return {"mac": mac, "damaged": total - mac}


def namespace_stats(
    usage: dict[bytes, NamespaceUsage], clients: dict[bytes, ClientTotals]
) -> dict[str, NamespaceStats]:
    """Per namespace digest (hex): what it holds, and what clients did with it."""
    out = {}
    for ns in sorted(usage.keys() | clients.keys()):
        held = usage.get(ns)
        out[ns.hex()] = NamespaceStats(
            chunks=held.entries.chunks if held else 0,
            bytes=held.entries.bytes if held else 0,
            tiers=tier_use(held),
            clients=client_use(clients.get(ns) or ClientTotals()),
        )
    return out
