"""Eviction on request: a chunk's bytes leave every tier this node can reach, and its entry the index.

Order matters for consistency. Bytes go first (DRAM objects pool-wide, this node's NVMe copies), the
index after: in between, a reader finds an entry whose bytes are gone, which is a miss it recomputes,
never wrong data; the reverse order would leave bytes no entry points to. A chunk whose DRAM copy
cannot be removed (Mooncake unreachable) keeps everything, index entry included; so does one whose bucket copy
cannot be removed (the object tier is the same bucket from every node, so any node removes it). Copies on other
nodes' NVMe tiers only their daemons can delete: this node sends them eviction orders
(cachestore/services/eviction_orders.py) and waits a moment for them to confirm. Until a node does, its copies
stay indexed, so nothing is left on a disk that the index does not name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixcache.cachestore.services.eviction_orders import EvictionOrders
from prefixcache.cachestore.tiers.tier import StorageTier
from prefixcache.indexer.index import ChunkEntry, IndexRegistration, Location


@dataclass
class Eviction:
    """What one ``evict`` call did."""

    removed: list[ChunkEntry] = field(default_factory=list)
    #: lost their DRAM and local NVMe copies, but copies on other nodes' NVMe remain indexed
    kept_elsewhere: list[ChunkEntry] = field(default_factory=list)
    #: untouched: their DRAM or bucket copy could not be removed
    failed: list[ChunkEntry] = field(default_factory=list)
    #: nodes that hold copies of ``kept_elsewhere`` and did not confirm their orders in time
    pending_nodes: list[str] = field(default_factory=list)


class Evictor:
    def __init__(
        self,
        index: IndexRegistration,
        dram: StorageTier,
        nvme: StorageTier,
        node: str,
        orders: EvictionOrders | None = None,
        bucket: StorageTier | None = None,
    ) -> None:
        """``orders``: how copies on other nodes are reached (None: they are kept and reported); ``bucket``: the
        object tier (None: this node has none, and chunks with a bucket copy are left as they are)."""
        self.index = index
        self.bucket = bucket
        self.orders = orders
        self.dram = dram
        self.nvme = nvme
        self.nvme_here = Location("nvme", node)
        #: chunks and bytes removed since start, for /v1/stats and /metrics
        self.evicted_chunks = 0
        self.evicted_bytes = 0

    def evict(self, entries: Sequence[ChunkEntry]) -> Eviction:
        """Remove these chunks (selected and pin-checked by the caller) from every node's tiers, then the index."""
        outcome = self.evict_here(entries)
        if self.orders is None or not outcome.kept_elsewhere:
            return outcome
        # Only a forced eviction passes pinned chunks. Their pins go now, as their copies here did: holders
        # leave chunks pinned when they take an order, since a pin set after it was queued must hold.
        now = self.index.clock_s()  # pins are deadlines in the index's clock
        forced = [e.key for e in outcome.kept_elsewhere if e.pinned(now)]
        if forced:
            self.index.set_pin(forced, 0.0)
        by_node: dict[str, list[bytes]] = {}
        for entry in outcome.kept_elsewhere:
            for loc in entry.locations:
                if loc.tier == "nvme" and loc != self.nvme_here:
                    by_node.setdefault(loc.node, []).append(entry.key)
        outcome.pending_nodes = self.orders.send(by_node)
        still = {e.key for e in self.index.get([e.key for e in outcome.kept_elsewhere]) if e is not None}
        outcome.removed += [e for e in outcome.kept_elsewhere if e.key not in still]
        outcome.kept_elsewhere = [e for e in outcome.kept_elsewhere if e.key in still]
        return outcome

    def evict_here(self, entries: Sequence[ChunkEntry]) -> Eviction:
        """Remove these chunks' copies this node can reach (DRAM pool-wide, this node's NVMe) and their
        locations; entries left with no location go. Copies on other nodes' NVMe stay (``kept_elsewhere``)."""
        outcome = Eviction()
        if not entries:
            return outcome
        removals = self.dram.delete([e.key for e in entries])
        gone = {e.key: removal.gone for e, removal in zip(entries, removals, strict=True)}
        in_bucket = [e.key for e in entries if any(loc.tier == "object" for loc in e.locations)]
        bucket_gone = set()
        if in_bucket and self.bucket is not None:
            removed = self.bucket.delete(in_bucket)
            bucket_gone = {key for key, removal in zip(in_bucket, removed, strict=True) if removal.gone}
        for entry in entries:
            in_dram = any(loc.tier == "dram" for loc in entry.locations)
            if (in_dram and not gone[entry.key]) or (entry.key in in_bucket and entry.key not in bucket_gone):
                outcome.failed.append(entry)
            elif any(loc.tier == "nvme" and loc != self.nvme_here for loc in entry.locations):
                outcome.kept_elsewhere.append(entry)
            else:
                outcome.removed.append(entry)
        done = outcome.removed + outcome.kept_elsewhere
        self.nvme.delete([e.key for e in done if self.nvme_here in e.locations])
        self.index.remove([e.key for e in outcome.removed])
        for location in {loc for e in outcome.kept_elsewhere for loc in e.locations if loc.tier in ("dram", "object")}:
            self.index.drop_location([e.key for e in outcome.kept_elsewhere], location)
        self.index.drop_location([e.key for e in outcome.kept_elsewhere], self.nvme_here)
        self.evicted_chunks += len(outcome.removed)
        self.evicted_bytes += sum(e.size_bytes for e in outcome.removed)
        return outcome
