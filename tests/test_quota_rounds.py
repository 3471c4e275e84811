"""A quota round's reading of the index (cachestore/services/quotas.py): at most ``scan_entries`` entries a round,
on from where the last round stopped; its victims the oldest of the scope's entries among what it read, never
another scope's. Pure logic over the in-memory index; the store of quotas and the evictor are stand-ins that keep
what the enforcer gives them (tests/test_quotas.py runs the real ones in a daemon)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prefixcache.cachestore.services.eviction import Eviction
from prefixcache.cachestore.services.quotas import QuotaEnforcer
from prefixcache.indexer.index import ChunkEntry, ChunkRecord, Location
from prefixcache.indexer.quotas import QuotaScope
from prefixcache.indexer.tokens import pack_tokens
from tests.in_memory_index import InMemoryIndex

SIZE = 100
NAMESPACE = bytes(16)
LIMIT = 500  # low mark 450: a tenant holding 10 chunks must lose 6
A, B = "a" * 16, "b" * 16


class Quotas:
    """The part of QuotaStore a round uses: the API's quotas and the rooms it writes."""

    def __init__(self, limits: dict[QuotaScope, int]) -> None:
        self.limits = limits
        self.rooms: list[dict[QuotaScope, int]] = []

    def all(self) -> dict[QuotaScope, int]:
        return dict(self.limits)

    def set_room(self, round_id: str, room: dict[QuotaScope, int]) -> None:
        self.rooms.append(room)


class Evictor:
    """Removes what it is given from the index, as the real one does once every copy is gone."""

    def __init__(self, index: InMemoryIndex) -> None:
        self.index = index
        self.rounds: list[list[bytes]] = []

    def evict(self, entries: Sequence[ChunkEntry]) -> Eviction:
        self.rounds.append([e.key for e in entries])
        self.index.remove([e.key for e in entries])
        return Eviction(removed=list(entries))


def publish(index: InMemoryIndex, tenants: Sequence[str]) -> list[bytes]:
    """A chunk per tenant named, registered in this order (the in-memory index's scans read them so); returns their
    keys."""
    keys = []
    for i, tenant in enumerate(tenants):
        record = ChunkRecord.of(
            parent=bytes(16),
            packed_tokens=pack_tokens([i + 1]),
            root=bytes(16),
            namespace=NAMESPACE,
            size_bytes=SIZE,
            location=Location("dram", "node-a"),
            tenant=tenant,
        )
        index.register([record])
        keys.append(record.key)
    return keys


class ReadIndex(InMemoryIndex):
    """Records the entries its scans hand out, as they are taken."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[bytes] = []

    def scan(self, batch: int = 512) -> Iterator[ChunkEntry]:
        for entry in super().scan(batch):
            self.read.append(entry.key)
            yield entry


def enforcer(index: InMemoryIndex, evictor: Evictor, scan_entries: int, protected: bool = False) -> QuotaEnforcer:
    quotas = Quotas({QuotaScope.of_tenant(A): LIMIT})
    return QuotaEnforcer(
        index,
        quotas,  # type: ignore[arg-type]
        evictor,  # type: ignore[arg-type]
        "node-a",
        lambda keys: [protected] * len(keys),
        scan_entries=scan_entries,
    )


def test_an_index_smaller_than_a_rounds_reading_loses_exactly_the_scopes_oldest_chunks():
    index = ReadIndex()
    keys = publish(index, [A, B] * 10)
    for i, key in enumerate(keys):
        index._touch([key], 1000.0 - i)  # the first published used last
    evictor = Evictor(index)
    assert enforcer(index, evictor, scan_entries=100).run_once() == 6
    assert set(evictor.rounds[0]) == set(keys[0::2][::-1][:6])  # a's six oldest
    assert index.tenant_usage()[A].bytes == 4 * SIZE and index.tenant_usage()[B].bytes == 10 * SIZE
    assert index.read == keys  # read once


def test_each_round_chooses_among_the_window_it_read_and_the_next_reads_on():
    index = InMemoryIndex()
    keys = publish(index, [A, B] * 10)  # read in this order
    evictor = Evictor(index)
    quotas = enforcer(index, evictor, scan_entries=4)
    rounds = 0
    while index.tenant_usage()[A].bytes > 0.9 * LIMIT:
        quotas.run_once()
        rounds += 1
        assert rounds <= 5
    assert evictor.rounds == [keys[0:4:2], keys[4:8:2], keys[8:12:2]]  # a's two of each window of four
    assert index.tenant_usage()[B].bytes == 10 * SIZE


def test_a_round_that_reaches_the_end_of_the_index_reads_on_from_its_beginning():
    index = ReadIndex()
    keys = publish(index, [A] * 15)
    quotas = enforcer(index, Evictor(index), scan_entries=10, protected=True)  # a stays above its mark
    reads = []
    for _ in range(3):
        index.read = []
        assert quotas.run_once() == 0  # all pinned
        reads.append(index.read)
    assert reads == [keys[0:10], keys[10:15] + keys[0:5], keys[5:15]]
