"""Write-behind: every chunk that lands in this node's DRAM becomes persistent on its NVMe tier.

The node's change feed (a Redis stream written atomically with each registration) says what landed;
this worker reads it in batches through a consumer group, copies each chunk DRAM -> NVMe (verifying
it on the way: a corrupt object is deleted and its location dropped, never persisted, and so is the location
of an object the pool no longer holds), adds the ``nvme@node`` location, and only then acknowledges the
events. A crash leaves events unacknowledged, so they are processed again after a restart: the delay is
bounded by the batch time, not by luck. A chunk it cannot persist (the NVMe tier full or failing, the index
refusing writes, a DRAM read that failed though the pool may hold the chunk: the master slow or away) keeps
its event unacknowledged and its DRAM copy; the failure is counted and the pending events are replayed after
a backoff (``cachestore/services/persist_failures.py``), in this process.

A chunk is held back ``hold_s`` after its publish (the publisher's clock, ``ChunkEntry.created_s``) before it
is copied. The first reads of a chunk come right after its publish (a decode instance loading what a prefill
instance just computed, an agent's next turn), and the copy would share the node with them: on a host with
few cores it slows the hits that follow a publish, and holding it back a moment keeps it out of their way
(docs/decisions.md, "The write-behind holds fresh chunks back 0.25 s"). Chunks already older than that (a
backlog) are copied at once, so the hold costs no throughput, only ``hold_s`` of persistence delay.

It also keeps the set of chunks resident in this node's DRAM (from the same feed), in publish order,
which the demoter walks when DRAM runs over its watermark.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cachestore.chunks.codec import ChunkError, RejectCounts, decode
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.services.persist_failures import PersistFailureReason, PersistFailures
from prefixcache.cachestore.services.reconcile import drop_locations
from prefixcache.cachestore.tiers.dram import ABSENT, MooncakeTier
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import ChunkEntry, FeedEvent, Location, PrefixIndex

log = logging.getLogger("prefixcache.write_behind")
GROUP = "persist"
CONSUMER = "daemon"


@dataclass
class WriteBehindCounters:
    persisted: int = 0
    corrupt: RejectCounts = field(default_factory=RejectCounts)
    vanished: int = 0
    failures: PersistFailures = field(default_factory=PersistFailures)
    max_delay_s: float = 0.0
    delays_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))  # recent, for percentiles

    def note_delay(self, delay_s: float) -> None:
        self.max_delay_s = max(self.max_delay_s, delay_s)
        self.delays_s.append(delay_s)


class WriteBehind(BackgroundLoop):
    name = "prefixcache-write-behind"

    def __init__(
        self,
        index: PrefixIndex,
        dram: MooncakeTier,
        nvme: NvmeTier,
        node: str,
        *,
        hold_s: float,
        mac_key: ChunkMacKey,
        batch: int = 32,
    ) -> None:
        super().__init__()
        self.hold_s = hold_s
        self.mac_key = mac_key
        self.index = index
        self.dram = dram
        self.nvme = nvme
        self.node = node
        self.batch = batch
        self.dram_location = Location("dram", node)
        self.nvme_location = Location("nvme", node)
        self.stats = WriteBehindCounters()
        #: chunks in this node's DRAM, oldest publish first (an ordered set)
        self.resident: OrderedDict[bytes, None] = OrderedDict()
        self._resident_lock = threading.Lock()
        #: called after each persisted batch (the demoter: freshly persisted chunks are demotable)
        self.on_persisted: Callable[[], None] = lambda: None

    def run_once(self, block_s: float = 0.2) -> int:
        """Handle one batch of feed events; returns how many there were. The events of chunks it could not
        persist stay unacknowledged (``stats.failures`` says why); the others are acknowledged."""
        events = self.index.read_feed(self.node, GROUP, CONSUMER, count=self.batch, block_s=block_s)
        if not events:
            return 0
        self._track_residency(events)
        wanted = list(dict.fromkeys(e.key for e in events if e.op == "add" and e.location == self.dram_location))
        try:
            failed = self._persist(wanted) if wanted else set()
        except IndexUnavailableError as exc:
            self._failed("index", str(exc), len(wanted))
            return 0  # nothing acknowledged: every event is replayed
        if failed is None:
            return 0  # stopped while holding: the events stay unacknowledged and are handled after a restart
        settled = [e.id for e in events if not (e.op == "add" and e.key in failed)]
        self.index.ack_feed(self.node, GROUP, settled)
        return len(events)

    def resident_oldest(self, limit: int) -> list[bytes]:
        with self._resident_lock:
            return [key for key, _ in zip(self.resident, range(limit), strict=False)]

    def forget_resident(self) -> int:
        """Drop the DRAM location of every chunk resident here: what a start's reconcile does, for a segment that
        lost its objects while the daemon ran (its owner or the master restarted). The feed's drop events then
        empty ``resident``; locations whose add events are still unread go when their copies are found missing."""
        return drop_locations(self.index, self.resident_oldest(len(self.resident)), self.dram_location)

    def _track_residency(self, events: list[FeedEvent]) -> None:
        with self._resident_lock:
            for event in events:
                if event.location != self.dram_location:
                    continue
                if event.op == "add":
                    self.resident[event.key] = None
                else:
                    self.resident.pop(event.key, None)

    def _persist(self, keys: list[bytes]) -> set[bytes] | None:
        """Copy the chunks still only in DRAM to NVMe, once held; the keys it could not persist, or None if the
        loop stopped while holding."""
        entries = [
            e
            for e in self.index.get(keys)
            if e is not None and self.dram_location in e.locations and self.nvme_location not in e.locations
        ]
        wait = hold_left_s(max((e.created_s for e in entries), default=0.0), self.index.clock_s(), self.hold_s)
        if wait > 0 and self._stop.wait(wait):
            return None
        failed: set[bytes] = set()
        while entries:
            slots = self.dram.arena.alloc_batch([e.size_bytes for e in entries])
            taken = entries[: len(slots)]
            try:
                failed |= self._persist_batch(taken, slots)
            finally:
                for slot in slots:
                    self.dram.arena.free(slot)
            entries = entries[len(taken) :]
        return failed

    def _persist_batch(self, entries: list[ChunkEntry], slots: list[Any]) -> set[bytes]:
        """Verify, store and index one batch; the keys left unpersisted (counted in ``stats.failures``)."""
        sizes = self.dram.get_into([e.key for e in entries], slots)
        good, corrupt, vanished, unread = [], [], [], set()
        for entry, slot, size in zip(entries, slots, sizes, strict=True):
            if size == ABSENT:
                vanished.append(entry)
                continue
            if size < 0:  # the pool may still hold it (the master slow or away): tried again, its location kept
                unread.add(entry.key)
                continue
            try:
                decode(slot[:size], key=entry.key, namespace=entry.namespace, mac_key=self.mac_key)
            except ChunkError as exc:
                log.warning("chunk %s in DRAM is corrupt (%s): dropped, not persisted", entry.key.hex(), exc)
                corrupt.append(entry.key)
                self.stats.corrupt.count(exc)
                continue
            good.append((entry, slot[:size]))
        if corrupt:
            self.dram.delete(corrupt)
        absent = self._still_registered(vanished)
        if corrupt or absent:  # the index must never say a chunk is where it is not
            self.index.drop_location(corrupt + absent, self.dram_location)
        if unread:
            self._failed("dram", f"{len(unread)} of {len(entries)} chunks could not be read from DRAM", len(unread))
        persisted, unstored = self._store(good)
        if unstored:
            reason = self.nvme.write_failure or "enospc"
            self._failed(reason, f"the NVMe tier stored {len(persisted)} of {len(good)} chunks", len(unstored))
        if persisted:
            try:
                gone = set(self.index.add_location([e.key for e in persisted], self.nvme_location))
            except IndexUnavailableError as exc:  # on NVMe, not indexed yet: the replay adds the location
                self._failed("index", str(exc), len(persisted))
                return unstored | unread | {e.key for e in persisted}
            if gone:  # evicted while being copied: leave no NVMe bytes the index does not know of
                self.nvme.delete(list(gone))
                persisted = [e for e in persisted if e.key not in gone]
        now = self.index.clock_s()  # entries' times are the index's clock
        for entry in persisted:
            self.stats.note_delay(now - entry.created_s)
        self.stats.persisted += len(persisted)
        if persisted:
            self.on_persisted()
        self.stats.vanished += len(vanished)
        return unstored | unread

    def _still_registered(self, vanished: list[ChunkEntry]) -> list[bytes]:
        """Of the chunks whose DRAM copies were found absent, those whose entries are the ones read before the copy:
        a chunk evicted and published again meanwhile is a new entry, whose copy is in DRAM, and keeps its location
        (its own feed event brings it here)."""
        if not vanished:
            return []
        now = self.index.get([e.key for e in vanished])
        return [
            e.key
            for e, entry in zip(vanished, now, strict=True)
            if entry is not None and entry.created_s == e.created_s
        ]

    def _store(self, good: list[tuple[ChunkEntry, memoryview]]) -> tuple[list[ChunkEntry], set[bytes]]:
        """Put the verified chunks the NVMe tier lacks (a replay after an index failure finds them there);
        (the chunks now on NVMe, the keys it did not store)."""
        held = self.nvme.contains([e.key for e, _ in good])
        missing = [(e, view) for (e, view), there in zip(good, held, strict=True) if not there]
        stored = self.nvme.put([(e.key, view) for e, view in missing]) if missing else []
        unstored = {e.key for (e, _), ok in zip(missing, stored, strict=True) if not ok}
        return [e for e, _ in good if e.key not in unstored], unstored

    def _failed(self, reason: PersistFailureReason, detail: str, chunks: int) -> None:
        self.stats.failures.failed(reason, detail, chunks, time.monotonic())
        log.warning(
            "write-behind: %d chunks not persisted (%s: %s); kept in DRAM, retried in %.1fs",
            chunks,
            reason,
            detail,
            self.stats.failures.backoff_s,
        )

    def step(self) -> None:
        """One batch; after a failed one, wait out the backoff and replay this consumer's pending events."""
        failures = self.stats.failures
        wait = failures.wait_s(time.monotonic())
        if wait > 0:
            self._stop.wait(wait)
            return
        before = failures.attempts_failed
        try:
            if failures.failing:
                self.index.rewind_feed(self.node, GROUP, CONSUMER)
            self.run_once()
        except IndexUnavailableError as exc:
            self._failed("index", str(exc), 0)
        except Exception as exc:
            self._failed("error", f"{type(exc).__name__}: {exc}", 0)
            raise
        if failures.attempts_failed == before:
            failures.succeeded()


def hold_left_s(newest_created_s: float, now_s: float, hold_s: float) -> float:
    """How long to wait before copying a batch whose youngest chunk was published at ``newest_created_s``: what is
    left of its hold, never more than ``hold_s`` (a publisher's clock ahead of this node's must not stall the copy)."""
    return max(0.0, min(hold_s, newest_created_s + hold_s - now_s))
