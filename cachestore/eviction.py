"""Eviction on request: a chunk's bytes leave every tier this node can reach, and its entry the index.

Order matters for consistency. Bytes go first (DRAM objects pool-wide, this node's NVMe copies), the
index after: in between, a reader finds an entry whose bytes are gone, which is a miss it recomputes,
never wrong data; the reverse order would leave bytes no entry points to. A chunk whose DRAM copy
cannot be removed (Mooncake unreachable) keeps everything, index entry included. A chunk with copies
on other nodes' NVMe tiers keeps those (only their daemons can delete them) and loses the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cachestore.dram import MooncakeTier
from cachestore.nvme import NvmeStore
from indexer.index import ChunkEntry, Location, PrefixIndex


@dataclass
class Eviction:
    """What one ``evict`` call did."""

    removed: list[ChunkEntry] = field(default_factory=list)
    #: lost their DRAM and local NVMe copies, but copies on other nodes' NVMe remain indexed
    kept_elsewhere: list[ChunkEntry] = field(default_factory=list)
    #: untouched: their DRAM copy could not be removed
    failed: list[ChunkEntry] = field(default_factory=list)


class Evictor:
    def __init__(self, index: PrefixIndex, dram: MooncakeTier, nvme: NvmeStore, node: str) -> None:
        self.index = index
        self.dram = dram
        self.nvme = nvme
        self.nvme_here = Location("nvme", node)
        #: chunks and bytes removed since start, for /v1/stats and /metrics
        self.evicted_chunks = 0
        self.evicted_bytes = 0

    def evict(self, entries: Sequence[ChunkEntry]) -> Eviction:
        """Remove these chunks (selected and pin-checked by the caller) from the tiers, then the index."""
        outcome = Eviction()
        if not entries:
            return outcome
        gone = dict(zip((e.key for e in entries), self.dram.remove([e.key for e in entries]), strict=True))
        for entry in entries:
            in_dram = any(loc.tier == "dram" for loc in entry.locations)
            if in_dram and not gone[entry.key]:
                outcome.failed.append(entry)
            elif any(loc.tier == "nvme" and loc != self.nvme_here for loc in entry.locations):
                outcome.kept_elsewhere.append(entry)
            else:
                outcome.removed.append(entry)
        done = outcome.removed + outcome.kept_elsewhere
        self.nvme.delete([e.key for e in done if self.nvme_here in e.locations])
        self.index.remove([e.key for e in outcome.removed])
        for location in {loc for e in outcome.kept_elsewhere for loc in e.locations if loc.tier == "dram"}:
            self.index.drop_location([e.key for e in outcome.kept_elsewhere], location)
        self.index.drop_location([e.key for e in outcome.kept_elsewhere], self.nvme_here)
        self.evicted_chunks += len(outcome.removed)
        self.evicted_bytes += sum(e.size_bytes for e in outcome.removed)
        return outcome
