"""Requests queued for one node's daemon over Redis, and the asking side of those clients send.

Three kinds: promotions (``PromotionStream``: bring NVMe-only chunks back into DRAM,
cachestore/services/promotion.py), extents (``locate``, or ``ask_extents`` ahead of ``take_extents``: where on this
node's NVMe chunks lie, cachestore/services/nvme_extents.py) and eviction orders, which only daemons send
(cachestore/services/eviction_orders.py). Each is one list item ``<reply id>:<keys as hex>`` on a queue named after
the node, so that any process (a vLLM worker, another node's daemon) reaches a node's daemon through the index's
Redis while the REST API stays off these paths, and a request waits in Redis while the daemon is down. The answer
goes on a reply list named after the reply id, which expires if nobody reads it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from prefixcache.cachestore.tiers.nvme_io import Extent
from prefixcache.indexer.keys import KEY_BYTES
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import text

log = logging.getLogger("prefixcache.client")

#: How long an answer nobody reads stays in Redis (its asker gave up or died).
REPLY_TTL_S = 30
#: How often a wait for a promotion's first answer asks whether the node has been found down meanwhile.
GONE_CHECK_S = 0.25


def format_request(reply_id: str, keys: Sequence[bytes]) -> str:
    """``<reply id>:<keys as hex>``: what ``parse_request`` reads back."""
    return f"{reply_id}:{b''.join(keys).hex()}"


def parse_request(item: bytes) -> tuple[str, list[bytes]]:
    """``<reply id>:<keys as hex>``, the form of every request queued for a daemon."""
    reply_id, _, hex_keys = item.decode().partition(":")
    return reply_id, [bytes.fromhex(hex_keys[i : i + 2 * KEY_BYTES]) for i in range(0, len(hex_keys), 2 * KEY_BYTES)]


class PromotionStream:
    """One promotion request (cachestore/services/promotion.py), asked of ``node``'s daemon at once and answered
    slice by slice."""

    def __init__(
        self, client: RedisClient, keyspace: Keyspace, node: str, keys: Sequence[bytes], timeout_s: float
    ) -> None:
        self._client = client
        self.node = node
        #: whether the node answered anything: a request that expires unheard went to a node that is down
        self.heard = False
        reply_id = uuid.uuid4().hex
        self._reply = keyspace.promotion_reply(reply_id)
        self._position = {key: i for i, key in enumerate(keys)}
        self._flags: list[bool | None] = [None] * len(self._position)
        self._deadline = time.monotonic() + timeout_s
        client.rpush(keyspace.promotion_queue(node), format_request(reply_id, list(self._position)))

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self._deadline

    def wait(self, keys: Sequence[bytes], gone: Callable[[], bool] = lambda: False) -> list[bool]:
        """Whether each of ``keys`` (all named in the request) is now in DRAM; blocks until answered.

        A key still unanswered at the deadline counts as not promoted, as does every key once ``gone()`` says the
        node is down before it answered anything (asked every ``GONE_CHECK_S``): a node lost just after the request
        costs the time it takes to be known lost, not the whole timeout.
        """
        positions = [self._position[key] for key in keys]
        while any(self._flags[i] is None for i in positions):
            left = self._deadline - time.monotonic()
            if left <= 0 or (not self.heard and gone()):
                break
            answer = self._client.blpop([self._reply], timeout=left if self.heard else min(left, GONE_CHECK_S))
            if answer is not None:
                self._take(text(answer[1]))
            elif self.heard:
                break
        return [self._flags[i] is True for i in positions]

    def _take(self, fragment: str) -> None:
        self.heard = True
        first, _, flags = fragment.partition(":")
        try:
            start = int(first)
        except ValueError:
            log.warning("ignoring a malformed promotion answer %.40r", fragment)
            return
        for i, flag in enumerate(flags[: max(len(self._flags) - start, 0)], start):
            self._flags[i] = flag == "1"


@dataclass(frozen=True)
class ExtentsAsked:
    """A ``locate`` request sent ahead of the read that needs its answer (``ask_extents``): a scheduler asks as it
    plans a load, and the worker that reads the chunks takes the answer (``take_extents``), which the daemon gave
    meanwhile, instead of waiting a round trip through the daemon once the step has begun. ``node``: the daemon
    asked, whose pack files the answer names."""

    node: str
    reply_id: str
    keys: tuple[bytes, ...]


def ask_extents(
    client: RedisClient, keyspace: Keyspace, node: str, key_groups: Sequence[Sequence[bytes]]
) -> list[ExtentsAsked]:
    """Ask ``node``'s daemon where its NVMe tier holds each group of keys, one request per group, in one round trip
    (``P:xq:<node>``, answered on ``P:xr:<reply id>``: cachestore/services/nvme_extents.py); raises
    ``redis.RedisError``."""
    asked = [ExtentsAsked(node, uuid.uuid4().hex, tuple(keys)) for keys in key_groups if keys]
    if asked:
        pipe = client.pipeline(transaction=False)
        for request in asked:
            pipe.rpush(keyspace.extents_queue(node), format_request(request.reply_id, request.keys))
        pipe.execute()
    return asked


def take_extents(client: RedisClient, keyspace: Keyspace, asked: ExtentsAsked, timeout_s: float) -> list[Extent | None]:
    """The answer to ``asked``, per key (None: not there, or no answer in time); raises ``redis.RedisError``."""
    answer = client.blpop([keyspace.extents_reply(asked.reply_id)], timeout=timeout_s)
    if answer is None:
        return [None] * len(asked.keys)
    try:
        found = json.loads(answer[1])
        extents = [Extent(str(e[0]), int(e[1]), int(e[2])) if e else None for e in found]
    except (ValueError, TypeError, IndexError):
        log.warning("ignoring a malformed extents answer from %s", asked.node)
        return [None] * len(asked.keys)
    return extents if len(extents) == len(asked.keys) else [None] * len(asked.keys)


def locate(
    client: RedisClient, keyspace: Keyspace, node: str, keys: Sequence[bytes], timeout_s: float
) -> list[Extent | None]:
    """Where ``node``'s NVMe tier holds each of ``keys`` (None: not there, or no answer in time): ``ask_extents``,
    then ``take_extents``; raises ``redis.RedisError``."""
    if not keys:
        return []
    (asked,) = ask_extents(client, keyspace, node, [keys])
    return take_extents(client, keyspace, asked, timeout_s)
