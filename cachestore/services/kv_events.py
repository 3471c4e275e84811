"""KV events: what this node's tiers hold, published in vLLM's KV-event format over ZMQ.

Routers that score instances by their cached blocks (llm-d, Dynamo) already subscribe to vLLM's
``KVEventBatch`` messages. Publishing the same messages for the store lets them count a node's
DRAM and NVMe chunks too, with no new protocol: a chunk is one block (``block_size`` = the
chunk size; a prompt's tail is a block with fewer tokens, which routers ignore like any partial
block), its key is the block hash, and ``medium`` names the tier with vLLM's own words:
``CPU`` for the DRAM tier, ``STORAGE`` for the NVMe tier.

The source is the node's change feed (``P:f:<node>``), read through a consumer group of its own so
that the write-behind still sees every event. Each batch of feed events becomes one message; a
chunk added and dropped before it was read is published as removed only. When the feed itself
disappears (the whole index was flushed) subscribers get ``AllBlocksCleared``.

Wire format, as vLLM's ``ZmqEventPublisher`` sends it: three frames ``(topic, sequence number as
8 bytes big-endian, msgpack of the batch)``. The sequence is kept in the index (``P:kvseq:<node>``), so it goes on
across restarts of the daemon: a subscriber sees the gap its downtime or a lost connection left, and asks the
replay endpoint (a ROUTER, vLLM's protocol: a request ``(start sequence)``, answered with every batch still
buffered from there, then an empty end marker with sequence -1) for what it missed. A new publisher waits
``JOIN_S`` before its first message, for the subscribers of a restarted daemon to reconnect.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import msgspec
import redis
import zmq

from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import FeedEvent
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import redis_client
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.kv_events")
GROUP = "kv-events"
#: How long a new publisher holds its first message back: ZMQ subscribers retry a lost connection every 100 ms.
JOIN_S = 1.0
#: Batches kept for replay requests, as vLLM's publisher keeps by default.
REPLAY_BATCHES = 10_000
#: The sequence number of the replay's end marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: vLLM's names for where a block lives (vllm/distributed/kv_events.py MEDIUM_*), per tier.
MEDIUM = {"dram": "CPU", "nvme": "STORAGE"}  # bucket copies are no node's cache: not published


# The classes below mirror vllm.distributed.kv_events field for field (names, tags, array_like):
# the daemon does not depend on vLLM, and tests decode these messages with vLLM's own classes.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the tagged events (the tag is the class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KvEventPublisher(BackgroundLoop):
    """Follows this node's change feed and publishes each batch of changes on a ZMQ PUB socket."""

    name = "prefixcache-kv-events"

    def __init__(
        self,
        redis_url: str,
        keyspace: Keyspace,
        node: str,
        endpoint: str,
        topic: str,
        block_size: int,
        replay_endpoint: str | None = None,
    ) -> None:
        super().__init__()
        self._redis_url, self._key_prefix = redis_url, keyspace.name
        self.index = RedisIndex(redis_url, key_prefix=keyspace.name)
        self._sequences = redis_client(redis_url)
        self._sequence_key = keyspace.kv_sequence(node)
        self.node = node
        self.block_size = block_size
        self.topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BATCHES)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        self._bind(self._socket, endpoint, "kv_events_endpoint")
        if replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._bind(self._replay, replay_endpoint, "kv_events_replay_endpoint")
        self.endpoint = endpoint
        self._join_at = time.monotonic() + JOIN_S

    def _bind(self, socket: zmq.Socket[bytes], address: str, setting: str) -> None:
        """Bind ``socket``; a failure closes every connection and names the setting."""
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            self._close_connections()
            raise ConfigError(f"cannot bind {setting} {address}: {exc}") from exc

    def step(self) -> None:
        self.pause(self._join_at - time.monotonic())
        self._serve_replays()
        try:
            events = self.index.read_feed(self.node, GROUP, "daemon", count=256, block_s=0.2)
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._feed_vanished()
            return
        if events:
            self.publish(self.batch_of(events))
            self.index.ack_feed(self.node, GROUP, [e.id for e in events])

    def batch_of(self, events: list[FeedEvent]) -> KVEventBatch:
        """One message for a batch of feed events, in feed order."""
        added = [e.key for e in events if e.op == "add"]
        chunks = self.index.stored_chunks(added) if added else {}
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for event in events:
            medium = MEDIUM.get(event.location.tier)
            if medium is None:
                continue
            if event.op == "drop":
                out.append(BlockRemoved(block_hashes=[event.key], medium=medium))
            elif (chunk := chunks.get(event.key)) is not None:
                parent, packed = chunk
                stored = BlockStored(
                    block_hashes=[event.key],
                    parent_block_hash=parent,
                    token_ids=memoryview(packed).cast("I").tolist(),
                    block_size=self.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
                out.append(stored)
        return KVEventBatch(ts=time.time(), events=out)

    def publish(self, batch: KVEventBatch) -> None:
        if not batch.events:
            return
        sequence = int(self._sequences.incr(self._sequence_key)) - 1
        payload = self._encoder.encode(batch)
        self._socket.send_multipart((self.topic, sequence.to_bytes(8, "big"), payload))
        self._buffer.append((sequence, payload))

    def _serve_replays(self) -> None:
        """Answer every waiting replay request: the buffered batches from its start sequence on, then the end."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed KV-event replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for sequence, payload in self._buffer:
                if sequence >= first:
                    self._replay.send_multipart((client, b"", self.topic, sequence.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _feed_vanished(self) -> None:
        """The feed and its consumer group are gone (the index was flushed): nothing is cached any more."""
        log.warning("change feed of node %s vanished (index flushed?): publishing AllBlocksCleared", self.node)
        self.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
        self.index.close()
        self.index = RedisIndex(self._redis_url, key_prefix=self._key_prefix)  # forgets the vanished group

    def stop(self) -> None:
        super().stop()
        self._close_connections()

    def _close_connections(self) -> None:
        self.index.close()
        self._sequences.close()
        for socket in (self._socket, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._context.term()
