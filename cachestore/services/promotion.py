"""Promotion: NVMe-only chunks streamed back into the DRAM pool on demand.

A client that finds chunks whose only copies are on some node's NVMe asks that node's daemon to
promote them, over Redis rather than the REST API (which stays off the data path). It pushes one
request ``<reply id>:<keys as hex>`` onto ``P:pq:<node>``, naming the chunks it needs now and those
it will load next, in load order. The daemon streams the answer: it reads the chunks in slices of
about ``SLICE_BYTES`` (straight into its registered arena, O_DIRECT), reading the next slice from
disk while it verifies the last, puts it into DRAM and adds its ``dram@node`` locations; after each
slice it pushes ``<first>:<flags>`` onto ``P:pr:<reply id>``, one '1'/'0' per key from position
``first`` on. The client loads each slice as soon as its answer arrives, so a long NVMe-only prefix
costs about one pass over the disk rather than, per group, a disk read and then a copy in series.
Any chunk the daemon cannot promote answers '0': a miss, recomputed.

A chunk on no reachable node's NVMe but in the shared bucket (an ``object@`` location) is asked of the client's own
daemon, which reads it from the bucket (within the object tier's read deadline) and promotes it the same way:
object -> this node's DRAM -> the client, verified as every promoted chunk is.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from prefixcache.cachestore.chunks.arena import ArenaFullError
from prefixcache.cachestore.chunks.codec import ChunkError, RejectCounts, decode
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.chunks.runs import runs_of_about
from prefixcache.cachestore.client.node_requests import REPLY_TTL_S, parse_request
from prefixcache.cachestore.tiers.dram import MooncakeTier
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.tiers.nvme_io import read_size
from prefixcache.cachestore.tiers.tier import StorageTier
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.index import ChunkEntry, IndexRegistration, Location
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import RedisClient
from prefixcache.indexer.redis_replies import raw, raw_list

log = logging.getLogger("prefixcache.promotion")
#: Bytes per streamed slice: a few chunks, so the first answer comes after a few ms of disk and the
#: per-slice costs (one DRAM put, one index update, one reply) stay small against the read.
SLICE_BYTES = 4 << 20


@dataclass
class _Request:
    """A request being served: its keys, and how many of them have been answered so far."""

    reply: str
    keys: list[bytes]
    answered: int = 0

    @classmethod
    def parse(cls, keyspace: Keyspace, item: bytes) -> _Request:
        reply_id, keys = parse_request(item)
        return cls(keyspace.promotion_reply(reply_id), keys)

    def next_fragment(self, decided: dict[bytes, bool]) -> str | None:
        """The answers for the run of keys decided since the last fragment, or None if there is none yet."""
        first = self.answered
        while self.answered < len(self.keys) and self.keys[self.answered] in decided:
            self.answered += 1
        if self.answered == first:
            return None
        return f"{first}:" + "".join("1" if decided[k] else "0" for k in self.keys[first : self.answered])


@dataclass
class _Slice:
    keys: list[bytes]
    slots: list[memoryview]
    lengths: list[int]
    from_bucket: set[bytes]


class Promoter(BackgroundLoop):
    """The daemon's side: serves promotion requests for this node's NVMe tier, streaming the answers."""

    name = "prefixcache-promoter"

    def __init__(
        self,
        client: RedisClient,
        keyspace: Keyspace,
        index: IndexRegistration,
        dram: MooncakeTier,
        nvme: NvmeTier,
        node: str,
        *,
        mac_key: ChunkMacKey,
        max_batch: int = 64,
        bucket: StorageTier | None = None,
    ) -> None:
        """``bucket``: the object tier, the source of chunks this node's NVMe lacks (None: none)."""
        super().__init__()
        self.bucket = bucket
        self.mac_key = mac_key
        self.client = client
        self.queue = keyspace.promotion_queue(node)
        self.keyspace = keyspace
        self.index = index
        self.dram = dram
        self.nvme = nvme
        self.location = Location("dram", node)
        self.max_batch = max_batch
        self.promoted = 0
        self.failed = 0
        self.corrupt = RejectCounts()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-promote-read")

    def step(self) -> None:
        self.serve_once()

    def stop(self) -> None:
        super().stop()
        self._reader.shutdown(wait=True)

    def serve_once(self, block_s: float = 0.5) -> int:
        """Serve the requests queued now (waiting up to ``block_s`` for the first); how many there were."""
        first = self.client.blpop([self.queue], timeout=block_s)
        if first is None:
            return 0
        queued = [raw(first[1]), *raw_list(self.client.lpop(self.queue, self.max_batch - 1))]
        requests = [_Request.parse(self.keyspace, item) for item in queued]
        decided: dict[bytes, bool] = {}
        for outcome in self._promote(list(dict.fromkeys(k for r in requests for k in r.keys))):
            decided.update(outcome)
            self._answer(requests, decided)
        return len(requests)

    def _answer(self, requests: list[_Request], decided: dict[bytes, bool]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for request in requests:
            if (fragment := request.next_fragment(decided)) is not None:
                pipe.rpush(request.reply, fragment)
                pipe.expire(request.reply, REPLY_TTL_S)
        if len(pipe):
            pipe.execute()

    def _promote(self, keys: list[bytes]) -> Iterator[dict[bytes, bool]]:
        """Promote ``keys`` in order, yielding each slice's outcome as soon as it is known."""
        entries = {e.key: e for e in self.index.get(keys) if e is not None}
        sizes = dict(zip(keys, self.nvme.size_of(keys), strict=True))
        from_bucket = {
            k
            for k in keys
            if self.bucket is not None
            and sizes[k] <= 0
            and k in entries
            and any(loc.tier == "object" for loc in entries[k].locations)
        }
        sizes.update((k, entries[k].size_bytes) for k in from_bucket)
        candidates = [k for k in keys if k in entries and sizes[k] > 0]
        if len(candidates) < len(keys):
            self.failed += len(keys) - len(candidates)
            yield {k: False for k in keys if k not in entries or sizes[k] <= 0}
        slices = runs_of_about(candidates, sizes.__getitem__, SLICE_BYTES)
        reading: Future[_Slice] | None = None
        try:
            for i, keys_of_slice in enumerate(slices):
                current = reading.result() if reading is not None else self._read(keys_of_slice, sizes, from_bucket)
                reading = (
                    self._reader.submit(self._read, slices[i + 1], sizes, from_bucket) if i + 1 < len(slices) else None
                )
                try:
                    done = self._store(current, entries)
                finally:
                    for slot in current.slots:
                        self.dram.arena.free(slot)
                self.promoted += len(done)
                self.failed += len(current.keys) - len(done)
                yield {k: k in done for k in current.keys}
        finally:
            if reading is not None:  # stopped early: the read in flight still holds arena slots
                for slot in reading.result().slots:
                    self.dram.arena.free(slot)

    def _read(self, keys: list[bytes], sizes: dict[bytes, int], from_bucket: set[bytes]) -> _Slice:
        """Read one slice into arena slots: from NVMe (page-aligned: O_DIRECT lands there with no bounce), those of
        ``from_bucket`` from the bucket."""
        try:
            slots = self.dram.arena.alloc_batch([read_size(sizes[k]) for k in keys])
        except ArenaFullError:
            slots = []
        if len(slots) < len(keys):
            log.warning("promotion arena full: %d of %d chunks not promoted", len(keys) - len(slots), len(keys))
        lengths = [-1] * len(keys)
        for source, picked in ((self.nvme, False), (self.bucket, True)):
            at = [i for i in range(len(slots)) if (keys[i] in from_bucket) == picked]
            if at and source is not None:
                for i, length in zip(at, source.get_into([keys[i] for i in at], [slots[i] for i in at]), strict=True):
                    lengths[i] = length
        return _Slice(keys, slots, lengths, from_bucket & set(keys))

    def _store(self, read: _Slice, entries: dict[bytes, ChunkEntry]) -> set[bytes]:
        """Verify a slice, put what is intact into DRAM and index it there; the keys promoted."""
        ready = []
        for key, slot, length in zip(read.keys, read.slots, read.lengths, strict=False):
            if length < 0:
                continue
            try:
                decode(slot[:length], key=key, namespace=entries[key].namespace, mac_key=self.mac_key)
            except ChunkError as exc:
                self.corrupt.count(exc)
                if key in read.from_bucket and self.bucket is not None:
                    log.warning("chunk %s in the bucket is corrupt (%s): deleted", key.hex(), exc)
                    self.bucket.delete([key])
                    for location in [loc for loc in entries[key].locations if loc.tier == "object"]:
                        self.index.drop_location([key], location)
                else:
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
