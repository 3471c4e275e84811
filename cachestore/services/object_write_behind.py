"""Object write-behind: every chunk persisted to this node's NVMe tier is copied to the shared bucket.

It reads the node's change feed through a consumer group of its own, as the DRAM -> NVMe write-behind does
(cachestore/services/write_behind.py): for each ``nvme@node`` added, it reads the chunk from the pack files,
puts it into the object tier (sealed there: cachestore/tiers/object_store.py), adds the ``object@node``
location (the node that wrote the copy; any node reads it) and only then acknowledges the event. A chunk evicted
while it was copied has its bucket copy deleted, so that the bucket holds nothing the index does not name.

A bucket that refuses or does not answer keeps the events unacknowledged and the chunks where they are (NVMe,
acknowledged to their publishers long before): nothing is lost, the failure is counted, and the events are
replayed after a backoff (cachestore/services/persist_failures.py), so copies resume by themselves. No request
waits for any of it.
"""

from __future__ import annotations

import logging
import time

from prefixcache.cachestore.services.persist_failures import PersistFailureReason, PersistFailures
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.tiers.tier import StorageTier
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import Location, PrefixIndex

log = logging.getLogger("prefixcache.object_write_behind")
GROUP = "upload"
CONSUMER = "daemon"


class ObjectWriteBehind(BackgroundLoop):
    name = "prefixcache-object-write-behind"

    def __init__(self, index: PrefixIndex, nvme: NvmeTier, bucket: StorageTier, node: str, *, batch: int = 16) -> None:
        super().__init__()
        self.index = index
        self.nvme = nvme
        self.bucket = bucket
        self.node = node
        self.batch = batch
        self.nvme_location = Location("nvme", node)
        self.location = Location("object", node)
        self.copied = 0
        self.failures = PersistFailures()

    def run_once(self, block_s: float = 0.2) -> int:
        """Handle one batch of feed events; how many there were. Those of chunks not copied stay unacknowledged."""
        events = self.index.read_feed(self.node, GROUP, CONSUMER, count=self.batch, block_s=block_s)
        if not events:
            return 0
        wanted = list(dict.fromkeys(e.key for e in events if e.op == "add" and e.location == self.nvme_location))
        failed = self._copy(wanted) if wanted else set()
        self.index.ack_feed(self.node, GROUP, [e.id for e in events if not (e.op == "add" and e.key in failed)])
        return len(events)

    def _copy(self, keys: list[bytes]) -> set[bytes]:
        """Copy the chunks still on this node's NVMe and not yet in the bucket; the keys left to try again."""
        entries = [
            e
            for e in self.index.get(keys)
            if e is not None
            and self.nvme_location in e.locations
            and not any(loc.tier == "object" for loc in e.locations)
        ]
        read = [(e.key, data) for e in entries if (data := self.nvme.get(e.key)) is not None]
        if not read:
            return set()
        stored = self.bucket.put(read)
        copied = [key for (key, _), ok in zip(read, stored, strict=True) if ok]
        failed = {key for (key, _), ok in zip(read, stored, strict=True) if not ok}
        if failed:
            self._failed("bucket", f"the bucket stored {len(copied)} of {len(read)} chunks", len(failed))
        if copied:
            try:
                gone = self.index.add_location(copied, self.location)
            except IndexUnavailableError as exc:  # in the bucket, not indexed yet: the replay indexes it
                self._failed("index", str(exc), len(copied))
                return failed | set(copied)
            if gone:  # evicted while being copied
                self.bucket.delete(gone)
            self.copied += len(copied) - len(gone)
        return failed

    def _failed(self, reason: PersistFailureReason, detail: str, chunks: int) -> None:
        self.failures.failed(reason, detail, chunks, time.monotonic())
        log.warning(
            "object write-behind: %d chunks not copied to the bucket (%s: %s); retried in %.1fs",
            chunks,
            reason,
            detail,
            self.failures.backoff_s,
        )

    def step(self) -> None:
        """One batch; after a failed one, wait out the backoff and replay this consumer's pending events."""
        wait = self.failures.wait_s(time.monotonic())
        if wait > 0:
            self._stop.wait(wait)
            return
        before = self.failures.attempts_failed
        try:
            if self.failures.failing:
                self.index.rewind_feed(self.node, GROUP, CONSUMER)
            self.run_once()
        except IndexUnavailableError as exc:
            self._failed("index", str(exc), 0)
        if self.failures.attempts_failed == before:
            self.failures.succeeded()
