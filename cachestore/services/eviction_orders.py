"""Eviction orders: how one node's evict reaches the copies only other nodes' daemons can delete.

A node removes DRAM copies pool-wide and its own NVMe copies itself, but another node's pack files
are that node's alone. So the evicting daemon queues an order on ``P:dq:<node>`` for each node whose
NVMe still holds some of the chunks (``<reply id>:<keys as hex>``, the form of every daemon request),
and waits a moment for the answer on ``P:dr:<reply id>``. The holder deletes its copies, DRAM ones
included (a reader may have had it promote a chunk since), and drops its locations, which removes
entries left with none; it answers how many it removed. It leaves pinned chunks alone: a forced
eviction unpins its chunks before it queues their orders, so a pin there was set after the order.

The queue is a Redis list, so an order outlives a node that is down: its daemon takes it once it runs
again, after reconciling its NVMe tier with the index (which still names its copies meanwhile), and
nothing comes back from its disk. A node that does not answer in time is not waited for again for
``SILENT_NODE_S``: an eviction of millions of chunks in batches waits once, not once per batch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence

from prefixcache.cachestore.client.node_requests import format_request
from prefixcache.cachestore.services.answering_server import AnsweringServer
from prefixcache.indexer.index import ChunkEntry, IndexRegistration
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import text

log = logging.getLogger("prefixcache.eviction")
#: How long an evict waits for other nodes to confirm: their work is an index read, file deletes and
#: index updates, milliseconds on a live daemon.
ORDER_WAIT_S = 2.0
#: A node that let an order's wait run out is not waited for again for this long (its orders still queue).
SILENT_NODE_S = 30.0


class EvictionOrders:
    """The evicting side: queue orders for other nodes and collect their answers."""

    def __init__(self, client: RedisClient, keyspace: Keyspace, wait_s: float = ORDER_WAIT_S) -> None:
        self._client = client
        self._keys = keyspace
        self._wait_s = wait_s
        self._silent_until: dict[str, float] = {}

    def send(self, keys_by_node: dict[str, list[bytes]]) -> list[str]:
        """Queue one order per node and wait for the answers; returns the nodes that did not answer in time.

        Their orders stay queued: they take effect when those daemons next run."""
        pending: dict[str, str] = {}  # reply list -> node, until answered
        # one hash tag for the order's replies: a single BLPOP waits on all of them, on a Cluster too
        order = uuid.uuid4().hex[:16]
        pipe = self._client.pipeline(transaction=False)
        for node, keys in keys_by_node.items():
            reply_id = f"{{{order}}}{uuid.uuid4().hex}"
            pending[self._keys.eviction_reply(reply_id)] = node
            pipe.rpush(self._keys.eviction_queue(node), format_request(reply_id, keys))
        pipe.execute()
        now = time.monotonic()
        deadline = now + self._wait_s
        waited = [reply for reply, node in pending.items() if self._silent_until.get(node, 0.0) <= now]
        while waited and (left := deadline - time.monotonic()) > 0:
            # at least 10 ms: Redis reads a timeout under 1 ms as 0, which blocks for good
            answer = self._client.blpop(waited, timeout=max(left, 0.01))
            if answer is None:
                break
            reply = text(answer[0])
            pending.pop(reply, None)
            waited.remove(reply)
        for reply in waited:
            self._silent_until[pending[reply]] = time.monotonic() + SILENT_NODE_S
            log.warning(
                "node %s did not confirm an eviction within %.1fs; its daemon takes the order when it runs",
                pending[reply],
                self._wait_s,
            )
        return sorted(set(pending.values()))


class OrderServer(AnsweringServer):
    """The holder's side: takes this node's orders and evicts what it holds of those chunks."""

    name = "prefixcache-eviction-orders"

    def __init__(
        self,
        client: RedisClient,
        keyspace: Keyspace,
        node: str,
        index: IndexRegistration,
        evict_here: Callable[[Sequence[ChunkEntry]], Iterable[ChunkEntry]],
    ) -> None:
        """``evict_here`` removes the given entries' copies this node can reach and returns those removed."""
        super().__init__(client, keyspace.eviction_queue(node), keyspace.eviction_reply)
        self.index = index
        self.evict_here = evict_here

    def answer(self, keys: list[bytes]) -> str:
        # a chunk pinned now was pinned after the order was queued (a forced eviction unpins first): it stays
        now = self.index.clock_s()
        entries = [entry for entry in self.index.get(keys) if entry is not None and not entry.pinned(now)]
        return str(len(list(self.evict_here(entries))))
