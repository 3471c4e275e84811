"""DRAM watermarks: above the high mark, the least recently used persisted chunks leave DRAM.

Demotion keeps the NVMe copy (only chunks already persisted are candidates), skips protected chunks
(pinned by an operator or leased to a scheduler that promised to load them),
and drops the ``dram@node`` location in the same step as the Mooncake object, so the index always
says where a chunk is. The master's own eviction is set higher (95%) as a backstop; normally this
acts first, which is what keeps its evictions, which the index would not hear of, rare.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from prefixcache.cachestore.services.write_behind import WriteBehind
from prefixcache.cachestore.tiers.tier import StorageTier
from prefixcache.indexer.background_loop import PeriodicLoop
from prefixcache.indexer.index import IndexRegistration, Location

log = logging.getLogger("prefixcache.demotion")
CANDIDATES_PER_ROUND = 512


class Demoter(PeriodicLoop):
    name = "prefixcache-demoter"

    def __init__(
        self,
        index: IndexRegistration,
        dram: StorageTier,
        write_behind: WriteBehind,
        node: str,
        is_protected: Callable[[Sequence[bytes]], list[bool]],
        high: float = 0.85,
        low: float = 0.70,
        interval_s: float = 0.1,
    ) -> None:
        super().__init__(interval_s)
        self.index = index
        self.dram = dram
        self.write_behind = write_behind
        self.is_protected = is_protected
        self.dram_location = Location("dram", node)
        self.nvme_location = Location("nvme", node)
        self.high, self.low = high, low
        self.demoted = 0

    def run_once(self) -> int:
        """Demote down to the low watermark if above the high one; returns chunks demoted."""
        usage = self.dram.usage()
        if not usage.capacity_bytes or usage.bytes_used <= self.high * usage.capacity_bytes:
            return 0
        excess = usage.bytes_used - self.low * usage.capacity_bytes
        keys = self.write_behind.resident_oldest(CANDIDATES_PER_ROUND)
        persisted = [e for e in self.index.get(keys) if e is not None and self.nvme_location in e.locations]
        protected = self.is_protected([e.key for e in persisted])
        entries = [e for e, keep in zip(persisted, protected, strict=True) if not keep]
        victims, freed = [], 0
        for entry in sorted(entries, key=lambda e: e.last_access_s):
            if freed >= excess:
                break
            victims.append(entry.key)
            freed += entry.size_bytes
        if victims:
            self.dram.delete(victims)
            self.index.drop_location(victims, self.dram_location)
            self.demoted += len(victims)
            log.debug("demoted %d chunks (%d bytes) from DRAM", len(victims), freed)
        return len(victims)

    def tick(self) -> None:
        """Check the watermarks (at once when the write-behind pokes it, after persisting a batch)."""
        self.run_once()
