"""What the write-behind does with a chunk's DRAM read that misses: a chunk the pool no longer holds loses its
DRAM location; one whose read failed while the pool may still hold it (Mooncake's master slow or away) keeps it,
its feed event stays unacknowledged and the failure is counted, so that it is persisted once the read succeeds."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.services.write_behind import WriteBehind
from prefixcache.cachestore.tiers.dram import ABSENT, FAILED, LATE
from prefixcache.indexer.index import ChunkRecord, FeedEvent, Location
from prefixcache.indexer.tokens import pack_tokens
from tests.in_memory_index import InMemoryIndex

NODE = "node-a"
DRAM = Location("dram", NODE)


class AckedIndex(InMemoryIndex):
    """The in-memory index, recording the feed events it delivers and those the write-behind acknowledges."""

    def __init__(self) -> None:
        super().__init__()
        self.delivered: list[FeedEvent] = []
        self.acked: list[str] = []

    def read_feed(
        self, node: str, group: str, consumer: str, count: int = 256, block_s: float = 0.0
    ) -> list[FeedEvent]:
        events = super().read_feed(node, group, consumer, count, block_s)
        self.delivered += events
        return events

    def ack_feed(self, node: str, group: str, ids: Sequence[str]) -> None:
        self.acked += ids


class Arena:
    def alloc_batch(self, sizes: Sequence[int]) -> list[memoryview]:
        return [memoryview(bytearray(size)) for size in sizes]

    def free(self, slot: memoryview) -> None:
        pass


class MissingPool:
    """A DRAM tier whose reads answer the given codes, one per chunk, in order."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.arena = Arena()

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        assert len(keys) == len(self.answers)
        return list(self.answers)


class Disk:
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)


def test_an_absent_chunk_loses_its_location_and_an_unread_one_keeps_it_unacknowledged() -> None:
    index = AckedIndex()
    root = os.urandom(16)
    records = [
        ChunkRecord.of(
            parent=root,
            packed_tokens=pack_tokens([seed] * 16),
            root=root,
            namespace=b"n" * 16,
            size_bytes=1000,
            location=DRAM,
        )
        for seed in range(3)
    ]
    index.register(records)
    absent, failed, late = (record.key for record in records)
    pool = MissingPool([ABSENT, FAILED, LATE])
    key = ChunkMacKey(os.urandom(32))
    writer = WriteBehind(index, pool, Disk(), NODE, hold_s=0.0, mac_key=key)

    assert writer.run_once(block_s=0) == 3
    gone, *kept = index.get([absent, failed, late])
    assert gone is None  # the index never says a chunk is where it is not: nowhere else, its entry went
    assert all(entry is not None and DRAM in entry.locations for entry in kept)  # still in the pool, for all we know
    events = {event.key: event.id for event in index.delivered}
    assert index.acked == [events[absent]]  # the unread ones' events are replayed after the backoff
    assert writer.stats.failures.counts == {"dram": 2} and writer.stats.failures.failing == "dram"
    assert writer.stats.vanished == 1 and writer.stats.persisted == 0


class RepublishingPool(MissingPool):
    """A pool whose read misses a chunk that is evicted, then published again before the write-behind acts on the
    miss."""

    def __init__(self, index: InMemoryIndex, record: ChunkRecord) -> None:
        super().__init__([ABSENT])
        self.index, self.record = index, record

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        self.index.remove([self.record.key])
        time.sleep(0.01)  # a later publish
        self.index.register([self.record])
        return super().get_into(keys, buffers)


def test_a_chunk_published_again_after_its_copy_was_missed_keeps_its_location() -> None:
    index = AckedIndex()
    root = os.urandom(16)
    record = ChunkRecord.of(
        parent=root, packed_tokens=pack_tokens([5] * 16), root=root, namespace=b"n" * 16, size_bytes=1000, location=DRAM
    )
    index.register([record])
    writer = WriteBehind(
        index, RepublishingPool(index, record), Disk(), NODE, hold_s=0.0, mac_key=ChunkMacKey(os.urandom(32))
    )
    writer.run_once(block_s=0)
    (entry,) = index.get([record.key])
    assert entry is not None and DRAM in entry.locations  # the new entry's copy is in DRAM: its own event follows
