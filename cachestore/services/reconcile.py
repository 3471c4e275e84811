"""Start-up reconciliation: the NVMe tier is the truth about what persists on this node.

* Index entries that claim ``nvme@node`` for chunks the tier does not hold lose that location.
* Chunks the tier holds but the index does not know (Redis restarted without its AOF, say) are
  re-registered from their self-describing objects.
* When the DRAM pool started empty (an embedded master is always new), ``dram@node`` locations are
  stale and dropped.
* Entries an earlier version registered without counting them in their tenant's usage are counted
  (``PrefixIndex.count_tenant_usage``), so quotas see all a tenant holds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.cachestore.chunks.codec import ChunkError, read_meta
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.indexer.index import ChunkRecord, IndexRegistration, Location, PrefixIndex

log = logging.getLogger("prefixcache.reconcile")
BATCH = 256


@dataclass(frozen=True)
class ReconcileReport:
    nvme_chunks: int
    rebuilt: int
    dropped_nvme: int
    dropped_dram: int
    unreadable: int
    tenant_counted: int


def reconcile(index: PrefixIndex, nvme: NvmeTier, node: str, dram_is_new: bool) -> ReconcileReport:
    on_disk = set(nvme.keys())
    nvme_here, dram_here = Location("nvme", node), Location("dram", node)
    known: set[bytes] = set()
    stale_nvme, stale_dram = [], []
    for entry in index.scan():
        if nvme_here in entry.locations and entry.key in on_disk:
            known.add(entry.key)
        elif nvme_here in entry.locations:
            stale_nvme.append(entry.key)
        if dram_is_new and dram_here in entry.locations:
            stale_dram.append(entry.key)
    dropped_nvme = drop_locations(index, stale_nvme, nvme_here)
    dropped_dram = drop_locations(index, stale_dram, dram_here)
    rebuilt, unreadable = _rebuild(index, nvme, sorted(on_disk - known), nvme_here)
    tenant_counted = index.count_tenant_usage()
    report = ReconcileReport(len(on_disk), rebuilt, dropped_nvme, dropped_dram, unreadable, tenant_counted)
    log.info("reconciled index with NVMe tier: %s", report)
    return report


def drop_locations(index: PrefixIndex, keys: list[bytes], location: Location) -> int:
    """Drop ``location`` from every chunk of ``keys``, ``BATCH`` chunks a call; how many there were."""
    for start in range(0, len(keys), BATCH):
        index.drop_location(keys[start : start + BATCH], location)
    return len(keys)


def _rebuild(index: PrefixIndex, nvme: NvmeTier, keys: list[bytes], location: Location) -> tuple[int, int]:
    """Register the chunks of ``keys`` from their objects; unreadable ones are deleted."""
    records, unreadable = records_of([(key, nvme.get(key)) for key in keys], location)
    register(index, records)
    if unreadable:
        nvme.delete(unreadable)
    return len(records), len(unreadable)


def records_of(
    objects: Sequence[tuple[bytes, bytes | memoryview | None]], location: Location
) -> tuple[list[ChunkRecord], list[bytes]]:
    """The records of chunks at ``location`` from their stored objects (key, bytes or None where unreadable), and
    the keys whose objects are unreadable or another key's."""
    records, unreadable = [], []
    for key, data in objects:
        try:
            if data is None:
                raise ChunkError("unreadable")
            meta = read_meta(data)
            if meta.key != key:
                raise ChunkError("stored under another key")
        except ChunkError:
            unreadable.append(key)
            continue
        tenant = f"{meta.tenant:016x}" if meta.tenant else ""
        records.append(
            ChunkRecord.of(
                parent=meta.parent,
                packed_tokens=meta.tokens,
                root=meta.root,
                namespace=meta.namespace,
                size_bytes=len(data),
                location=location,
                tenant=tenant,
            )
        )
    return records, unreadable


def register(index: IndexRegistration, records: list[ChunkRecord]) -> None:
    """Register ``records``, each after its parent where both are among them: on a Cluster a chunk joins its
    parent's chain (``RedisIndex``), which must be known by then."""
    ordered = parents_first(records)
    for start in range(0, len(ordered), BATCH):
        index.register(ordered[start : start + BATCH])


def parents_first(records: list[ChunkRecord]) -> list[ChunkRecord]:
    """``records`` ordered by their depth below the first one of their chain among them: parents before children."""
    parent_of = {r.key: r.parent for r in records}
    depth: dict[bytes, int] = {}
    for record in records:
        path = [record.key]
        while (parent := parent_of.get(path[-1])) is not None and parent in parent_of and parent not in depth:
            path.append(parent)
        base = depth.get(parent_of[path[-1]], -1)
        for i, key in enumerate(reversed(path)):
            depth[key] = base + 1 + i
    return sorted(records, key=lambda r: depth[r.key])
