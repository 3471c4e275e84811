"""Which nodes of the cluster answer, so that every client skips those that do not.

A node lost (its host crashed, frozen or cut off, or its link so slow that reads from it time out) leaves its
chunks in the index, with copies in its DRAM segment and on its NVMe that no other node can read. A client that
tried them would wait for Mooncake's transfer timeouts (30 s and more) or for a promotion its daemon never answers
(``promote_timeout_s``). So the index's Redis keeps which nodes answer, in one hash (``<prefix>:peers``,
``lua/peers.lua``), by the Redis clock:

- every daemon beats: its heartbeat says until when it is alive (``HEARTBEAT_TTL_S`` after each beat, made every
  ``HEARTBEAT_INTERVAL_S``), and a daemon that stops says so at once;
- a client whose read from a node failed or went unanswered marks that node suspect for everyone, for
  ``SUSPECT_S``: this catches a node whose daemon still beats but whose data path does not deliver. Marks in a row
  double, up to ``SUSPECT_LONGEST_S``, so that a link that stays slow is tried (and its read abandoned) ever more
  rarely; the row is forgotten once a mark has lapsed for ``SUSPECT_FORGIVE_S``, and when the node beats again
  after its heartbeat lapsed for ``BACK_AFTER_S`` or more (back from a loss: read from it at once). A heartbeat
  that lapses for less, as behind a saturated link, keeps the row.

A node is down while its heartbeat has lapsed or a suspect mark on it holds. A node never heard of (no heartbeat:
a daemon of an earlier version) is never down. Lookups avoid down nodes (``PrefixIndex.lookup``'s ``avoid``), so a
prompt whose chunks lie only there is computed at once; promotions are not asked of them. A node that comes back
beats again and is read from as soon as the views have read its heartbeat.

Clients read the hash through a ``PeerView``, a thread that reads it every ``VIEW_REFRESH_S`` (one small script
call), so the hot path reads a frozenset. A view that has not read the hash for ``VIEW_STALE_S`` avoids no one:
with the index unreachable, every lookup misses anyway.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis

from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_index import load_script

log = logging.getLogger("prefixcache.peers")

#: How often a daemon beats, and how long after a beat it still counts as alive: a node lost is known to every
#: client within the time to live plus a view's refresh (about 1.25 s), and a daemon held up by a loaded host
#: for less than the time to live is not taken for lost.
HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TTL_S = 1.0
#: How long a client's mark of a node it could not read from holds: long enough that a node whose link is
#: congested is not tried by every request, short enough that one that recovered is read again soon.
SUSPECT_S = 5.0
#: The longest a mark in a row grows to, and how long after a mark lapses without another the row starts again.
SUSPECT_LONGEST_S = 80.0
SUSPECT_FORGIVE_S = 60.0
#: A node whose heartbeat lapsed at least this long and resumed is back from a loss: its marks are dropped.
BACK_AFTER_S = 5.0
#: How often a view reads the table, and how long a view that cannot read it keeps what it read last.
VIEW_REFRESH_S = 0.25
VIEW_STALE_S = 5.0


@dataclass(frozen=True)
class PeerTable:
    """The table as read at ``now_ms`` (the Redis clock): heartbeat and suspect-mark expiries per node, in ms."""

    now_ms: int
    beats: Mapping[str, int] = field(default_factory=dict)
    suspects: Mapping[str, int] = field(default_factory=dict)
    left: frozenset[str] = frozenset()  # nodes whose daemon stopped on purpose, and has not beaten since
    marks: Mapping[str, int] = field(default_factory=dict)  # how often clients marked each node suspect

    @classmethod
    def of_reply(cls, reply: list[Any]) -> PeerTable:
        """The table from ``peers.lua``'s ``read`` reply: ``{now_ms, {field, value, ...}}``."""
        now_ms, fields = int(reply[0]), reply[1]
        tables: dict[str, dict[str, int]] = {"beat": {}, "suspect": {}, "left": {}, "marks": {}}
        for i in range(0, len(fields), 2):
            kind, _, node = _text(fields[i]).partition(":")
            tables.get(kind, {})[node] = int(fields[i + 1])
        return cls(now_ms, tables["beat"], tables["suspect"], frozenset(tables["left"]), tables["marks"])

    @property
    def lapsed(self) -> frozenset[str]:
        """Nodes whose heartbeat has lapsed: crashed, frozen, cut off from the index, or stopped."""
        return frozenset(node for node, until in self.beats.items() if until <= self.now_ms)

    @property
    def suspect(self) -> frozenset[str]:
        """Nodes a client marked suspect, the mark still holding."""
        return frozenset(node for node, until in self.suspects.items() if until > self.now_ms)

    @property
    def down(self) -> frozenset[str]:
        return self.lapsed | self.suspect

    def others(self, node: str) -> list[str]:
        """Every node the table has heard of but ``node``, in order."""
        return sorted(set(self.beats) - {node})

    @property
    def alive(self) -> frozenset[str]:
        """Nodes whose heartbeat holds and that no one marked suspect."""
        return frozenset(self.beats) - self.down


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class PeerRegistry:
    """The table's calls (``lua/peers.lua``), on one Redis, behind Sentinel, or on a Cluster (one key, so one
    shard). Every call raises ``IndexUnavailableError`` when Redis does not answer."""

    def __init__(self, client: RedisClient, keyspace: Keyspace) -> None:
        self._client = client
        self._key = keyspace.peers
        self._script = load_script(client, "peers", with_common=False)

    def _call(self, op: str, node: str = "", *ms: int) -> list[Any]:
        try:
            reply: list[Any] = self._script(keys=[self._key], args=[op, node, *(ms or (0,))])
        except (redis.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise IndexUnavailableError(f"the table of peers is unreachable: {exc}") from exc
        return reply

    def beat(self, node: str, ttl_s: float = HEARTBEAT_TTL_S, back_after_s: float = BACK_AFTER_S) -> None:
        """``node`` is alive for ``ttl_s`` more; back from a loss (its marks dropped) if its heartbeat had lapsed for
        ``back_after_s`` or more."""
        self._call("beat", node, round(ttl_s * 1000), round(back_after_s * 1000))

    def leave(self, node: str) -> None:
        """``node`` stops now: every client takes it for down from its next read."""
        self._call("leave", node)

    def suspect(
        self,
        node: str,
        for_s: float = SUSPECT_S,
        longest_s: float = SUSPECT_LONGEST_S,
        forgive_s: float = SUSPECT_FORGIVE_S,
    ) -> None:
        """Mark ``node`` suspect for everyone, unless a mark holds: for ``for_s`` doubled per mark in a row, at most
        ``longest_s``; a row ends when its last mark has lapsed for ``forgive_s``."""
        self._call("suspect", node, round(for_s * 1000), round(longest_s * 1000), round(forgive_s * 1000))

    def read(self) -> PeerTable:
        return PeerTable.of_reply(self._call("read"))


class PeerView:
    """One process's view of which other nodes are down, read by a thread of its own every ``refresh_s``.

    ``down`` never names ``node`` (the viewer's own): its own daemon's troubles show in its own tiers' misses.
    """

    def __init__(
        self,
        registry: PeerRegistry,
        node: str,
        *,
        refresh_s: float = VIEW_REFRESH_S,
        stale_s: float = VIEW_STALE_S,
        thread_setup: Callable[[], None] | None = None,
    ) -> None:
        self._registry = registry
        self._node = node
        self._refresh_s = refresh_s
        self._stale_s = stale_s
        self._thread_setup = thread_setup
        self._down: frozenset[str] = frozenset()
        self._others: frozenset[str] = frozenset()
        self._marked: dict[str, float] = {}  # node -> monotonic time until which this process avoids it
        self._read_at = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def down(self) -> frozenset[str]:
        """The other nodes to read nothing from now: the table's down nodes, and those this process marked."""
        now = time.monotonic()
        down = self._down if now - self._read_at < self._stale_s else frozenset()
        if self._marked:
            with self._lock:
                self._marked = {node: until for node, until in self._marked.items() if until > now}
                down = down | self._marked.keys()
        return down

    @property
    def alone(self) -> bool:
        """Whether no other node has beaten into the table: every copy a lookup finds is this node's own."""
        return not self._others

    def suspect(self, node: str, for_s: float = SUSPECT_S) -> None:
        """This process could not read from ``node``: avoid it at once here, and have every client avoid it."""
        if node == self._node:
            return
        with self._lock:
            self._marked[node] = time.monotonic() + for_s
        try:
            self._registry.suspect(node, for_s)
        except IndexUnavailableError as exc:
            log.debug("could not mark node %s suspect for the cluster: %s", node, exc)

    def refresh(self) -> None:
        """Read the table now (the thread does it every ``refresh_s``)."""
        table = self._registry.read()
        self._down = table.down - {self._node}
        self._others = frozenset(table.others(self._node))
        self._read_at = time.monotonic()

    def start(self) -> PeerView:
        """Read the table once (so that the first lookups already avoid the nodes known down), then every
        ``refresh_s`` on a thread of its own."""
        try:
            self.refresh()
        except IndexUnavailableError as exc:
            log.debug("reading the table of peers failed: %s", exc)
        self._thread = threading.Thread(target=self._run, name="prefixcache-peers", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while not self._stop.wait(self._refresh_s):
            try:
                self.refresh()
            except IndexUnavailableError as exc:
                log.debug("reading the table of peers failed: %s", exc)
