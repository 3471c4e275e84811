"""Same-node direct reads of the NVMe tier: the daemon says where chunks lie, the client reads them itself.

Promotion moves an NVMe-only chunk through the daemon: a disk read, a DRAM put, then the client's
DRAM get, with the daemon's work on a core the engine's scheduler shares. A client on the daemon's
own node can skip all of it: it asks where the chunks lie (``node_requests.locate``: one request on
``P:xq:<node>``, answered at once from the daemon's in-memory manifest with a JSON list of
``[pack file, offset, length]`` or null per key on ``P:xr:<reply id>``) and reads the pack
files itself with O_DIRECT, at disk speed, while it places what it already has. What it reads is
verified like every load, so an extent gone stale meanwhile is a miss, never wrong KV.
"""

from __future__ import annotations

import json

from prefixcache.cachestore.services.answering_server import AnsweringServer
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient


class ExtentServer(AnsweringServer):
    """The daemon's side: answers ``locate`` requests for this node's NVMe tier."""

    name = "prefixcache-extents"

    def __init__(self, client: RedisClient, keyspace: Keyspace, nvme: NvmeTier, node: str) -> None:
        super().__init__(client, keyspace.extents_queue(node), keyspace.extents_reply)
        self.nvme = nvme

    def answer(self, keys: list[bytes]) -> str:
        return json.dumps([list(e) if e else None for e in self.nvme.extents(keys)])
