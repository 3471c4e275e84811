"""A test double of the index: the Redis backend's behaviour in one process, for unit tests of pure logic.

It mirrors the data model of ``indexer/lua`` (entries, children sets, probe buckets, namespace
registry) in dicts behind one lock, so every operation is atomic as a Redis script is.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Literal

from prefixcache.indexer.index import (
    MAX_BUCKET_CANDIDATES,
    ChunkEntry,
    ChunkRecord,
    FeedEvent,
    Location,
    NamespaceCheck,
    NamespaceUsage,
    PrefixIndex,
    PrefixMatch,
    Usage,
    best_partial,
    check_namespace,
    usage_of,
)
from prefixcache.indexer.keys import PrefixQuery
from prefixcache.indexer.namespace import NamespaceSpec


@dataclass
class _Slot:
    entry: ChunkEntry
    probe: bytes | None
    locations: set[Location] = field(default_factory=set)


class InMemoryIndex(PrefixIndex):
    """``PrefixIndex`` held in this process's memory (lost on exit; the NVMe tier rebuilds it)."""

    def __init__(self, max_candidates: int = MAX_BUCKET_CANDIDATES) -> None:
        self._lock = threading.RLock()
        self._slots: dict[bytes, _Slot] = {}
        self._children: defaultdict[bytes, set[bytes]] = defaultdict(set)
        self._buckets: defaultdict[bytes, dict[bytes, bytes]] = defaultdict(dict)
        self._namespaces: dict[bytes, NamespaceSpec] = {}
        self._max_candidates = max_candidates
        self._feeds: defaultdict[str, list[FeedEvent]] = defaultdict(list)
        self._feed_offsets: dict[tuple[str, str], int] = {}
        self._feed_changed = threading.Condition(self._lock)

    def ping(self) -> None:
        """Always reachable."""

    def clock_s(self) -> float:
        """One process: its own clock."""
        return time.time()

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceCheck:
        with self._lock:
            check = check_namespace(spec, self._namespaces.values())
            self._namespaces.setdefault(spec.digest, spec)
        return check

    def namespaces(self) -> list[NamespaceSpec]:
        with self._lock:
            return list(self._namespaces.values())

    def lookup(
        self, query: PrefixQuery, *, touch: bool = True, avoid: AbstractSet[str] = frozenset(), here: str = ""
    ) -> PrefixMatch:
        now = time.time()
        with self._lock:
            hits = 0
            for key in query.keys:
                if key not in self._slots or not self._reachable(key, avoid):
                    break
                hits += 1
            if touch:
                self._touch(query.keys[:hits], now)
            probe = query.probes[hits]
            bucket = list(self._buckets.get(probe, {}).items())[: self._max_candidates] if probe else []
            candidates = [
                (key, packed, key not in self._slots or self._in_dram(key, avoid))
                for key, packed in bucket
                if key not in self._slots or self._reachable(key, avoid)
            ]
            without_dram = frozenset(i for i, key in enumerate(query.keys[:hits]) if not self._in_dram(key, avoid))
            partial = best_partial(query, hits, candidates) if candidates else None
            chosen = [*query.keys[:hits], *([partial.key] if partial else [])]
            remote = frozenset(
                i
                for i, key in enumerate(chosen)
                if here and key in self._slots and self._in_dram(key, avoid) and not self._in_dram_on(key, here)
            )
        return PrefixMatch(
            keys=list(query.keys[:hits]),
            chunk_tokens=query.chunk_tokens,
            partial=partial,
            without_dram=without_dram,
            remote_dram=remote,
        )

    def lookup_many(
        self,
        queries: Sequence[PrefixQuery],
        *,
        touch: bool = True,
        avoid: AbstractSet[str] = frozenset(),
        here: str = "",
    ) -> list[PrefixMatch]:
        return [self.lookup(query, touch=touch, avoid=avoid, here=here) for query in queries]

    def _in_dram_on(self, key: bytes, node: str) -> bool:
        """Whether ``key``'s entry lists a DRAM copy on ``node`` (call with the lock held)."""
        return any(at.tier == "dram" and at.node == node for at in self._slots[key].locations)

    def _reachable(self, key: bytes, avoid: AbstractSet[str]) -> bool:
        """Whether ``key``'s entry lists a copy on a node not in ``avoid`` (call with the lock held)."""
        return any(at.tier == "object" or at.node not in avoid for at in self._slots[key].locations)

    def touch(self, matches: Sequence[PrefixMatch]) -> None:
        now = time.time()
        with self._lock:
            for match in matches:
                self._touch([key for key in match.keys if key in self._slots], now)  # some may be gone since

    def _touch(self, keys: Sequence[bytes], now: float) -> None:
        for key in keys:
            slot = self._slots[key]
            slot.entry = replace(slot.entry, last_access_s=now, hits=slot.entry.hits + 1)

    def flush_access(self) -> None:
        """Lookups update access statistics synchronously here."""

    def register(self, records: Sequence[ChunkRecord]) -> None:
        now = time.time()
        with self._lock:
            for r in records:
                slot = self._slots.get(r.key)
                if slot is None:
                    entry = ChunkEntry(
                        key=r.key,
                        parent=r.parent,
                        root=r.root,
                        namespace=r.namespace,
                        tenant=r.tenant,
                        num_tokens=r.num_tokens,
                        size_bytes=r.size_bytes,
                        locations=frozenset(),
                        created_s=now,
                        last_access_s=now,
                        hits=0,
                    )
                    slot = self._slots[r.key] = _Slot(entry=entry, probe=r.probe)
                    self._children[r.parent].add(r.key)
                    if r.probe:
                        self._buckets[r.probe][r.key] = r.packed_tokens
                self._add(slot, r.location)

    def get(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]:
        with self._lock:
            return [self._view(self._slots.get(key)) for key in keys]

    def add_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        missing = []
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is None:
                    missing.append(key)
                else:
                    self._add(slot, location)
        return missing

    def drop_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        gone = []
        with self._lock:
            for key in keys:
                slot = self._slots.get(key)
                if slot is not None and location in slot.locations:
                    slot.locations.discard(location)
                    self._publish("drop", location, key)
                    if not slot.locations:
                        self._remove_one(key)
                        gone.append(key)
        return gone

    def remove(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            return sum(self._remove_one(key) for key in keys)

    def set_pin(self, keys: Sequence[bytes], until_s: float) -> int:
        with self._lock:
            pinned = 0
            for key in keys:
                slot = self._slots.get(key)
                if slot is not None:
                    slot.entry = replace(slot.entry, pinned_until_s=until_s)
                    pinned += 1
            return pinned

    def children(self, key: bytes) -> list[bytes]:
        with self._lock:
            return sorted(self._children.get(key, ()))

    def read_feed(
        self, node: str, group: str, consumer: str, count: int = 256, block_s: float = 0.0
    ) -> list[FeedEvent]:
        """At-most-once here: the embedded index lives and dies with its one process."""
        with self._feed_changed:
            offset = self._feed_offsets.get((node, group), 0)
            if offset == len(self._feeds[node]) and block_s > 0:
                self._feed_changed.wait(block_s)
            events = self._feeds[node][offset : offset + count]
            self._feed_offsets[(node, group)] = offset + len(events)
            return events

    def ack_feed(self, node: str, group: str, ids: Sequence[str]) -> None:
        """Nothing to acknowledge: events are delivered once."""

    def rewind_feed(self, node: str, group: str, consumer: str) -> None:
        """Nothing to deliver again: events are delivered once."""

    def _add(self, slot: _Slot, location: Location) -> None:
        if location not in slot.locations:
            slot.locations.add(location)
            self._publish("add", location, slot.entry.key)

    def _publish(self, op: Literal["add", "drop"], location: Location, key: bytes) -> None:
        events = self._feeds[location.node]
        events.append(FeedEvent(id=str(len(events)), op=op, location=location, key=key))
        self._feed_changed.notify_all()

    def scan(self, batch: int = 512) -> Iterator[ChunkEntry]:
        with self._lock:
            entries = [self._view(slot) for slot in self._slots.values()]
        yield from entries  # type: ignore[misc]

    def page(self, after: bytes | None, count: int) -> list[ChunkEntry]:
        with self._lock:
            keys = sorted(self._slots)
            start = bisect.bisect_right(keys, after) if after else 0
            return [self._view(self._slots[key]) for key in keys[start : start + count]]  # type: ignore[misc]

    def usage(self) -> dict[bytes, NamespaceUsage]:
        """Counted on demand: one process's index is small enough."""
        counts: defaultdict[bytes, Counter[str]] = defaultdict(Counter)
        with self._lock:
            for slot in self._slots.values():
                entry, tally = slot.entry, counts[slot.entry.namespace]
                tally["chunks"] += 1
                tally["bytes"] += entry.size_bytes
                for location in slot.locations:
                    tally[location.tier + ":chunks"] += 1
                    tally[location.tier + ":bytes"] += entry.size_bytes
        return {ns: usage_of(tally) for ns, tally in counts.items()}

    def count_tenant_usage(self) -> int:
        """Nothing to add: usage is counted on demand."""
        return 0

    def tenant_usage(self) -> dict[str, Usage]:
        """Counted on demand, as ``usage``."""
        counts: Counter[str] = Counter()
        sizes: Counter[str] = Counter()
        with self._lock:
            for slot in self._slots.values():
                counts[slot.entry.tenant] += 1
                sizes[slot.entry.tenant] += slot.entry.size_bytes
        return {tenant: Usage(counts[tenant], sizes[tenant]) for tenant in counts}

    def feed_backlog(self, node: str, group: str) -> int:
        with self._lock:
            return len(self._feeds[node]) - self._feed_offsets.get((node, group), 0)

    def close(self) -> None:
        """Nothing to release."""

    def _in_dram(self, key: bytes, avoid: AbstractSet[str] = frozenset()) -> bool:
        """Whether ``key``'s entry lists a DRAM location on a node not in ``avoid`` (call with the lock held)."""
        return any(at.tier == "dram" and at.node not in avoid for at in self._slots[key].locations)

    def _remove_one(self, key: bytes) -> int:
        slot = self._slots.pop(key, None)
        if slot is None:
            return 0
        for location in slot.locations:
            self._publish("drop", location, key)
        siblings = self._children.get(slot.entry.parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[slot.entry.parent]
        if slot.probe:
            bucket = self._buckets.get(slot.probe)
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    del self._buckets[slot.probe]
        return 1

    @staticmethod
    def _view(slot: _Slot | None) -> ChunkEntry | None:
        if slot is None:
            return None
        return replace(slot.entry, locations=frozenset(slot.locations))
