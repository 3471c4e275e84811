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
8 bytes big-endian, msgpack of the batch)``; the sequence starts at 0 with each daemon start.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import redis
import zmq

from prefixcache.cachestore.host.background_loop import BackgroundLoop
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import FeedEvent
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.kv_events")
GROUP = "kv-events"
#: vLLM's names for where a block lives (vllm/distributed/kv_events.py MEDIUM_*), per tier.
MEDIUM = {"dram": "CPU", "nvme": "STORAGE"}


# The classes below mirror vllm.distributed.kv_events field for field (names, tags, array_like):
# the daemon does not depend on vLLM, and tests decode these messages with vLLM's own classes.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
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

    def __init__(self, redis_url: str, key_prefix: str, node: str, endpoint: str, topic: str, block_size: int) -> None:
        super().__init__()
        self._redis_url, self._key_prefix = redis_url, key_prefix
        self.index = RedisIndex(redis_url, key_prefix=key_prefix)
        self.node = node
        self.block_size = block_size
        self.topic = topic.encode()
        self.sequence = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._close_connections()
            raise ConfigError(f"cannot bind kv_events_endpoint {endpoint}: {exc}") from exc
        self.endpoint = endpoint

    def step(self) -> None:
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
            medium = MEDIUM[event.location.tier]
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
        self._socket.send_multipart((self.topic, self.sequence.to_bytes(8, "big"), self._encoder.encode(batch)))
        self.sequence += 1

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
        self._socket.close(linger=0)
        self._context.term()
