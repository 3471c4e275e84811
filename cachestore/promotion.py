"""Promotion: NVMe-only chunks brought back into the DRAM pool on demand, in batches.

A client that finds chunks whose only copies are on some node's NVMe asks that node's daemon to
promote them, over Redis rather than the REST API (which stays off the data path): it pushes one
request ``<reply id>:<keys as hex>`` onto ``P:pq:<node>`` and blocks on ``P:pr:<reply id>`` for the
answer, a string of '1'/'0' per key. The daemon pops requests in batches, reads the chunks from NVMe
straight into its registered arena (O_DIRECT), verifies them, puts them into DRAM and adds the
``dram@node`` location before answering. Any chunk it cannot promote answers '0': a miss.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

import redis

from cachestore.background import BackgroundLoop
from cachestore.codec import ChunkError, decode
from cachestore.dram import MooncakeTier
from cachestore.nvme import NvmeStore, read_size
from indexer.index import Location, PrefixIndex
from indexer.keys import KEY_BYTES

log = logging.getLogger("prefixcache.promotion")
_REPLY_TTL_S = 30


def request_promotion(
    client: redis.Redis, prefix: str, node: str, keys: Sequence[bytes], timeout_s: float
) -> list[bool]:
    """Ask ``node``'s daemon to promote ``keys``; per key, whether it is now in DRAM."""
    if not keys:
        return []
    reply_id = uuid.uuid4().hex
    client.rpush(f"{prefix}pq:{node}", f"{reply_id}:{b''.join(keys).hex()}")
    answer = client.blpop([f"{prefix}pr:{reply_id}"], timeout=timeout_s)
    if answer is None:
        return [False] * len(keys)
    flags = answer[1].decode()
    return [flag == "1" for flag in flags] if len(flags) == len(keys) else [False] * len(keys)


class Promoter(BackgroundLoop):
    """The daemon's side: serves promotion requests for this node's NVMe tier."""

    name = "prefixcache-promoter"

    def __init__(self, client: redis.Redis, prefix: str, index: PrefixIndex, dram: MooncakeTier, nvme: NvmeStore,
                 node: str, max_batch: int = 64) -> None:  # fmt: skip
        super().__init__()
        self.client = client
        self.queue = f"{prefix}pq:{node}"
        self.prefix = prefix
        self.index = index
        self.dram = dram
        self.nvme = nvme
        self.location = Location("dram", node)
        self.max_batch = max_batch
        self.promoted = 0
        self.failed = 0

    def step(self) -> None:
        self.serve_once()

    def serve_once(self, block_s: float = 0.5) -> int:
        first = self.client.blpop([self.queue], timeout=block_s)
        if first is None:
            return 0
        raw = [first[1]] + (self.client.lpop(self.queue, self.max_batch - 1) or [])
        requests = []
        for item in raw:
            reply_id, _, hex_keys = item.decode().partition(":")
            keys = [bytes.fromhex(hex_keys[i : i + 2 * KEY_BYTES]) for i in range(0, len(hex_keys), 2 * KEY_BYTES)]
            requests.append((reply_id, keys))
        wanted = list(dict.fromkeys(k for _, keys in requests for k in keys))
        done = self._promote(wanted)
        pipe = self.client.pipeline(transaction=False)
        for reply_id, keys in requests:
            name = f"{self.prefix}pr:{reply_id}"
            pipe.rpush(name, "".join("1" if k in done else "0" for k in keys))
            pipe.expire(name, _REPLY_TTL_S)
        pipe.execute()
        return len(requests)

    def _promote(self, keys: list[bytes]) -> set[bytes]:
        entries = {e.key: e for e in self.index.get(keys) if e is not None}
        sizes = dict(zip(keys, self.nvme.size_of(keys), strict=True))
        candidates = [k for k in keys if k in entries and sizes[k] > 0]
        done: set[bytes] = set()
        while candidates:
            slots = self.dram.arena.alloc_batch([read_size(sizes[k]) for k in candidates])  # O_DIRECT, no bounce
            taken = candidates[: len(slots)]
            try:
                done |= self._promote_batch(taken, slots, entries)
            finally:
                for slot in slots:
                    self.dram.arena.free(slot)
            candidates = candidates[len(taken) :]
        self.promoted += len(done)
        self.failed += len(keys) - len(done)
        return done

    def _promote_batch(self, keys: list[bytes], slots: list, entries: dict) -> set[bytes]:
        lengths = self.nvme.get_into(keys, slots)
        ready = []
        for key, slot, length in zip(keys, slots, lengths, strict=True):
            if length < 0:
                continue
            try:
                decode(slot[:length], key=key, namespace=entries[key].namespace)
            except ChunkError as exc:
                log.warning("chunk %s on NVMe is corrupt (%s): deleted", key.hex(), exc)
                self.nvme.delete([key])
                self.index.drop_location([key], Location("nvme", self.location.node))
                continue
            ready.append((key, slot[:length]))
        stored = self.dram.put(ready)
        promoted = [key for (key, _), ok in zip(ready, stored, strict=True) if ok]
        if promoted:
            self.index.add_location(promoted, self.location)
        return set(promoted)
