"""The daemon's side of the requests queued for it over Redis (cachestore/client/node_requests.py): a thread that
takes each request off its node's queue and pushes its one answer onto the reply list the request names."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.cachestore.client.node_requests import REPLY_TTL_S, parse_request
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import raw


class AnsweringServer(BackgroundLoop):
    """Serves one queue of requests that each get one answer: ``answer(keys)``, on the list ``reply(reply id)``
    names (a ``Keyspace`` method)."""

    def __init__(self, client: RedisClient, queue: str, reply: Callable[[str], str]) -> None:
        super().__init__()
        self.client = client
        self.queue = queue
        self.reply = reply

    def answer(self, keys: list[bytes]) -> str:
        raise NotImplementedError

    def step(self) -> None:
        self.serve_once()

    def serve_once(self, block_s: float = 0.5) -> bool:
        item = self.client.blpop([self.queue], timeout=block_s)
        if item is None:
            return False
        reply_id, keys = parse_request(raw(item[1]))
        reply = self.reply(reply_id)
        pipe = self.client.pipeline(transaction=False)
        pipe.rpush(reply, self.answer(keys))
        pipe.expire(reply, REPLY_TTL_S)
        pipe.execute()
        return True
