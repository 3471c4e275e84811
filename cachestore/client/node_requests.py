"""Requests queued for one node's daemon over Redis: promotions, extents, eviction orders.

Each is one list item ``<reply id>:<keys as hex>`` on a queue named after the node, so that any
process (a vLLM worker, another node's daemon) reaches a node's daemon through the index's Redis
while the REST API stays off these paths, and a request waits in Redis while the daemon is down.
The answer goes on a reply list named after the reply id, which expires if nobody reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from prefixcache.cachestore.services.background import BackgroundLoop
from prefixcache.indexer.keys import KEY_BYTES

#: How long an answer nobody reads stays in Redis (its asker gave up or died).
REPLY_TTL_S = 30


def format_request(reply_id: str, keys: Sequence[bytes]) -> str:
    """``<reply id>:<keys as hex>``: what ``parse_request`` reads back."""
    return f"{reply_id}:{b''.join(keys).hex()}"


def parse_request(item: bytes) -> tuple[str, list[bytes]]:
    """``<reply id>:<keys as hex>``, the form of every request queued for a daemon."""
    reply_id, _, hex_keys = item.decode().partition(":")
    return reply_id, [bytes.fromhex(hex_keys[i : i + 2 * KEY_BYTES]) for i in range(0, len(hex_keys), 2 * KEY_BYTES)]


class AnsweringServer(BackgroundLoop):
    """Serves one queue of requests that each get one answer: ``answer(keys)``, on ``<reply_prefix><reply id>``."""

    def __init__(self, client: redis.Redis, queue: str, reply_prefix: str) -> None:
        super().__init__()
        self.client = client
        self.queue = queue
        self.reply_prefix = reply_prefix

    def answer(self, keys: list[bytes]) -> str:
        raise NotImplementedError

    def step(self) -> None:
        self.serve_once()

    def serve_once(self, block_s: float = 0.5) -> bool:
        item = self.client.blpop([self.queue], timeout=block_s)
        if item is None:
            return False
        reply_id, keys = parse_request(item[1])
        reply = f"{self.reply_prefix}{reply_id}"
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(reply, self.answer(keys))
        pipe.expire(reply, REPLY_TTL_S)
        pipe.execute()
        return True
