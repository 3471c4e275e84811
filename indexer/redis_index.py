"""The production index: entries in Redis, every multi-key operation one Lua script (one round trip).

Layout and scripts live in ``indexer/lua``; ``common.lua`` documents the keys. Scripts are sent by
SHA (redis-py's ``Script`` reloads them after a Redis restart). All calls use short socket timeouts:
an unreachable Redis surfaces as ``IndexUnavailableError`` quickly, which callers treat as a miss.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import resources

import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from prefixcache.indexer.access_log import AccessLog, Hits
from prefixcache.indexer.errors import ConfigError, IndexUnavailableError
from prefixcache.indexer.index import (
    MAX_BUCKET_CANDIDATES,
    ChunkEntry,
    ChunkRecord,
    FeedEvent,
    Location,
    NamespaceCheck,
    NamespaceUsage,
    PrefixMatch,
    best_partial,
    check_namespace,
    usage_of,
)
from prefixcache.indexer.keys import KEY_BYTES, PrefixQuery
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_clients import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, redact_url, redis_client
from prefixcache.indexer.unreadable_records import UnreadableRecords

_NO_PROBE = bytes(KEY_BYTES)  # sent where the prompt has no probe; an all-zero digest is never a key


def _refuses_writes(error: redis.exceptions.ResponseError) -> bool:
    """Whether Redis turned a write down for a state of its own (out of memory, a failed snapshot, a replica),
    which passes like a lost connection: the index is unavailable, its data intact."""
    return isinstance(error, redis.exceptions.OutOfMemoryError | redis.exceptions.ReadOnlyError) or str(
        error
    ).startswith("MISCONF")


def load_script(client: redis.Redis, name: str, with_common: bool = True) -> redis.commands.core.Script:
    """The script ``indexer/lua/<name>.lua`` (after ``common.lua``'s shared functions, ``with_common``)."""
    lua = resources.files("prefixcache.indexer") / "lua"
    source = lua.joinpath(f"{name}.lua").read_text()
    if with_common:
        source = lua.joinpath("common.lua").read_text() + "\n" + source
    return client.register_script(source)


def register_args(prefix: str, records: Sequence[ChunkRecord]) -> list[object]:
    """The arguments of ``register.lua`` for ``records`` under ``prefix`` (e.g. ``"pc:"``)."""
    args: list[object] = [prefix]
    for r in records:
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
        ]
    return args


class RedisIndex:
    """``PrefixIndex`` on one Redis server (standalone or replicated; Redis Cluster is not supported,
    because a lookup reads the keys of one chain, which Cluster would spread over shards)."""

    def __init__(
        self,
        url: str,
        *,
        key_prefix: str = "pc",
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_candidates: int = MAX_BUCKET_CANDIDATES,
    ) -> None:
        if not key_prefix or any(c in key_prefix for c in " {}"):
            raise ConfigError(f"key_prefix must be non-empty without spaces or braces, got {key_prefix!r}")
        self.url = url
        self._prefix = key_prefix + ":"
        self._max_candidates = max_candidates
        self._redis = redis_client(url, socket_timeout_s=socket_timeout_s, connect_timeout_s=connect_timeout_s)
        self._lookup = load_script(self._redis, "lookup", with_common=False)  # its first line is a shebang
        self._page = load_script(self._redis, "page", with_common=False)
        self._touch = load_script(self._redis, "touch", with_common=False)
        self._access = AccessLog(self._apply_access)
        self._unreadable = UnreadableRecords()
        self._feed_groups: dict[tuple[str, str, str], str] = {}
        self._register = load_script(self._redis, "register")
        self._locations = load_script(self._redis, "locations")
        self._remove = load_script(self._redis, "remove")
        self._pin = load_script(self._redis, "pin")

    @contextmanager
    def _reachable(self) -> Iterator[None]:
        try:
            yield
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise IndexUnavailableError(f"Redis index at {redact_url(self.url)} is unreachable: {exc}") from exc
        except redis.exceptions.ResponseError as exc:
            if not _refuses_writes(exc):
                raise
            raise IndexUnavailableError(f"Redis index at {redact_url(self.url)} refuses writes: {exc}") from exc

    def ping(self) -> None:
        with self._reachable():
            self._redis.ping()

    def clock_s(self) -> float:
        with self._reachable():
            seconds, microseconds = self._redis.time()
        return seconds + microseconds / 1e6

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceCheck:
        with self._reachable():
            registered = self.namespaces()
            check = check_namespace(spec, registered)
            if not check.known:
                self._redis.hsetnx(self._prefix + "ns", spec.digest.hex(), spec.canonical_json())
        return check

    def namespaces(self) -> list[NamespaceSpec]:
        """The registered namespaces this version can read (others: ``indexer/unreadable_records.py``)."""
        with self._reachable():
            raw = self._redis.hgetall(self._prefix + "ns")
        specs = []
        for digest, text in raw.items():
            try:
                specs.append(NamespaceSpec.model_validate_json(text))
            except ValueError as exc:  # pydantic's ValidationError is one
                self._unreadable.skip("namespace", digest.decode(errors="replace"), exc)
        return specs

    def lookup(self, query: PrefixQuery, *, touch: bool = True) -> PrefixMatch:
        return self.lookup_many([query], touch=touch)[0]

    def lookup_many(self, queries: Sequence[PrefixQuery], *, touch: bool = True) -> list[PrefixMatch]:
        args: list[object] = [self._prefix, self._max_candidates]
        for query in queries:
            args += [b"".join(query.keys).hex(), b"".join(p or _NO_PROBE for p in query.probes).hex()]
        with self._reachable():
            replies = self._lookup(args=args)
        matches = [self._match(query, reply) for query, reply in zip(queries, replies, strict=True)]
        if touch:
            self.touch(matches)
        return matches

    def touch(self, matches: Sequence[PrefixMatch]) -> None:
        for match in matches:
            self._access.record(b"".join(match.keys).hex())

    def _match(self, query: PrefixQuery, reply: list) -> PrefixMatch:
        hits = int(reply[0])
        without_dram = frozenset(i for i, flag in enumerate(reply[1]) if flag == ord("0"))
        candidates = [
            (bytes.fromhex(reply[i].decode()), reply[i + 1], reply[i + 2] != b"0") for i in range(2, len(reply), 3)
        ]
        partial = best_partial(query, hits, candidates) if candidates else None
        return PrefixMatch(
            keys=list(query.keys[:hits]), chunk_tokens=query.chunk_tokens, partial=partial, without_dram=without_dram
        )

    def flush_access(self) -> None:
        """Apply pending last-access/hit updates now (they are otherwise applied in the background)."""
        self._access.flush()

    def _apply_access(self, hits: Hits) -> None:
        args: list[object] = [self._prefix]
        for hex_key, count in hits.items():
            args += [hex_key, count]
        self._touch(args=args)

    def register(self, records: Sequence[ChunkRecord]) -> None:
        if not records:
            return
        with self._reachable():
            self._register(args=register_args(self._prefix, records))

    def get(self, keys: Sequence[bytes]) -> list[ChunkEntry | None]:
        with self._reachable():
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.hgetall(self._prefix + "e:" + key.hex())
            raw = pipe.execute()
        return [self._entry(key.hex(), fields) if fields else None for key, fields in zip(keys, raw, strict=True)]

    def add_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        return self._change_locations("add", keys, location)

    def drop_location(self, keys: Sequence[bytes], location: Location) -> list[bytes]:
        return self._change_locations("drop", keys, location)

    def _change_locations(self, op: str, keys: Sequence[bytes], location: Location) -> list[bytes]:
        if not keys:
            return []
        with self._reachable():
            reply = self._locations(args=[self._prefix, op, str(location), *(k.hex() for k in keys)])
        return [bytes.fromhex(k.decode()) for k in reply]

    def remove(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        with self._reachable():
            return int(self._remove(args=[self._prefix, *(k.hex() for k in keys)]))

    def set_pin(self, keys: Sequence[bytes], until_s: float) -> int:
        if not keys:
            return 0
        until = "inf" if until_s == math.inf else str(int(until_s * 1000))
        with self._reachable():
            return int(self._pin(args=[self._prefix, until, *(k.hex() for k in keys)]))

    def children(self, key: bytes) -> list[bytes]:
        with self._reachable():
            members = self._redis.smembers(self._prefix + "k:" + key.hex())
        return sorted(bytes.fromhex(m.decode()) for m in members)

    def read_feed(
        self, node: str, group: str, consumer: str, count: int = 256, block_s: float = 0.0
    ) -> list[FeedEvent]:
        stream = self._prefix + "f:" + node
        cursor = (stream, group, consumer)
        with self._reachable():
            if cursor not in self._feed_groups:
                try:  # from the stream's start: changes made before the first consumer existed count too
                    self._redis.xgroup_create(stream, group, id="0", mkstream=True)
                except redis.exceptions.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise
                self._feed_groups[cursor] = "0"  # first: this consumer's unacknowledged events
            start = self._feed_groups[cursor]
            block = int(block_s * 1000) if start == ">" and block_s > 0 else None
            reply = self._redis.xreadgroup(group, consumer, {stream: start}, count=count, block=block)
        messages = reply[0][1] if reply else []
        if start != ">":  # replaying this consumer's pending events: continue after the last one, then go live
            if not messages:
                self._feed_groups[cursor] = ">"
                return self.read_feed(node, group, consumer, count, block_s)
            self._feed_groups[cursor] = messages[-1][0].decode()
        return [_event(node, msg_id, fields) for msg_id, fields in messages]

    def ack_feed(self, node: str, group: str, ids: Sequence[str]) -> None:
        if ids:
            with self._reachable():
                self._redis.xack(self._prefix + "f:" + node, group, *ids)

    def rewind_feed(self, node: str, group: str, consumer: str) -> None:
        cursor = (self._prefix + "f:" + node, group, consumer)
        if cursor in self._feed_groups:
            self._feed_groups[cursor] = "0"

    def scan(self, batch: int = 512) -> Iterator[ChunkEntry]:
        pattern = self._prefix + "e:*"
        skip = len(self._prefix) + 2
        with self._reachable():
            cursor = 0
            while True:
                cursor, names = self._redis.scan(cursor=cursor, match=pattern, count=batch)
                pipe = self._redis.pipeline(transaction=False)
                for name in names:
                    pipe.hgetall(name)
                for name, fields in zip(names, pipe.execute(), strict=True):
                    if fields and (entry := self._entry(name[skip:], fields)) is not None:
                        yield entry
                if cursor == 0:
                    return

    def page(self, after: bytes | None, count: int) -> list[ChunkEntry]:
        with self._reachable():
            reply = self._page(args=[self._prefix, after.hex() if after else "", count])
        entries = []
        for i in range(0, len(reply), 2):
            fields = dict(zip(reply[i + 1][::2], reply[i + 1][1::2], strict=True))
            # empty: removed between the range and its read, inside the script: never, but cheap to skip
            if fields and (entry := self._entry(reply[i], fields)) is not None:
                entries.append(entry)
        return entries

    def usage(self) -> dict[bytes, NamespaceUsage]:
        with self._reachable():
            raw = self._redis.hgetall(self._prefix + "u")
        counts: dict[bytes, dict[str, int]] = {}
        for name, value in raw.items():
            namespace, _, field = name.decode(errors="replace").partition(":")
            try:
                counts.setdefault(bytes.fromhex(namespace), {})[field] = int(value)
            except ValueError as exc:
                self._unreadable.skip("usage counter", name.decode(errors="replace"), exc)
        return {ns: usage_of(fields) for ns, fields in counts.items() if fields.get("chunks", 0) > 0}

    def feed_backlog(self, node: str, group: str) -> int:
        stream = self._prefix + "f:" + node
        with self._reachable():
            try:
                groups = self._redis.xinfo_groups(stream)
            except redis.exceptions.ResponseError:  # no feed yet
                return 0
            for info in groups:
                if info["name"].decode() == group:  # lag is unknown (None) right after a trim: count pending only
                    return int(info.get("pending") or 0) + int(info.get("lag") or 0)
            return int(self._redis.xlen(stream))  # the group reads from the start once created

    def flush(self) -> None:
        """Delete every key under this index's prefix (tests and `evict all`)."""
        with self._reachable():
            for name in self._redis.scan_iter(match=self._prefix + "*", count=1000):
                self._redis.unlink(name)

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


def _event(node: str, msg_id: bytes, fields: dict[bytes, bytes]) -> FeedEvent:
    return FeedEvent(
        id=msg_id.decode(),
        op=fields[b"op"].decode(),  # type: ignore[arg-type]
        location=Location(fields[b"tier"].decode(), node),  # type: ignore[arg-type]
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
