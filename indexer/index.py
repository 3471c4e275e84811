"""The index: which chunks exist, where their bytes live, and the longest cached prefix of a prompt.

Two backends implement ``PrefixIndex``: ``RedisIndex`` (production, shared by every node) and
``InMemoryIndex`` (tests/in_memory_index.py, one process, no server). Both keep the same contract:

* ``register`` is called only after the bytes are stored in the tier named by the record's
  location; a record without a location cannot be built. Registration is atomic per call, and two
  writers of one chunk end with one entry whose locations are the union of theirs.
* ``lookup`` answers in one round trip how many leading chunks are present, plus the best partial
  chunk at the break point, and refreshes last-access time and hit count of the full-chunk hits
  (possibly a moment later: ``flush_access`` waits for that).
* An entry lives while it has at least one location; dropping the last one removes it.
* Every location added or dropped is appended to its node's change feed in the same atomic step,
  so a node's daemon learns of each chunk that lands in its DRAM and persists it (write-behind).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast, runtime_checkable

import numpy as np

from prefixcache.indexer.keys import KEY_BYTES, PrefixQuery, chunk_key, probe_of
from prefixcache.indexer.namespace import NamespaceSpec, describe_mismatch, mismatched_fields, same_model
from prefixcache.indexer.tokens import TOKEN_BYTES

#: dram@node: in the Mooncake pool (the node's segment); nvme@node: in that node's NVMe tier; object@node: in the
#: shared bucket, written by that node, readable by every node.
Tier = Literal["dram", "nvme", "object"]
TIERS: tuple[Tier, ...] = ("dram", "nvme", "object")
#: Candidates a lookup considers in one probe bucket. Buckets hold the chunks under one parent that
#: start with the same PROBE_TOKENS tokens; a busier bucket costs partial hits, never correctness.
MAX_BUCKET_CANDIDATES = 32


@dataclass(frozen=True, order=True)
class Location:
    """Where one copy of a chunk's bytes lives: a tier on a node."""

    tier: Tier
    node: str

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if not self.node or "@" in self.node or "," in self.node:
            raise ValueError(f"node name must be non-empty without '@' or ',', got {self.node!r}")

    def __str__(self) -> str:
        return f"{self.tier}@{self.node}"

    @classmethod
    def parse(cls, text: str) -> Location:
        tier, sep, node = text.partition("@")
        if not sep:
            raise ValueError(f"a location looks like 'dram@node1', got {text!r}")
        return cls(cast(Tier, tier), node)  # checked by __post_init__


@dataclass(frozen=True)
class ChunkIdentity:
    """What a chunk is: its key, lineage, namespace, tenant and size (shared by records and entries)."""

    key: bytes
    parent: bytes
    root: bytes
    namespace: bytes
    tenant: str
    num_tokens: int
    size_bytes: int


@dataclass(frozen=True)
class ChunkRecord(ChunkIdentity):
    """A stored chunk to register. Build it with ``ChunkRecord.of`` after the bytes are stored."""

    location: Location
    #: The chunk's packed tokens, kept only when it is long enough to be found as a partial hit.
    probe: bytes | None = None
    packed_tokens: bytes = b""

    @classmethod
    def of(
        cls,
        *,
        parent: bytes,
        packed_tokens: bytes,
        root: bytes,
        namespace: bytes,
        size_bytes: int,
        location: Location,
        tenant: str = "",
    ) -> ChunkRecord:
        """Derive key and probe from the chunk's tokens so that a record can never carry a wrong key."""
        if not packed_tokens or len(packed_tokens) % TOKEN_BYTES:
            raise ValueError("a chunk holds at least one whole token")
        probe = probe_of(parent, packed_tokens)
        return cls(
            key=chunk_key(parent, packed_tokens),
            parent=parent,
            root=root,
            namespace=namespace,
            tenant=tenant,
            num_tokens=len(packed_tokens) // TOKEN_BYTES,
            size_bytes=size_bytes,
            location=location,
            probe=probe,
            packed_tokens=packed_tokens if probe is not None else b"",
        )


@dataclass(frozen=True)
class ChunkEntry(ChunkIdentity):
    """An index entry as read back."""

    locations: frozenset[Location]
    created_s: float
    last_access_s: float
    hits: int
    pinned_until_s: float = 0.0  # 0: not pinned; math.inf: until unpinned

    def pinned(self, now_s: float) -> bool:
        """Whether the pin holds at ``now_s``, the index's clock (``PrefixIndex.clock_s``)."""
        return self.pinned_until_s > now_s


@dataclass(frozen=True)
class PartialHit:
    """A stored chunk whose first ``tokens`` tokens equal the prompt's tokens at the break point;
    ``in_dram``: False when the index lists it in no DRAM tier (only on NVMe)."""

    key: bytes
    tokens: int
    stored_tokens: int
    in_dram: bool = True


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix: full chunks ``keys`` then, optionally, part of one more chunk.

    ``without_dram``: positions in ``keys`` whose chunk the index lists in no DRAM tier (only on NVMe),
    so a loader can start reading them from disk at once instead of asking DRAM first. ``remote_dram``: for a
    lookup that named the asking node (``here``), positions whose DRAM copies all lie on other nodes, the partial
    chunk's being ``len(keys)``: their reads cross the network.
    """

    keys: list[bytes]
    chunk_tokens: int
    partial: PartialHit | None = None
    without_dram: frozenset[int] = frozenset()
    remote_dram: frozenset[int] = frozenset()

    @property
    def on_nvme_alone(self) -> frozenset[int]:
        """Positions of the chunks the index lists on NVMe alone, the partial chunk's being ``len(keys)``."""
        if self.partial is None or self.partial.in_dram:
            return self.without_dram
        return self.without_dram | {len(self.keys)}

    @property
    def full_tokens(self) -> int:
        return len(self.keys) * self.chunk_tokens

    @property
    def matched_tokens(self) -> int:
        return self.full_tokens + (self.partial.tokens if self.partial else 0)


@dataclass(frozen=True)
class FeedEvent:
    """One change to the locations on a node: a copy of ``key`` was added to or dropped from ``location``."""

    id: str
    op: Literal["add", "drop"]
    location: Location
    key: bytes


@dataclass(frozen=True)
class Usage:
    """Chunks and their bytes (entries of a namespace, or copies in one tier)."""

    chunks: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class NamespaceUsage:
    """What one namespace holds: its entries, and its copies per tier (over all nodes)."""

    entries: Usage
    tiers: dict[Tier, Usage]


def usage_of(counters: Mapping[str, int]) -> NamespaceUsage:
    """A namespace's usage from its counters, named as in the index: ``chunks``, ``bytes``, ``<tier>:chunks``
    and ``<tier>:bytes`` (tiers without copies are left out)."""
    tiers = {t: Usage(counters.get(f"{t}:chunks", 0), counters.get(f"{t}:bytes", 0)) for t in TIERS}
    return NamespaceUsage(
        entries=Usage(counters.get("chunks", 0), counters.get("bytes", 0)),
        tiers={tier: usage for tier, usage in tiers.items() if usage.chunks > 0},
    )


@dataclass(frozen=True)
class NamespaceCheck:
    """Result of registering a client's namespace: is it new, and which same-model ones differ."""

    spec: NamespaceSpec
    known: bool
    conflicts: list[NamespaceSpec] = field(default_factory=list)

    def mismatches(self) -> dict[str, dict[str, tuple[object, object]]]:
        return {c.digest.hex(): mismatched_fields(self.spec, c) for c in self.conflicts}


class IndexConnection(Protocol):
    """The backend itself: whether it answers, and closing it."""

    def ping(self) -> None:
        """Raise IndexUnavailableError unless the backend answers."""

    def close(self) -> None: ...


class IndexLookup(Protocol):
    """Finding the longest cached prefix of prompts, and counting its use (connectors, the proxy, admin)."""

    def lookup(
        self, query: PrefixQuery, *, touch: bool = True, avoid: AbstractSet[str] = frozenset(), here: str = ""
    ) -> PrefixMatch:
        """The longest cached prefix. ``touch=False`` leaves access statistics alone (inspection, not use).
        ``avoid``: nodes that are down or suspect (indexer/peers.py): the prefix ends at the first chunk with no copy
        on another node, and a chunk counts as in DRAM only for a DRAM copy on another node. ``here``: the asking
        node, for ``PrefixMatch.remote_dram``."""

    def lookup_many(
        self,
        queries: Sequence[PrefixQuery],
        *,
        touch: bool = True,
        avoid: AbstractSet[str] = frozenset(),
        here: str = "",
    ) -> list[PrefixMatch]:
        """``lookup`` of each query, in one round trip: the chains of one prompt's shards (one per rank)."""

    def touch(self, matches: Sequence[PrefixMatch]) -> None:
        """Count matches that lookups made with ``touch=False`` found as used after all: their full chunks' last
        access and hit counts, as ``touch=True`` would have (a lookup made ahead, then taken)."""

    def flush_access(self) -> None:
        """Apply the last-access/hit updates of past lookups now (a backend may apply them later)."""


class IndexRegistration(Protocol):
    """Entries by key: registering chunks and namespaces, reading entries back, adding and dropping their
    locations, removing and pinning them (the node's services that store, move and evict bytes). ``clock_s`` is
    the clock entries' times and pins are written in."""

    def clock_s(self) -> float:
        """The index's clock, Unix seconds: what entries' times (created, last access), pins and leases are
        written in, so every node compares them against it rather than against its own clock."""

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceCheck: ...

    def register(self, records: Sequence[ChunkRecord]) -> None: ...

    def get(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]: ...

    def add_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        """Add a copy's location to existing entries; returns the keys that had no entry."""

    def drop_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        """Remove a location; returns the keys whose entry went away with their last location."""

    def remove(self, keys: Sequence[bytes]) -> int:
        """Delete entries outright; returns how many existed."""

    def set_pin(self, keys: Sequence[bytes], until_s: float) -> int:
        """Pin entries until ``until_s`` (math.inf: forever; 0: unpin); returns how many exist."""


class IndexListing(Protocol):
    """Walking what the index holds: every entry, pages in key order, a chunk's children, the namespaces."""

    def scan(self, batch: int = 512) -> Iterator[ChunkEntry]:
        """Every entry, in no particular order."""

    def page(self, after: bytes | None, count: int) -> list[ChunkEntry]:
        """Up to ``count`` entries whose keys sort after ``after`` (from the first when None), in key order:
        a stable cursor for listings that neither repeats nor skips entries present throughout."""

    def children(self, key: bytes) -> list[bytes]:
        """Keys of the chunks registered directly below ``key``."""

    def namespaces(self) -> list[NamespaceSpec]: ...


class IndexAccounting(Protocol):
    """What each namespace and tenant holds, kept up to date by every change (quotas, admin)."""

    def usage(self) -> dict[bytes, NamespaceUsage]:
        """Per namespace digest: its entries and its copies per tier, kept up to date by every change."""

    def tenant_usage(self) -> dict[str, Usage]:
        """Per tenant id (``""``: chunks without a tenant), its entries over every namespace, kept up to date by
        every change; tenants holding nothing are left out."""

    def count_tenant_usage(self) -> int:
        """Add to ``tenant_usage`` the entries it does not count yet: those an index filled by an earlier version
        holds. Returns how many were added; safe to run beside any other call, and again (a daemon's start runs
        it)."""


class IndexFeed(Protocol):
    """Each node's change feed of locations added and dropped, read by consumer groups (write-behind)."""

    def read_feed(
        self, node: str, group: str, consumer: str, count: int = 256, block_s: float = 0.0
    ) -> list[FeedEvent]:
        """Next location changes on ``node`` for a consumer group: first those delivered to this consumer
        but never acknowledged (it crashed), then new ones, waiting up to ``block_s`` for some."""

    def ack_feed(self, node: str, group: str, ids: Sequence[str]) -> None:
        """Acknowledge events handled; unacknowledged ones are delivered again after a restart."""

    def rewind_feed(self, node: str, group: str, consumer: str) -> None:
        """Deliver this consumer's unacknowledged events again, from its next ``read_feed`` on, before new
        ones: how a consumer retries the events of a step that failed without restarting."""

    def feed_backlog(self, node: str, group: str) -> int:
        """Events on ``node``'s feed that ``group`` has not acknowledged yet (its queue depth)."""


@runtime_checkable
class PrefixIndex(IndexConnection, IndexLookup, IndexRegistration, IndexListing, IndexAccounting, IndexFeed, Protocol):
    """Every role at once: what a backend implements. See the module docstring for the contract; a consumer that
    needs one role takes that role's Protocol."""


def check_namespace(spec: NamespaceSpec, registered: Iterable[NamespaceSpec]) -> NamespaceCheck:
    """Compare a client's namespace with those registered before it (shared by both backends)."""
    registered = list(registered)
    known = any(r.digest == spec.digest for r in registered)
    conflicts = [] if known else [r for r in registered if same_model(spec, r)]
    return NamespaceCheck(spec=spec, known=known, conflicts=conflicts)


def attach_namespace(
    index: IndexRegistration, spec: NamespaceSpec, log: logging.Logger | None = None
) -> NamespaceCheck:
    """Register a client's namespace and warn, naming the differing fields, when its model is
    registered only under other namespaces: the client would otherwise see a silent 0% hit rate."""
    check = index.register_namespace(spec)
    if check.conflicts:
        (log or logging.getLogger("prefixcache")).warning(describe_mismatch(spec, check.conflicts))
    return check


def subtree(index: IndexListing, keys: Iterable[bytes], limit: int) -> list[bytes]:
    """``keys`` and every key registered below them (children, transitively), at most ``limit`` of them.

    A removed entry leaves its parent's set of children, but its own children stay filed under its key:
    pass every key of a chain (present or not) to reach what lies below a hole. Entries are not read
    here: callers read the ones they act on.
    """
    found: dict[bytes, None] = {}
    level = list(dict.fromkeys(keys))
    while level and len(found) < limit:
        found.update(dict.fromkeys(level[: limit - len(found)]))
        level = [child for key in level for child in index.children(key) if child not in found]
    return list(found)


def best_partial(
    query: PrefixQuery, position: int, candidates: Iterable[tuple[bytes, bytes, bool]]
) -> PartialHit | None:
    """The candidate sharing the most leading tokens with the prompt's chunk at ``position``.

    ``candidates`` are ``(key, packed_tokens, in_dram)`` triples from the probe bucket. Each is verified by
    recomputing its key from its parent and tokens, so a corrupt bucket can only cost a hit.
    """
    wanted = query.tokens_from(position)
    if wanted.size == 0:
        return None
    parent = query.parent(position)
    best: PartialHit | None = None
    for key, packed, in_dram in candidates:
        if len(key) != KEY_BYTES or chunk_key(parent, packed) != key:
            continue
        stored = np.frombuffer(packed, dtype="<u4")
        n = min(stored.size, wanted.size)
        differ = np.flatnonzero(stored[:n] != wanted[:n])
        shared = int(differ[0]) if differ.size else n
        if shared and (best is None or shared > best.tokens):
            best = PartialHit(key=key, tokens=shared, stored_tokens=int(stored.size), in_dram=in_dram)
    return best
