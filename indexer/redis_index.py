"""The production index: entries in Redis, every multi-key operation one Lua script per shard.

Layout and scripts live in ``indexer/lua``; ``common.lua`` documents the keys, ``redis_shards.py`` how they
are spread over a Redis Cluster's masters. A lookup is one round trip to the shard of the prompt's chain
(one more, on a Cluster, where the chain breaks in its very first chunk: that chunk's probe bucket lies on
the probe's own shard). Operations that name chunks by key alone ask every shard, which answers for the
entries it holds. Scripts are sent by SHA (redis-py's ``Script`` reloads them after a Redis restart). All
calls use short socket timeouts: an unreachable Redis, or a Cluster master between its failure and its
replica's promotion, surfaces as ``IndexUnavailableError`` quickly, which callers treat as a miss.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager, suppress
from importlib import resources
from typing import Any, Literal, cast

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixcache.indexer.access_log import AccessLog, Hits
from prefixcache.indexer.errors import IndexUnavailableError
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
    Tier,
    Usage,
    best_partial,
    check_namespace,
    usage_of,
)
from prefixcache.indexer.keys import KEY_BYTES, PrefixQuery
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_clients import (
    CONNECT_TIMEOUT_S,
    SOCKET_TIMEOUT_S,
    RedisClient,
    deployment_problem,
    redact_url,
    redis_client,
)
from prefixcache.indexer.redis_replies import ScriptArg, raw, stream_messages, text
from prefixcache.indexer.redis_shards import Shard, shards_of
from prefixcache.indexer.unreadable_records import UnreadableRecords

log = logging.getLogger("prefixcache.index")

_NO_PROBE = bytes(KEY_BYTES)  # sent where the prompt has no probe; an all-zero digest is never a key
#: Keys whose chain (anchor) this process remembers, to register the chunks that continue them; more are read
#: from the shards' directories.
_ANCHOR_MEMORY = 1 << 16
#: Shortest time between two rebuilds of a Cluster's map, however many calls fail meanwhile.
_REFRESH_INTERVAL_S = 0.5
#: Replies of a Cluster node that mean this process's map of slots is out of date (a failover, a resharding).
_TOPOLOGY_ERRORS = (
    redis.exceptions.AskError,  # MovedError too
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,  # MasterDownError too
    redis.exceptions.ReadOnlyError,  # a master that became a replica
)
#: What a script's error says when its shard no longer serves its keys, or the cluster lost a master meanwhile.
_SCRIPT_TOPOLOGY_ERRORS = ("non local key", "cluster is down")


def _refuses_writes(error: redis.exceptions.ResponseError) -> bool:
    """Whether Redis turned a write down for a state of its own (out of memory, a failed snapshot, a replica),
    which passes like a lost connection: the index is unavailable, its data intact."""
    return isinstance(error, redis.exceptions.OutOfMemoryError | redis.exceptions.ReadOnlyError) or str(
        error
    ).startswith("MISCONF")


def load_script(client: RedisClient, name: str, with_common: bool = True) -> redis.commands.core.Script:
    """The script ``indexer/lua/<name>.lua`` (after ``common.lua``'s shared functions, ``with_common``, which then
    takes the index's ``Keyspace.script_names`` as ARGV[1]); call it with ``client=`` a shard's connection. A
    script's ``#!lua`` flags line stays its first."""
    lua = resources.files("prefixcache.indexer") / "lua"
    source = lua.joinpath(f"{name}.lua").read_text()
    if with_common:
        flags = source.split("\n", 1)[0] + "\n" if source.startswith("#!") else ""
        source = flags + lua.joinpath("common.lua").read_text() + "\n" + source[len(flags) :]
    return client.register_script(source)


def register_args(
    keyspace: Keyspace,
    records: Sequence[ChunkRecord],
    shared: str | None = None,
    anchors: Sequence[str] | None = None,
) -> list[ScriptArg]:
    """The arguments of ``register.lua`` for ``records`` under ``keyspace`` on one Redis, or on a Cluster shard
    whose shared prefix is ``shared``, each record in the chain of its anchor."""
    args: list[ScriptArg] = [keyspace.script_names, shared or keyspace.root]
    for r, anchor in zip(records, anchors or [""] * len(records), strict=True):
        args += [
            r.key.hex(),
            r.parent.hex(),
            r.root.hex(),
            r.namespace.hex(),
            r.tenant,
            r.num_tokens,
            r.size_bytes,
            str(r.location),
            r.probe.hex() if r.probe else "",
            r.packed_tokens,
            anchor,
        ]
    return args


class RedisIndex(PrefixIndex):
    """``PrefixIndex`` on one Redis (standalone, replicated, or found through Sentinel) or a Redis Cluster."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "pc",
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_candidates: int = MAX_BUCKET_CANDIDATES,
    ) -> None:
        self.url = url
        #: the names of this index's keys (tests name raw keys through it too)
        self.keyspace = Keyspace(key_prefix)
        self._names = self.keyspace.script_names  # ARGV[1] of every script of the index (common.lua)
        self._max_candidates = max_candidates
        try:
            self._redis = redis_client(url, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as exc:  # a Cluster connects at once
            raise IndexUnavailableError(f"Redis index at {redact_url(url)} is unreachable: {exc}") from exc
        self._shards = shards_of(self._redis, self.keyspace)
        self._refreshed_at = 0.0
        self._refresh_lock = threading.Lock()
        self._anchors: dict[str, str] = {}  # key hex -> anchor hex, Cluster only (see _ANCHOR_MEMORY)
        self._lookup = load_script(self._redis, "lookup")
        self._page = load_script(self._redis, "page")
        self._entries = load_script(self._redis, "entries")
        self._children = load_script(self._redis, "children")
        self._touch = load_script(self._redis, "touch")
        self._access = AccessLog(self._apply_access)
        self._unreadable = UnreadableRecords()
        self._feed_groups: dict[tuple[str, str, str], str] = {}
        self._register = load_script(self._redis, "register")
        self._locations = load_script(self._redis, "locations")
        self._remove = load_script(self._redis, "remove")
        self._pin = load_script(self._redis, "pin")
        self._tenants = load_script(self._redis, "tenants")

    @property
    def clustered(self) -> bool:
        """Whether the index spreads over a Redis Cluster's masters."""
        return self._shards.clustered

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError, RedisClusterException) as exc:
            self._topology_changed()
            raise IndexUnavailableError(f"Redis index at {redact_url(self.url)} is unreachable: {exc}") from exc
        except redis.exceptions.ResponseError as exc:
            moved = isinstance(exc, _TOPOLOGY_ERRORS) or any(m in str(exc) for m in _SCRIPT_TOPOLOGY_ERRORS)
            if self.clustered and moved:
                self._topology_changed()
                raise IndexUnavailableError(f"Redis index at {redact_url(self.url)} is moving: {exc!r}") from exc
            if not _refuses_writes(exc):
                raise
            raise IndexUnavailableError(f"Redis index at {redact_url(self.url)} refuses writes: {exc}") from exc

    def _topology_changed(self) -> None:
        """Learn a Cluster's masters again, at most every ``_REFRESH_INTERVAL_S`` (the next call uses them)."""
        if not self.clustered or time.monotonic() - self._refreshed_at < _REFRESH_INTERVAL_S:
            return
        with self._refresh_lock:
            self._refreshed_at = time.monotonic()
            # a cluster still electing fails again: the next failed call tries once more
            with suppress(redis.exceptions.RedisError, RedisClusterException):
                self._shards.refresh()

    def ping(self) -> None:
        with self._reachable():
            for shard in self._shards.all():
                shard.client.ping()

    def deployment_problem(self) -> str | None:
        """Why the server this index's URL names cannot hold it (``redis_clients.deployment_problem``), or None."""
        with self._reachable():
            return deployment_problem(self._redis, self.url, self.keyspace)

    def clock_s(self) -> float:
        with self._reachable():
            seconds, microseconds = self._shards.all()[0].client.time()
        return seconds + microseconds / 1e6

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceCheck:
        with self._reachable():
            registered = self.namespaces()
            check = check_namespace(spec, registered)
            if not check.known:
                self._redis.hsetnx(self.keyspace.namespaces, spec.digest.hex(), spec.canonical_json())
        return check

    def namespaces(self) -> list[NamespaceSpec]:
        """The registered namespaces this version can read (others: ``indexer/unreadable_records.py``)."""
        with self._reachable():
            registered = self._redis.hgetall(self.keyspace.namespaces)
        specs = []
        for digest, description in registered.items():
            try:
                specs.append(NamespaceSpec.model_validate_json(description))
            except ValueError as exc:  # pydantic's ValidationError is one
                self._unreadable.skip("namespace", text(digest, errors="replace"), exc)
        return specs

    def lookup(
        self, query: PrefixQuery, *, touch: bool = True, avoid: AbstractSet[str] = frozenset(), here: str = ""
    ) -> PrefixMatch:
        return self.lookup_many([query], touch=touch, avoid=avoid, here=here)[0]

    def lookup_many(
        self,
        queries: Sequence[PrefixQuery],
        *,
        touch: bool = True,
        avoid: AbstractSet[str] = frozenset(),
        here: str = "",
    ) -> list[PrefixMatch]:
        # a miss until a shard answers; a query without a full chunk stays one on a Cluster (only the first chunk's
        # probe bucket can answer)
        replies: list[list[Any]] = [[0, b""] for _ in queries]
        by_shard: dict[str, tuple[Shard, list[int]]] = {}
        for i, query in enumerate(queries):
            if query.keys or not self.clustered:
                anchor = query.keys[0].hex() if self.clustered else ""
                shard = self._shards.of_anchor(anchor)
                by_shard.setdefault(shard.shared, (shard, []))[1].append(i)
        heads_elsewhere = "1" if self.clustered else "0"
        avoided = f",{','.join(sorted(avoid))}," if avoid else ""
        with self._reachable():
            for shard, positions in by_shard.values():
                args: list[ScriptArg] = [self._names, self._max_candidates, heads_elsewhere, avoided, here]
                for i in positions:
                    query = queries[i]
                    anchor = query.keys[0].hex() if self.clustered else ""
                    args += [
                        self._shards.chain_prefix(anchor),
                        b"".join(query.keys).hex(),
                        b"".join(p or _NO_PROBE for p in query.probes).hex(),
                    ]
                for i, reply in zip(positions, self._lookup(args=args, client=shard.client), strict=True):
                    replies[i] = reply
            if self.clustered:
                self._read_first_buckets(queries, replies, avoid)
        matches = [self._match(query, reply, bool(here)) for query, reply in zip(queries, replies, strict=True)]
        if self.clustered:
            for match in matches:
                self._remember_chain(match.keys)
        if touch:
            self.touch(matches)
        return matches

    def _read_first_buckets(self, queries: Sequence[PrefixQuery], replies: list[Any], avoid: AbstractSet[str]) -> None:
        """On a Cluster, the candidates of chains broken in their first chunk, from that chunk's probe bucket on the
        probe's own shard (its candidates are other chains' heads, which live elsewhere: not checked for presence
        here, and a vanished one is a miss when loaded; with nodes to ``avoid``, their entries are read to keep
        those with a copy on another node)."""
        wanted = [i for i, reply in enumerate(replies) if int(reply[0]) == 0 and queries[i].probes[0] is not None]
        if not wanted:
            return
        pipe = self._redis.pipeline(transaction=False)
        for i in wanted:
            first = queries[i].probes[0]
            assert first is not None  # wanted: only queries with a probe
            probe = first.hex()
            pipe.hrandfield(
                Keyspace.bucket(self._shards.chain_prefix(probe), probe), self._max_candidates, withvalues=True
            )
        for i, fields in zip(wanted, pipe.execute(), strict=True):
            replies[i] = [0, b""] + [x for j in range(0, len(fields), 2) for x in (fields[j], fields[j + 1], b"1")]
        if avoid:
            for i in wanted:
                replies[i] = [0, b"", *self._reachable_candidates(replies[i][2:], avoid)]

    def _reachable_candidates(self, candidates: list[Any], avoid: AbstractSet[str]) -> list[Any]:
        """Of the (key hex, tokens, in-DRAM flag) triples ``candidates``, those with a copy on a node not in
        ``avoid``, flagged in DRAM for a DRAM copy on such a node. A bucket copy lies on no node."""
        keys = [bytes.fromhex(candidates[j].decode()) for j in range(0, len(candidates), 3)]
        kept: list[Any] = []
        for j, entry in zip(range(0, len(candidates), 3), self.get(keys), strict=True):
            usable = [loc for loc in entry.locations if loc.tier == "object" or loc.node not in avoid] if entry else []
            if usable:
                in_dram = any(loc.tier == "dram" for loc in usable)
                kept += [candidates[j], candidates[j + 1], b"1" if in_dram else b"0"]
        return kept

    def _remember_chain(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._remember({key.hex(): keys[0].hex() for key in keys})

    def _remember(self, anchors: dict[str, str]) -> None:
        if len(self._anchors) + len(anchors) > _ANCHOR_MEMORY:
            self._anchors.clear()
        self._anchors.update(anchors)

    def touch(self, matches: Sequence[PrefixMatch]) -> None:
        for match in matches:
            self._access.record(b"".join(match.keys).hex())

    def _match(self, query: PrefixQuery, reply: list[Any], placed: bool) -> PrefixMatch:
        """The match of ``query`` from its script reply; ``placed``: the lookup named the asking node, so a DRAM
        copy flagged '1' lies elsewhere ('2': on that node)."""
        hits = int(reply[0])
        without_dram = frozenset(i for i, flag in enumerate(reply[1]) if flag == ord("0"))
        flags = {bytes.fromhex(reply[i].decode()): (reply[i + 1], reply[i + 2]) for i in range(2, len(reply), 3)}
        candidates = [(key, tokens, flag != b"0") for key, (tokens, flag) in flags.items()]
        partial = best_partial(query, hits, candidates) if candidates else None
        remote = frozenset(i for i, flag in enumerate(reply[1]) if flag == ord("1")) if placed else frozenset()
        if placed and partial is not None and flags[partial.key][1] == b"1":
            remote |= {hits}
        return PrefixMatch(
            keys=list(query.keys[:hits]),
            chunk_tokens=query.chunk_tokens,
            partial=partial,
            without_dram=without_dram,
            remote_dram=remote,
        )

    def flush_access(self) -> None:
        """Apply pending last-access/hit updates now (they are otherwise applied in the background)."""
        self._access.flush()

    def _apply_access(self, hits: Hits) -> None:
        """One call per shard that holds the hits: found by the chains lookups remembered, else every shard."""
        pairs: dict[str, list[ScriptArg]] = {}
        shards: dict[str, Shard] = {}
        for hex_key, count in hits.items():
            anchor = self._anchors.get(hex_key) if self.clustered else ""
            targets = self._shards.all() if anchor is None else [self._shards.of_anchor(anchor)]
            for shard in targets:
                shards[shard.shared] = shard
                pairs.setdefault(shard.shared, []).extend((hex_key, count))
        for shared, args in pairs.items():
            self._touch(args=[self._names, shared, *args], client=shards[shared].client)

    def register(self, records: Sequence[ChunkRecord]) -> None:
        if not records:
            return
        with self._reachable():
            anchors = self._anchors_of(records)
            by_shard: dict[str, tuple[Shard, list[int]]] = {}
            for i, anchor in enumerate(anchors):
                shard = self._shards.of_anchor(anchor)
                by_shard.setdefault(shard.shared, (shard, []))[1].append(i)
            elsewhere: list[bytes] = []
            for shard, positions in by_shard.values():
                args = register_args(
                    self.keyspace, [records[i] for i in positions], shard.shared, [anchors[i] for i in positions]
                )
                elsewhere += self._register(args=args, client=shard.client)
            self._edit_first_buckets("add", elsewhere, 3)

    def _anchors_of(self, records: Sequence[ChunkRecord]) -> list[str]:
        """Each record's anchor ('' on one Redis): a chain's first chunk (its parent a root) anchors itself; any
        other chunk takes its parent's anchor, from this call, this process's memory or the shards' directories.
        A parent found nowhere is a media parent (``keys.media_parent``: a digest, never a key) or an evicted
        chunk: the chunk then continues the record before it in this call, as publishers list a prompt's chunks
        in order, or, first in its call, anchors itself (lookups then stop before it: a miss, never wrong KV)."""
        if not self.clustered:
            return [""] * len(records)
        known = dict(self._anchors)
        unknown = {r.parent.hex() for r in records if r.parent != r.root} - known.keys()
        unknown -= {r.key.hex() for r in records}
        if unknown:
            known.update(self._directory(sorted(unknown)))
        anchors: list[str] = []
        for r in records:
            if r.parent == r.root:
                anchor = r.key.hex()
            else:
                anchor = known.get(r.parent.hex()) or (anchors[-1] if anchors else r.key.hex())
            known[r.key.hex()] = anchor
            anchors.append(anchor)
        self._remember({r.key.hex(): a for r, a in zip(records, anchors, strict=True)})
        return anchors

    def _directory(self, hex_keys: Sequence[str]) -> dict[str, str]:
        """The anchors of ``hex_keys`` that some shard's directory holds."""
        found: dict[str, str] = {}
        for shard in self._shards.all():
            for key, anchor in zip(
                hex_keys, shard.client.hmget(Keyspace.directory(shard.shared), list(hex_keys)), strict=True
            ):
                if anchor is not None:
                    found[key] = text(anchor)
        return found

    def _edit_first_buckets(self, op: str, elsewhere: Sequence[bytes], stride: int) -> None:
        """Make the probe-bucket changes of chain heads that their shard's script returned (Cluster only):
        ``(probe, key, packed)`` triples to add, or ``(probe, key)`` pairs to drop."""
        if not elsewhere:
            return
        pipe = self._redis.pipeline(transaction=False)
        for i in range(0, len(elsewhere), stride):
            probe = elsewhere[i].decode()
            bucket = Keyspace.bucket(self._shards.chain_prefix(probe), probe)
            if op == "add":
                pipe.hset(bucket, elsewhere[i + 1], elsewhere[i + 2])
            else:
                pipe.hdel(bucket, elsewhere[i + 1])
        pipe.execute()

    def get(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]:
        with self._reachable():
            found = self._entry_fields(keys)
        return [self._entry(key.hex(), fields) if fields else None for key, fields in zip(keys, found, strict=True)]

    def _entry_fields(self, keys: Sequence[bytes]) -> list[dict[bytes, bytes] | None]:
        """Each key's entry hash (None: no entry), from ``entries.lua`` on every shard: each answers for the
        entries it holds."""
        found: list[dict[bytes, bytes] | None] = [None] * len(keys)
        hex_keys = [k.hex() for k in keys]
        for shard in self._shards.all():
            reply = self._entries(args=[self._names, shard.shared, *hex_keys], client=shard.client)
            for i, flat in enumerate(reply):
                if flat and found[i] is None:
                    found[i] = dict(zip(flat[::2], flat[1::2], strict=True))
        return found

    def add_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        if not keys:
            return []
        replies = self._on_every_shard(self._locations, ["add", str(location), *(k.hex() for k in keys)])
        missing = set.intersection(*({bytes.fromhex(k.decode()) for k in reply[0]} for reply in replies))
        return [key for key in keys if key in missing]

    def drop_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        if not keys:
            return []
        replies = self._on_every_shard(self._locations, ["drop", str(location), *(k.hex() for k in keys)])
        gone = {bytes.fromhex(k.decode()) for reply in replies for k in reply[0]}
        return [key for key in keys if key in gone]

    def remove(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return sum(int(reply[0]) for reply in self._on_every_shard(self._remove, [k.hex() for k in keys]))

    def _on_every_shard(self, script: redis.commands.core.Script, args: list[ScriptArg]) -> list[list[Any]]:
        """``script`` run on each shard, which acts on the entries it holds; the probe-bucket drops of chain heads
        that the replies (``{result, elsewhere}``) carry are made before returning."""
        with self._reachable():
            replies = [script(args=[self._names, s.shared, *args], client=s.client) for s in self._shards.all()]
            self._edit_first_buckets("drop", [x for reply in replies for x in reply[1]], 2)
        return replies

    def set_pin(self, keys: Sequence[bytes], until_s: float) -> int:
        if not keys:
            return 0
        until = "inf" if until_s == math.inf else str(int(until_s * 1000))
        with self._reachable():
            return sum(
                int(self._pin(args=[self._names, s.shared, until, *(k.hex() for k in keys)], client=s.client))
                for s in self._shards.all()
            )

    def children(self, key: bytes) -> list[bytes]:
        with self._reachable():
            replies = [
                self._children(args=[self._names, s.shared, key.hex()], client=s.client) for s in self._shards.all()
            ]
        members = {m for reply in replies for m in reply}
        return sorted(bytes.fromhex(m.decode()) for m in members)

    def stored_chunks(self, keys: Sequence[bytes]) -> dict[bytes, tuple[bytes | None, bytes]]:
        """Parent (None for a prompt's first chunk) and packed tokens of each of ``keys`` still in the index.

        The index keeps a chunk's tokens only in its probe bucket (``b:<probe>``, see ``indexer/lua/common.lua``),
        so chunks shorter than the probe (tails of under 16 tokens) have none and are left out."""
        described: dict[bytes, tuple[bytes | None, str]] = {}
        with self._reachable():
            for key, fields in zip(keys, self._entry_fields(keys), strict=True):
                if not fields or b"parent" not in fields or not fields.get(b"probe"):
                    continue
                parent, probe = fields[b"parent"], fields[b"probe"]
                anchor = fields.get(b"anchor", b"").decode()
                tag = probe.decode() if self.clustered and anchor == key.hex() else anchor
                bucket = Keyspace.bucket(self._shards.chain_prefix(tag), probe.decode())
                first = parent == fields.get(b"root")
                described[key] = (None if first else bytes.fromhex(parent.decode()), bucket)
            pipe = self._redis.pipeline(transaction=False)
            for key, (_, bucket) in described.items():
                pipe.hget(bucket, key.hex())
            packed = pipe.execute()
        return {
            key: (parent, tokens)
            for (key, (parent, _)), tokens in zip(described.items(), packed, strict=True)
            if tokens
        }

    def read_feed(
        self, node: str, group: str, consumer: str, count: int = 256, block_s: float = 0.0
    ) -> list[FeedEvent]:
        with self._reachable():
            shards = self._shards.seen()
            for shard in shards:
                if events := self._read_stream(shard, node, group, consumer, count, 0.0):
                    return events
            if block_s > 0:  # nothing anywhere: wait on each shard in turn
                for shard in shards:
                    if events := self._read_stream(shard, node, group, consumer, count, block_s / len(shards)):
                        return events
        return []

    def _read_stream(
        self, shard: Shard, node: str, group: str, consumer: str, count: int, block_s: float
    ) -> list[FeedEvent]:
        stream = Keyspace.feed(shard.shared, node)
        cursor = (stream, group, consumer)
        if cursor not in self._feed_groups:
            try:  # from the stream's start: changes made before the first consumer existed count too
                shard.client.xgroup_create(stream, group, id="0", mkstream=True)
            except redis.exceptions.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
            self._feed_groups[cursor] = "0"  # first: this consumer's unacknowledged events
        start = self._feed_groups[cursor]
        block = int(block_s * 1000) if start == ">" and block_s > 0 else None
        messages = stream_messages(shard.client.xreadgroup(group, consumer, {stream: start}, count=count, block=block))
        if start != ">":  # replaying this consumer's pending events: continue after the last one, then go live
            if not messages:
                self._feed_groups[cursor] = ">"
                return self._read_stream(shard, node, group, consumer, count, block_s)
            self._feed_groups[cursor] = messages[-1][0].decode()
            if trimmed := [msg_id for msg_id, fields in messages if not fields]:
                # read before, trimmed from the capped stream since (Redis answers their ids alone), a million
                # events later: what they asked for (a copy to persist, an event to send) is not done, and their
                # chunks stay where they are, a miss later at worst
                shard.client.xack(stream, group, *trimmed)
                log.warning(
                    "%d feed events of node %s were trimmed before they were handled: skipped", len(trimmed), node
                )
                messages = [(msg_id, fields) for msg_id, fields in messages if fields]
                if not messages:
                    return self._read_stream(shard, node, group, consumer, count, block_s)
        tag = f"{shard.name}/" if shard.name else ""
        return [_event(node, tag + msg_id.decode(), fields) for msg_id, fields in messages]

    def ack_feed(self, node: str, group: str, ids: Sequence[str]) -> None:
        if not ids:
            return
        by_tag: dict[str, list[str]] = {}
        for event_id in ids:
            tag, _, msg_id = event_id.rpartition("/")
            by_tag.setdefault(tag, []).append(msg_id)
        with self._reachable():
            for shard in self._shards.seen():
                if msg_ids := by_tag.get(shard.name):
                    shard.client.xack(Keyspace.feed(shard.shared, node), group, *msg_ids)

    def rewind_feed(self, node: str, group: str, consumer: str) -> None:
        for shard in self._shards.seen():
            cursor = (Keyspace.feed(shard.shared, node), group, consumer)
            if cursor in self._feed_groups:
                self._feed_groups[cursor] = "0"

    def scan(self, batch: int = 512) -> Iterator[ChunkEntry]:
        pattern = self.keyspace.entry_pattern(self.clustered)
        with self._reachable():
            for shard in self._shards.all():
                cursor = 0
                while True:
                    cursor, names = shard.client.scan(cursor=cursor, match=pattern, count=batch)
                    pipe = shard.client.pipeline(transaction=False)
                    for name in names:
                        pipe.hgetall(name)
                    for name, fields in zip(names, pipe.execute(), strict=True):
                        key_hex = Keyspace.entry_key_hex(raw(name))
                        if fields and (entry := self._entry(key_hex, fields)) is not None:
                            yield entry
                    if cursor == 0:
                        break

    def page(self, after: bytes | None, count: int) -> list[ChunkEntry]:
        found: list[tuple[bytes, dict[bytes, bytes]]] = []
        with self._reachable():
            for shard in self._shards.all():
                reply = self._page(
                    args=[self._names, shard.shared, after.hex() if after else "", count], client=shard.client
                )
                for i in range(0, len(reply), 2):
                    found.append((reply[i], dict(zip(reply[i + 1][::2], reply[i + 1][1::2], strict=True))))
        entries = []
        for name, fields in sorted(found)[:count]:  # each shard's first ``count``: the first ``count`` of all
            # empty: removed between the range and its read, inside the script: never, but cheap to skip
            if fields and (entry := self._entry(name, fields)) is not None:
                entries.append(entry)
        return entries

    def usage(self) -> dict[bytes, NamespaceUsage]:
        counts: dict[bytes, dict[str, int]] = {}
        for name, value in self._summed_counters(Keyspace.usage).items():
            namespace, _, field = name.partition(":")
            try:
                counts.setdefault(bytes.fromhex(namespace), {})[field] = value
            except ValueError as exc:
                self._unreadable.skip("usage counter", name, exc)
        return {ns: usage_of(fields) for ns, fields in counts.items() if fields.get("chunks", 0) > 0}

    def tenant_usage(self) -> dict[str, Usage]:
        counts: dict[str, dict[str, int]] = {}
        for name, value in self._summed_counters(Keyspace.tenant_usage).items():
            tenant, _, field = name.rpartition(":")
            counts.setdefault(tenant, {})[field] = value
        return {
            tenant: Usage(fields.get("chunks", 0), fields.get("bytes", 0))
            for tenant, fields in counts.items()
            if fields.get("chunks", 0) > 0
        }

    def count_tenant_usage(self, page: int = 256) -> int:
        """``tenants.lua`` over each shard's key listing, ``page`` entries a call: each call holds its shard for
        about a millisecond, so lookups beside a daemon's start wait no longer than that."""
        counted = 0
        with self._reachable():
            for shard in self._shards.all():
                after = ""
                while True:
                    after, added = self._tenants(args=[self._names, shard.shared, after, page], client=shard.client)
                    counted += int(added)
                    after = after.decode() if isinstance(after, bytes) else after
                    if not after:
                        break
        return counted

    def _summed_counters(self, name: Callable[[str], str]) -> Counter[str]:
        """The counters of the shared hash ``name`` names on each shard (``Keyspace.usage``, ``tenant_usage``),
        summed over the shards."""
        summed: Counter[str] = Counter()
        with self._reachable():
            for shard in self._shards.all():
                for field, value in shard.client.hgetall(name(shard.shared)).items():
                    try:
                        summed[text(field, errors="replace")] += int(value)
                    except ValueError as exc:  # another version's counter
                        self._unreadable.skip("usage counter", text(field, errors="replace"), exc)
        return summed

    def feed_backlog(self, node: str, group: str) -> int:
        with self._reachable():
            return sum(self._stream_backlog(shard, node, group) for shard in self._shards.seen())

    def _stream_backlog(self, shard: Shard, node: str, group: str) -> int:
        stream = Keyspace.feed(shard.shared, node)
        try:
            groups = shard.client.xinfo_groups(stream)
        except redis.exceptions.ResponseError:  # no feed yet
            return 0
        for info in groups:
            if info["name"].decode() == group:  # lag is unknown (None) right after a trim: count pending only
                return int(info.get("pending") or 0) + int(info.get("lag") or 0)
        return int(shard.client.xlen(stream))  # the group reads from the start once created

    def flush(self) -> None:
        """Delete every key under this index's prefix (tests and `evict all`)."""
        with self._reachable():
            for shard in self._shards.all():
                for name in shard.client.scan_iter(match=self.keyspace.everything, count=1000):
                    shard.client.unlink(name)
        self._anchors.clear()

    def _entry(self, hex_key: bytes | str, fields: dict[bytes, bytes]) -> ChunkEntry | None:
        """The entry named ``hex_key`` from its hash; None if this version cannot read it."""
        name = hex_key.decode(errors="replace") if isinstance(hex_key, bytes) else hex_key
        try:
            return _entry(bytes.fromhex(name), fields)
        except (KeyError, ValueError) as exc:
            self._unreadable.skip("entry", name, exc)
            return None

    def close(self) -> None:
        try:
            self._access.close()
        finally:
            self._redis.close()


def _event(node: str, event_id: str, fields: dict[bytes, bytes]) -> FeedEvent:
    return FeedEvent(
        id=event_id,
        op=cast(Literal["add", "drop"], fields[b"op"].decode()),  # written by common.lua: add or drop
        location=Location(cast(Tier, fields[b"tier"].decode()), node),  # checked by Location
        key=bytes.fromhex(fields[b"key"].decode()),
    )


def _entry(key: bytes, fields: dict[bytes, bytes]) -> ChunkEntry:
    text = {k.decode(): v for k, v in fields.items()}
    pin = text.get("pin", b"0").decode()
    return ChunkEntry(
        key=key,
        parent=bytes.fromhex(text["parent"].decode()),
        root=bytes.fromhex(text["root"].decode()),
        namespace=bytes.fromhex(text["ns"].decode()),
        tenant=text["tenant"].decode(),
        num_tokens=int(text["ntok"]),
        size_bytes=int(text["size"]),
        locations=frozenset(Location.parse(name[2:]) for name in text if name.startswith("l:")),
        created_s=int(text["ctime"]) / 1000,
        last_access_s=int(text["atime"]) / 1000,
        hits=int(text["hits"]),
        pinned_until_s=math.inf if pin == "inf" else int(pin) / 1000,
    )
