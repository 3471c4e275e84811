"""Byte quotas per tenant and per namespace: how much of the cache each may hold, and how much more it may add.

A quota bounds the bytes of a scope's entries, each chunk counted once whatever its copies (the index's
``tenant_usage`` and ``usage``), pinned chunks included: a pin keeps a chunk, never lets it outgrow its
tenant's share. A tenant is its salt's id (``namespace.tenant_id``), never the salt; ``none`` is the tenant of
chunks published without one.

Quotas live in the index's Redis, beside the namespaces (``<prefix>:quotas``, field ``<scope>:<id>`` -> bytes),
so every daemon enforces the same ones; a daemon's settings give the quotas nobody set through the REST API.
The daemon's quota loop (``cachestore/services/quotas.py``) evicts a scope's own least recently used chunks
and writes how many bytes each scope may still add (``<prefix>:quota:room``), once a round. Publishers read that
at most once a ``QUOTA_REFRESH_S``, spend it together through a counter per round and scope
(``<prefix>:quota:spent:<round>:<scope>``), and skip the chunks of a scope without room (``QuotaGate``): a tenant
at its quota adds nothing until its own chunks make room, however many engines publish for it, so its traffic
does not push another tenant's chunks out.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import redis

from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import ChunkIdentity
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import text

ScopeKind = Literal["tenant", "namespace"]
SCOPE_KINDS: tuple[ScopeKind, ...] = ("tenant", "namespace")
#: The id of the tenant of chunks published without a salt.
NO_TENANT = "none"
#: How often a publisher reads the room the quota loop last measured (the loop measures it once a second).
QUOTA_REFRESH_S = 1.0
#: How long a round's spending counters outlive their last spend: rounds are a second apart.
SPENT_TTL_MS = 10_000
_ID_PATTERNS = {"tenant": re.compile(r"^(none|[0-9a-f]{16})$"), "namespace": re.compile(r"^[0-9a-f]{32}$")}


@dataclass(frozen=True, order=True)
class QuotaScope:
    """What a quota bounds: one tenant (its id, 16 hex, or ``none``) or one namespace (its digest, 32 hex)."""

    kind: ScopeKind
    id: str

    def __post_init__(self) -> None:
        if self.kind not in SCOPE_KINDS:
            raise ConfigError(f"a quota's scope is one of {', '.join(SCOPE_KINDS)}, not {self.kind!r}")
        if not _ID_PATTERNS[self.kind].match(self.id):
            shape = "16 hex characters or 'none'" if self.kind == "tenant" else "32 hex characters"
            raise ConfigError(f"a {self.kind} id is {shape}, not {self.id!r}")

    @classmethod
    def of_tenant(cls, tenant: str) -> QuotaScope:
        """The scope of an entry's tenant field (``""``: no tenant)."""
        return cls("tenant", tenant or NO_TENANT)

    @classmethod
    def of_namespace(cls, digest: bytes) -> QuotaScope:
        return cls("namespace", digest.hex())

    @classmethod
    def parse(cls, text: str) -> QuotaScope:
        kind, sep, scope_id = text.partition(":")
        if not sep:
            raise ConfigError(f"a quota's scope looks like 'tenant:<id>' or 'namespace:<digest>', not {text!r}")
        return cls(cast(ScopeKind, kind), scope_id)  # checked by __post_init__

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"

    def holds(self, chunk: ChunkIdentity) -> bool:
        """Whether ``chunk`` counts toward this scope."""
        if self.kind == "tenant":
            return (chunk.tenant or NO_TENANT) == self.id
        return chunk.namespace.hex() == self.id


def scopes_of(tenant: str, namespace: bytes) -> tuple[QuotaScope, QuotaScope]:
    """The two scopes a chunk counts toward: its tenant's (its entry's ``tenant``) and its namespace's."""
    return QuotaScope.of_tenant(tenant), QuotaScope.of_namespace(namespace)


class QuotaStore:
    """The quotas set through the REST API, each scope's room, and whose turn it is to enforce them, in the index's
    Redis."""

    def __init__(self, client: RedisClient, keyspace: Keyspace) -> None:
        self._redis = client
        self._keys = keyspace
        self._quotas = keyspace.quotas
        self._room = keyspace.quota_room
        self._lock = keyspace.quota_lock

    def all(self) -> dict[QuotaScope, int]:
        """Every quota set; a field this version cannot read is left out."""
        quotas = {}
        for name, value in self._redis.hgetall(self._quotas).items():
            try:
                quotas[QuotaScope.parse(text(name))] = int(value)
            except (ConfigError, ValueError, UnicodeDecodeError):
                continue
        return quotas

    def set(self, scope: QuotaScope, limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ConfigError(f"a quota is a number of bytes, at least 0, not {limit_bytes}")
        self._redis.hset(self._quotas, str(scope), limit_bytes)

    def delete(self, scope: QuotaScope) -> bool:
        """Remove a quota set through the API; returns whether there was one."""
        return bool(self._redis.hdel(self._quotas, str(scope)))

    def room(self) -> tuple[str, dict[QuotaScope, int]]:
        """The round that last measured room, and the bytes each scope with a quota could still add then."""
        try:
            found = json.loads(self._redis.get(self._room) or b"{}")
            room = {QuotaScope.parse(name): int(left) for name, left in found.get("room", {}).items()}
            return str(found.get("round", "")), room
        except (ConfigError, ValueError, TypeError, AttributeError):  # another version's value: no quota known
            return "", {}

    def set_room(self, round_id: str, room: dict[QuotaScope, int]) -> None:
        """Replace the room of every scope: one value, so publishers never see it half written."""
        self._redis.set(self._room, json.dumps({"round": round_id, "room": {str(k): v for k, v in room.items()}}))

    def spend(self, round_id: str, amounts: Mapping[QuotaScope, int]) -> dict[QuotaScope, int]:
        """Add ``amounts`` (negative: give back) to what publishers spent of round ``round_id``'s room, per scope;
        returns each scope's total spent, this call's included. One round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for scope, amount in amounts.items():
            key = self._keys.quota_spent(round_id, str(scope))
            pipe.incrby(key, amount)
            pipe.pexpire(key, SPENT_TTL_MS)
        replies = pipe.execute()
        return {scope: int(replies[2 * i]) for i, scope in enumerate(amounts)}

    def take_turn(self, node: str, hold_s: float) -> bool:
        """Whether this node enforces quotas for the next ``hold_s`` seconds: one daemon of the cluster at a time,
        so two never evict the same tenant's chunks twice over."""
        if self._redis.set(self._lock, node, nx=True, px=int(hold_s * 1000)):
            return True
        holder = self._redis.get(self._lock)
        if holder is not None and text(holder, errors="replace") == node:
            self._redis.pexpire(self._lock, int(hold_s * 1000))
            return True
        return False


class QuotaGate:
    """What a publisher asks before storing chunks: have their tenant and namespace room for them?

    Each round of the quota loop measures every scope's room (its quota less what it holds); a gate reads it at most
    once a ``refresh_s``. The publishers of a scope share that room: a call adds what it asks to the round's
    spending counters (``QuotaStore.spend``), admits chunks in order while what was spent before it leaves room,
    and gives back what it did not admit. So all publishers together add at most a round's room, for one round trip
    per call that touches a scope with a quota (two when some chunk is refused). A call that sees another's spending
    before that one gives back may refuse a chunk that would have fit: never one too many. While the index is
    unreachable chunks are admitted (their registration fails as well).
    """

    def __init__(self, store: QuotaStore, refresh_s: float = QUOTA_REFRESH_S) -> None:
        self._store = store
        self._refresh_s = refresh_s
        self._round = ""
        self._room: dict[QuotaScope, int] = {}
        self._read_at = -float("inf")
        self._lock = threading.Lock()

    def admit(self, tenant: str, chunks: Sequence[tuple[bytes, int]]) -> list[bool]:
        """Whether each chunk, (namespace, size in bytes) of this tenant (id, ``""`` for none), may be published;
        the bytes of those admitted are spent from their scopes' room."""
        with self._lock:
            self._refresh()
            round_id, room = self._round, self._room
        limited = [[scope for scope in scopes_of(tenant, namespace) if scope in room] for namespace, _ in chunks]
        asked: Counter[QuotaScope] = Counter()
        for scopes, (_, size) in zip(limited, chunks, strict=True):
            for scope in scopes:
                asked[scope] += size
        if not asked:
            return [True] * len(chunks)
        try:
            spent = self._store.spend(round_id, asked)
        except redis.RedisError:
            return [True] * len(chunks)
        left = {scope: room[scope] - (spent[scope] - asked[scope]) for scope in asked}
        admitted = []
        for scopes, (_, size) in zip(limited, chunks, strict=True):
            fits = all(left[scope] >= size for scope in scopes)
            if fits:
                for scope in scopes:
                    left[scope] -= size
                    asked[scope] -= size
            admitted.append(fits)
        if unused := {scope: -amount for scope, amount in asked.items() if amount}:
            with contextlib.suppress(redis.RedisError):
                self._store.spend(round_id, unused)
        return admitted

    def _refresh(self) -> None:
        if time.monotonic() - self._read_at < self._refresh_s:
            return
        self._read_at = time.monotonic()
        with contextlib.suppress(redis.RedisError):
            self._round, self._room = self._store.room()
