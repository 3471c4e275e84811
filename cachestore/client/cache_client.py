"""The library the connector and warm-up jobs use: look up, publish and fetch chunks.

The hot path goes from the calling process straight to Redis (index) and Mooncake (bytes, through
this node's segment owner over shared memory); the daemon's REST API is asked once, for the
addresses. Every failure (Redis or Mooncake unreachable, a damaged or vanished chunk) is a miss:
callers recompute, never load wrong KV.

Buffers: ``stage`` hands out slots of the client's registered arena. Build an object in place
(payload at ``meta.payload_offset``), ``publish`` it, then ``release`` the slot. A ``load`` (slot_loads.py)
fills slots and returns views of the verified payloads; ``read_in_place`` reads straight into the caller's memory
(scattered_reads.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import redis

from prefixcache.cachestore.chunks.codec import BodyCheck, ChunkError, ChunkMeta, decode, decode_scattered, write_header
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.client_stats import ClientStatsRecorder
from prefixcache.cachestore.client.config import ClientConfig, chunk_mac_key, fetch_config, index_url
from prefixcache.cachestore.client.moving_rate import MovingRate
from prefixcache.cachestore.client.node_requests import ExtentsAsked, PromotionStream, locate, take_extents
from prefixcache.cachestore.client.scattered_reads import Landed, ScatteredRead
from prefixcache.cachestore.client.slot_loads import Fetched, FetchedPayload, SlotLoad
from prefixcache.cachestore.tiers.dram import LATE, MooncakeTier
from prefixcache.cachestore.tiers.nvme import read_extent
from prefixcache.cachestore.tiers.nvme_io import Extent
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import ChunkRecord, Location, NamespaceCheck, PrefixMatch, attach_namespace
from prefixcache.indexer.keys import PrefixHasher, PrefixQuery
from prefixcache.indexer.namespace import NamespaceSpec, tenant_id
from prefixcache.indexer.peers import SUSPECT_S, PeerRegistry, PeerView
from prefixcache.indexer.quotas import QuotaGate, QuotaStore
from prefixcache.indexer.redis_clients import redis_client
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.client")
#: How long a new chunk is shielded from the master's eviction: far longer than the write-behind
#: needs to persist it (well under a second), after which the daemon's demotion manages it.
UNPERSISTED_PROTECTION_S = 60.0
#: O_DIRECT reads in flight when loading from this node's NVMe: a few in flight keep the disk busier than one.
DISK_READERS = 4
#: The deadline of a read that may cross the network (another node's DRAM copy): this floor, plus its bytes at half
#: the bandwidth this client's reads across the network have had (``READ_SLOWDOWN``), or at
#: ``READ_FLOOR_BYTES_PER_S`` before any was measured. A read past it is a miss, recomputed, and the nodes holding
#: its chunks are marked suspect, so that a lost or congested node costs a request at most about this much more
#: than computing it, while a large read on a modest link (a 1 GbE network moves 512 MiB in 4.3 s) is given the
#: time it needs.
READ_DEADLINE_FLOOR_S = 0.5
READ_FLOOR_BYTES_PER_S = 500e6
READ_SLOWDOWN = 2.0


@dataclass
class ClientCounters:
    """What this client did, in this process (its ``recorder`` adds the same to the node's client stats), counted
    from every thread it and its callers run (fetch, check, disk-read and publishing threads), so through
    ``count``: ``+=`` on an attribute is not atomic across threads."""

    lookups: int = 0
    lookup_errors: int = 0
    published: int = 0
    publish_failures: int = 0
    over_quota: int = 0  # chunks not published: their tenant or namespace had no room left in its quota
    fetched: int = 0
    missing: int = 0
    corrupt: int = 0
    mac_failures: int = 0  # of those corrupt, chunks whose MAC did not verify
    late: int = 0  # chunks whose read from another node passed its deadline: missing, their holders suspect
    promoted: int = 0
    read_from_disk: int = 0
    stored_after_disk_read: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


def read_deadline_s(size_bytes: int, bandwidth: float | None = None) -> float:
    """How long a read of ``size_bytes`` that may cross the network may take before it is a miss, where such reads
    have moved ``bandwidth`` bytes/s (None: not measured yet)."""
    rate = READ_FLOOR_BYTES_PER_S if bandwidth is None else bandwidth / READ_SLOWDOWN
    return READ_DEADLINE_FLOOR_S + size_bytes / rate


class CacheClient:
    def __init__(
        self,
        config: ClientConfig,
        spec: NamespaceSpec,
        *,
        arena_bytes: int = 256 << 20,
        redis_password: str | None = None,
        promote_timeout_s: float = 2.0,
        io_thread_setup: Callable[[], None] | None = None,
        mac_key: ChunkMacKey | None = None,
    ) -> None:
        """``io_thread_setup`` runs first in each thread the client starts (the connector binds them to cores).
        ``mac_key``: the cluster's chunk-signing key [default: read from the file the daemon names]."""
        self.config = config
        self.spec = spec
        self.mac_key = mac_key or chunk_mac_key(config)
        self.node = config.node
        self.geometry = ChunkGeometry(spec.chunk_tokens)
        self.location = Location("dram", config.node)
        self.counters = ClientCounters()
        self.index = RedisIndex(index_url(config, redis_password), key_prefix=config.key_prefix)
        self._redis = redis_client(self.index.url, socket_timeout_s=promote_timeout_s + 1)
        self._keys = self.index.keyspace
        self.recorder = ClientStatsRecorder(self._redis, self._keys, config.node)  # the daemon reports these
        self.quotas = QuotaGate(QuotaStore(self._redis, self._keys))
        self._promote_timeout_s = promote_timeout_s
        self._streams: dict[bytes, PromotionStream] = {}  # chunks other nodes promote for an upcoming fetch
        # the nodes to read nothing from (down, or suspect: a promotion they left unanswered)
        self.peers = PeerView(PeerRegistry(self._redis, self._keys), config.node, thread_setup=io_thread_setup)
        self.peers.start()
        self._disk = ThreadPoolExecutor(
            DISK_READERS, thread_name_prefix="prefixcache-disk-read", initializer=io_thread_setup
        )
        self.dram = MooncakeTier(
            config.mooncake.shm_address,
            arena_bytes=arena_bytes,
            object_prefix=config.key_prefix,
            preferred_segment=config.mooncake.segment,
            thread_setup=io_thread_setup,
        )
        # what reads across the network moved when they were not late: their deadlines follow it
        self._remote_bandwidth = MovingRate()
        # told of each read that crossed the network: its bytes, and the seconds it took or was given (the connector
        # learns the path's bandwidth from them)
        self.on_remote_read: Callable[[int, float], None] | None = None
        self.namespace_check: NamespaceCheck | None = None
        try:
            self.namespace_check = attach_namespace(self.index, spec, log)
        except IndexUnavailableError as exc:
            log.warning("index unreachable at start-up (%s); lookups miss until it answers", exc)

    @classmethod
    def connect(cls, service_url: str, spec: NamespaceSpec, **options: Any) -> CacheClient:
        return cls(fetch_config(service_url), spec, **options)

    def hasher(self, tenant_salt: str | None = None) -> PrefixHasher:
        return PrefixHasher(self.spec.root(tenant_salt), self.geometry)

    def lookup(self, query: PrefixQuery) -> PrefixMatch:
        """Longest cached prefix; an unreachable index is a miss."""
        self.counters.count(lookups=1)
        started = time.perf_counter()
        try:
            match = self.index.lookup(query, avoid=self.peers.down, here="" if self.peers.alone else self.node)
        except IndexUnavailableError as exc:
            self.counters.count(lookup_errors=1)
            log.debug("lookup missed: %s", exc)
            match = PrefixMatch(keys=[], chunk_tokens=query.chunk_tokens)
        self.recorder.record_lookup(
            self.spec.digest, query.num_tokens, match.matched_tokens, time.perf_counter() - started
        )
        return match

    def stage(self, meta: ChunkMeta) -> memoryview:
        """An arena slot for one encoded object; write the payload at ``meta.payload_offset``."""
        return self.dram.arena.alloc(meta.encoded_size)

    def slot(self, size: int) -> memoryview:
        return self.dram.arena.alloc(size)

    def release(self, view: memoryview) -> None:
        self.dram.arena.free(view)

    @property
    def arena_memory(self) -> tuple[int, int]:
        """(address, size) of the registered arena every slot lies in: a GPU worker pins it for its copies."""
        return self.dram.arena.address, self.dram.arena.size

    def publish(
        self, chunks: Sequence[tuple[ChunkMeta, memoryview]], tenant_salt: str | None = None, signed: bool = False
    ) -> list[bool]:
        """Sign each (meta, slot holding its payload), store it in DRAM, then register what was stored; ``signed``:
        the slots hold their signed headers already (codec.ChunkSigning, as the connector signs layer by layer).
        Chunks whose tenant or namespace has no room left in its quota are left out (indexer/quotas.py)."""
        if not chunks:
            return []
        tenant = tenant_id(tenant_salt)
        allowed = self.quotas.admit(tenant, [(meta.namespace, meta.encoded_size) for meta, _ in chunks])
        if all(allowed):
            return self._store_and_register(chunks, tenant, signed)
        self.counters.count(over_quota=allowed.count(False))
        self.recorder.record_over_quota(self.spec.digest, allowed.count(False))
        kept = iter(self._store_and_register([c for c, ok in zip(chunks, allowed, strict=True) if ok], tenant, signed))
        return [ok and next(kept) for ok in allowed]

    def _store_and_register(
        self, chunks: Sequence[tuple[ChunkMeta, memoryview]], tenant: str, signed: bool
    ) -> list[bool]:
        if not chunks:
            return []
        started = time.perf_counter()
        trace.mark("publish_start", chunks=len(chunks))
        objects = [
            (meta.key, slot[: meta.encoded_size if signed else write_header(slot, meta, self.mac_key)])
            for meta, slot in chunks
        ]
        trace.mark("publish_signed")
        stored = self.dram.put(objects, soft_pin_s=UNPERSISTED_PROTECTION_S)
        trace.mark("publish_stored")
        records = [
            ChunkRecord.of(
                parent=meta.parent,
                packed_tokens=meta.tokens,
                root=meta.root,
                namespace=meta.namespace,
                size_bytes=meta.encoded_size,
                location=self.location,
                tenant=tenant,
            )
            for (meta, _), ok in zip(chunks, stored, strict=True)
            if ok
        ]
        try:
            self.index.register(records)
        except IndexUnavailableError as exc:
            log.warning("published chunks not registered (%s); they will not be found", exc)
            stored = [False] * len(chunks)
        trace.mark("publish_registered")
        self.counters.count(published=sum(stored), publish_failures=len(chunks) - sum(stored))
        self.recorder.record_publish(
            self.spec.digest, sum(stored), len(chunks) - sum(stored), time.perf_counter() - started
        )
        return stored

    def load(self) -> SlotLoad:
        """A load through arena slots: its fetches, and the NVMe reads they start ahead, which it holds until it is
        closed (slot_loads.py)."""
        return SlotLoad(self)

    def _fetch(
        self,
        load: SlotLoad,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        upcoming: Sequence[tuple[bytes, memoryview]],
        checks: Executor | None,
        cuts: Sequence[int | None],
        across_network: bool,
    ) -> Fetched[FetchedPayload]:
        """``SlotLoad.fetch`` (``checks`` None) and ``SlotLoad.fetch_checking_later``."""
        started = time.perf_counter()
        self._streams = {key: stream for key, stream in self._streams.items() if not stream.expired}
        out: list[FetchedPayload] = [None] * len(keys)
        planned = {i for i, key in enumerate(keys) if key in self._streams or key in load.ahead}
        unplanned = [i for i in range(len(keys)) if i not in planned]
        corrupt = self._read(keys, slots, unplanned, out, checks, cuts, across_network)
        if missing := [i for i in range(len(keys)) if out[i] is None and i not in planned]:
            self._plan_nvme(load, [keys[i] for i in missing], {keys[i]: slots[i] for i in missing}, upcoming)
        from_disk = self._read_disk(
            load, keys, slots, [i for i, k in enumerate(keys) if out[i] is None and k in load.ahead], out
        )
        promoted = [i for i, key in enumerate(keys) if out[i] is None and key in self._streams]
        corrupt += self._read_promoted(keys, slots, promoted, out, cuts)
        fetched = sum(1 for v in out if v is not None)
        self.counters.count(fetched=fetched, missing=len(out) - fetched)
        self.recorder.record_fetch(
            self.spec.digest, fetched, len(out) - fetched, corrupt, time.perf_counter() - started
        )
        return Fetched(out, from_disk)

    def _read_ahead(self, load: SlotLoad, chunks: Sequence[tuple[bytes, memoryview]]) -> None:
        """``SlotLoad.read_ahead``."""
        if not chunks:
            return
        slots = dict(chunks)
        if elsewhere := self._read_here(load, list(slots), slots):
            self._plan_nvme(load, elsewhere, slots, upcoming=())  # another node's NVMe, if any, promotes them

    def shared_memory(self, size: int) -> memoryview:
        """Zeroed shared memory that ``read_in_place`` can write into (see ``MooncakeTier.shared_memory``)."""
        return self.dram.shared_memory(size)

    def shared_view(self, address: int, size: int) -> memoryview | None:
        """A view of ``size`` bytes at ``address`` if they lie in this client's shared memory, else None."""
        return self.dram.registered_view(address, size)

    def read_in_place(self, chunks: Sequence[Landed], started: float) -> ScatteredRead:
        """A read of chunks from DRAM straight into the caller's memory, where each is checked: the handle copies
        them (``ScatteredRead.fetch``), verifies them where they landed, records the fetch, timed from ``started``
        (``time.perf_counter()``), and gives the chunks' slots back when closed (scattered_reads.py). A damaged
        chunk's DRAM copy is deleted."""
        return ScatteredRead(self, chunks, started)

    def _copy_scattered(
        self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]], second: Sequence[bool]
    ) -> list[bool]:
        """Copy DRAM parts straight into the caller's memory: the first part of each copy (its header and tokens,
        then its first layers; where ``second[i]``, the rest of its layers) across ``parts[i]``, in order, all in
        the arena or ``shared_memory`` (``MooncakeTier.get_scattered``), unverified. Returns per key whether it
        arrived."""
        trace.mark("fetch_scattered", chunks=len(keys), second=sum(second))
        got = [size > 0 for size in self.dram.get_scattered(keys, parts, second)]
        trace.mark("fetch_scattered_end", chunks=len(keys))
        return got

    def _record_scattered_fetch(self, ok: Sequence[bool], started: float) -> None:
        """Record one fetch of chunks read in place, which arrived intact where ``ok``, timed from ``started``."""
        self.counters.count(fetched=sum(ok))
        self.recorder.record_fetch(
            self.spec.digest,
            sum(ok),
            0,
            len(ok) - sum(ok),  # each failure was a reject
            time.perf_counter() - started,
        )

    def store_disk_reads(self, objects: Sequence[tuple[bytes, memoryview]]) -> int:
        """Put chunks read from NVMe (as ``Fetched.from_disk`` gave them) into DRAM and index them there.

        The reader already holds each verified object in a registered slot, so this is one Mooncake
        put: far cheaper than the daemon reading the same bytes from disk again, which would also
        compete with the next load's reads. Callers run it once their load is complete (the connector:
        after the forward pass). Returns how many were stored; a failure only means the next load
        reads the disk again.
        """
        if not objects:
            return 0
        return self._indexed_in_dram([key for key, _ in objects], self.dram.put(objects))

    def store_scattered(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> int:
        """``store_disk_reads`` for chunks read from NVMe straight into the caller's memory (``disk_extents``):
        each object gathered from ``parts[i]`` in order (its header and tokens, then its payload), all in
        the arena or ``shared_memory``. Returns how many were stored."""
        if not keys:
            return 0
        return self._indexed_in_dram(keys, self.dram.put_scattered(keys, parts))

    def _indexed_in_dram(self, keys: Sequence[bytes], stored: list[bool]) -> int:
        """Add this node's DRAM location of the chunks just stored after a disk read; how many were."""
        keys = [key for key, ok in zip(keys, stored, strict=True) if ok]
        try:
            self.index.add_location(keys, self.location)
        except IndexUnavailableError as exc:
            log.debug("chunks stored after a disk read not indexed (%s)", exc)
            self.dram.delete(keys)
            return 0
        self.counters.count(stored_after_disk_read=len(keys))
        return len(keys)

    def disk_extents(self, keys: Sequence[bytes], asked: Sequence[ExtentsAsked] = ()) -> list[Extent | None]:
        """Where this node's NVMe tier holds each chunk (None: not there, or no answer), for a caller that
        reads them itself, straight into its own memory (``prefixcache.cachestore.tiers.nvme.read_pieces``): the
        answers to ``asked`` (requests a scheduler sent as it planned the load: ``SchedulerIndex.ask_extents``) for
        the keys they cover, where this node's daemon was asked, and one request for the others, which this node's
        daemon answers from its manifest. An extent may go stale (compaction moves objects); what is read from it
        is verified like every load (``verify_disk_reads``)."""
        found: dict[bytes, Extent | None] = {}
        wanted = set(keys)
        try:
            for request in asked:
                if request.node == self.node and wanted.intersection(request.keys):
                    answers = take_extents(self._redis, self._keys, request, self._promote_timeout_s)
                    found.update(zip(request.keys, answers, strict=True))
            left = [key for key in keys if key not in found]
            answers = locate(self._redis, self._keys, self.node, left, self._promote_timeout_s)
            found.update(zip(left, answers, strict=True))
        except redis.RedisError as exc:
            log.debug("locating chunks on this node's NVMe failed: %s", exc)
        return [found.get(key) for key in keys]

    def verify_disk_reads(
        self, keys: Sequence[bytes], checks: Sequence[BodyCheck | ChunkError], started: float
    ) -> list[bool]:
        """Per chunk a caller read from ``disk_extents`` into pieces and fed to its ``BodyCheck``, whether it is
        intact (a ``ChunkError`` stands for one that failed before). Records one fetch, timed from ``started``
        (``time.perf_counter()``). A failure is a miss, and the daemon is asked to promote the chunk: an extent
        gone stale (compaction moved the object) brings it back into DRAM, a damaged or forged copy is deleted there
        and counted by the daemon, which drops it, so that each bad copy is counted once."""
        ok = []
        for key, check in zip(keys, checks, strict=True):
            try:
                if isinstance(check, ChunkError):
                    raise check
                check.verdict()
                ok.append(True)
            except ChunkError as exc:
                log.info("chunk %s read from this node's NVMe failed its checks (%s): recomputing", key.hex(), exc)
                ok.append(False)
        failed = [key for key, intact in zip(keys, ok, strict=True) if not intact]
        self.counters.count(fetched=sum(ok), read_from_disk=sum(ok), missing=len(failed))
        self.recorder.record_fetch(self.spec.digest, sum(ok), len(failed), 0, time.perf_counter() - started)
        if failed:
            self._request_promotion(self.node, failed)
        return ok

    def _read(
        self,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        positions: list[int],
        out: list[FetchedPayload],
        checks: Executor | None,
        cuts: Sequence[int | None],
        across_network: bool,
    ) -> int:
        """Read ``keys[i]`` into ``slots[i]`` from DRAM for each i in positions (at ``cuts[i]``, if any:
        ``SlotLoad.fetch``), filling ``out`` with the verified payloads, or with futures of them verified on
        ``checks``; with a deadline ``across_network``. Returns how many of those verified here were rejected (the
        checks on ``checks`` count their own)."""
        if not positions:
            return 0
        rejected = 0
        wanted = [keys[i] for i in positions]
        size_bytes = sum(len(slots[i]) for i in positions)
        started = time.perf_counter()
        sizes = self.dram.get_into(
            wanted,
            [slots[i] for i in positions],
            [cuts[i] for i in positions] if cuts else (),
            deadline_s=read_deadline_s(size_bytes, self._remote_bandwidth.per_second) if across_network else None,
        )
        late = LATE in sizes
        if across_network:
            seconds = time.perf_counter() - started
            # a read past its deadline moved its bytes no faster than that; one that found nothing says nothing
            moved = size_bytes if late else sum(size for size in sizes if size > 0)
            if moved and not late:  # a late read would loosen the next deadline
                self._remote_bandwidth.add(moved, seconds)
            if moved and self.on_remote_read is not None:
                self.on_remote_read(moved, seconds)
        if late:
            self._late([key for key, size in zip(wanted, sizes, strict=True) if size == LATE])
        for i, size in zip(positions, sizes, strict=True):
            if checks is None or size < 0:
                out[i] = self._verified(keys[i], slots[i], size)
                rejected += size >= 0 and out[i] is None
            else:
                out[i] = checks.submit(self._checked_later, keys[i], slots[i], size)
        return rejected

    def _plan_nvme(
        self,
        load: SlotLoad,
        missing: list[bytes],
        slots: dict[bytes, memoryview],
        upcoming: Sequence[tuple[bytes, memoryview]],
    ) -> None:
        """Read from this node's NVMe, or have other nodes promote, ``missing`` and upcoming chunks not in DRAM.

        ``slots`` holds the slot of each missing chunk; reads of this node's chunks start at once,
        upcoming ones included, so the disk stays busy while the caller places what came before.
        """
        wanted = set(missing)
        ahead = [
            (key, slot)
            for key, slot in upcoming
            if key not in wanted and key not in self._streams and key not in load.ahead
        ]
        slots = {**slots, **dict(ahead)}
        candidates = missing + [key for key, _ in ahead]
        try:
            entries = self.index.get(candidates)
        except IndexUnavailableError:
            return
        in_dram = {
            key
            for key, entry in zip(candidates, entries, strict=True)
            if entry and any(loc.tier == "dram" for loc in entry.locations)
        }
        if in_dram & wanted:
            in_dram -= self._gone_from_dram([key for key, _ in ahead if key in in_dram])
        by_node: defaultdict[str, list[bytes]] = defaultdict(list)
        from_bucket: list[bytes] = []  # on no reachable node's NVMe, but in the shared bucket
        down = self.peers.down
        for key, entry in zip(candidates, entries, strict=True):
            locations = entry.locations if entry else ()
            if key not in wanted and key in in_dram:
                continue  # an upcoming chunk DRAM should still serve
            if nodes := {loc.node for loc in locations if loc.tier == "nvme" and loc.node not in down}:
                by_node[self.node if self.node in nodes else min(nodes)].append(key)
            elif any(loc.tier == "object" for loc in locations):
                from_bucket.append(key)
        for node, node_keys in by_node.items():
            if node != self.node:
                self._request_promotion(node, node_keys)
            else:
                self._read_here(load, node_keys, slots)
        if from_bucket:  # this node's daemon reads them from the bucket into DRAM, as it promotes from its NVMe
            self._request_promotion(self.node, from_bucket)

    def _gone_from_dram(self, keys: list[bytes]) -> set[bytes]:
        """Which of ``keys``, which the index says DRAM holds, it does not hold after all.

        Asked only when DRAM just missed a chunk the index placed there: its copies vanished unannounced
        (the master's own eviction, which demotion normally forestalls), and the upcoming chunks' likely
        did too. Planning their disk reads now, in one plan, keeps the disk busy; trusting the index
        would read them one fetch after another, each waiting for the one before.
        """
        return {key for key, held in zip(keys, self.dram.contains(keys), strict=True) if not held}

    def _read_here(self, load: SlotLoad, keys: list[bytes], slots: dict[bytes, memoryview]) -> list[bytes]:
        """Start reading ``keys`` from this node's pack files into their slots, held by ``load``; returns those not
        there."""
        found = self.disk_extents(keys)
        for key, extent in zip(keys, found, strict=True):
            if extent is not None:
                load.ahead[key] = (slots[key], self._disk.submit(read_extent, extent, slots[key]))
        return [key for key, extent in zip(keys, found, strict=True) if extent is None]

    def _request_promotion(self, node: str, keys: list[bytes]) -> None:
        """Ask ``node``'s daemon to promote ``keys``; fetches wait for its answers (a failed request, or a node that
        is down or left one unanswered less than ``peers.SUSPECT_S`` ago: misses)."""
        if node in self.peers.down:
            return
        try:
            stream = PromotionStream(self._redis, self._keys, node, keys, self._promote_timeout_s)
        except redis.RedisError as exc:
            log.debug("promotion request to %s failed: %s", node, exc)
            return
        self._streams.update(dict.fromkeys(keys, stream))

    def _read_disk(
        self,
        load: SlotLoad,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        positions: list[int],
        out: list[FetchedPayload],
    ) -> list[tuple[bytes, memoryview]]:
        """Take the reads of ``keys[i]`` (i in positions) from this node's pack files, and verify them; returns
        (key, verified object) of those intact."""
        stale = []
        intact = []
        for i in positions:
            slot, read = load.ahead.pop(keys[i])
            size = read.result()
            if slot is not slots[i]:  # read ahead into another slot than the caller passes now
                size = -1
            try:
                out[i] = (
                    decode(slots[i][:size], key=keys[i], namespace=self.spec.digest, mac_key=self.mac_key)[1]
                    if size >= 0
                    else None
                )
            except ChunkError:
                out[i] = None  # moved since it was located, or bad: the daemon, asked to promote it, tells which
            if out[i] is None:
                stale.append(keys[i])
            else:
                self.counters.count(read_from_disk=1)
                intact.append((keys[i], slots[i][:size]))
        if stale:
            self._request_promotion(self.node, stale)
        return intact

    def _read_promoted(
        self,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        positions: list[int],
        out: list[FetchedPayload],
        cuts: Sequence[int | None],
    ) -> int:
        """Wait for the promotions of ``keys[i]`` (i in positions), then read those promoted; returns how many
        of them were rejected."""
        rejected = 0
        by_stream: defaultdict[PromotionStream, list[int]] = defaultdict(list)
        for i in positions:
            by_stream[self._streams.pop(keys[i])].append(i)
        for stream, waiting in by_stream.items():

            def gone(node: str = stream.node) -> bool:
                return node in self.peers.down

            try:
                flags = stream.wait([keys[i] for i in waiting], gone=gone)
            except redis.RedisError as exc:
                log.debug("promotion answer lost: %s", exc)
                continue
            if not stream.heard:  # it waited out the deadline
                self.peers.suspect(stream.node)
                log.warning(
                    "node %s did not answer a promotion request: its chunks miss for %.0f s or more",
                    stream.node,
                    SUSPECT_S,
                )
            ready = [i for i, ok in zip(waiting, flags, strict=True) if ok]
            self.counters.count(promoted=len(ready))
            # after a promotion: checked here, with a deadline when another node's DRAM holds them now
            rejected += self._read(keys, slots, ready, out, None, cuts, stream.node != self.node)
        return rejected

    def _late(self, keys: list[bytes]) -> None:
        """Chunks whose read passed its deadline: counted, and every other node holding a DRAM copy of them marked
        suspect, so that no client reads from those nodes for a while (indexer/peers.py)."""
        self.counters.count(late=len(keys))
        self.recorder.record_late(self.spec.digest, len(keys))
        try:
            entries = self.index.get(keys)
        except IndexUnavailableError:
            return
        holders = {loc.node for e in entries if e for loc in e.locations if loc.tier == "dram"} - {self.node}
        for node in sorted(holders):
            log.warning(
                "a read from node %s passed its deadline: its chunks are recomputed, and it is skipped for %.0f s "
                "or more",
                node,
                SUSPECT_S,
            )
            self.peers.suspect(node)

    def _verified(self, key: bytes, slot: memoryview, size: int) -> memoryview | None:
        if size < 0:
            return None
        try:
            _, payload = decode(slot[:size], key=key, namespace=self.spec.digest, mac_key=self.mac_key)
        except ChunkError as exc:
            self._reject(key, exc)
            return None
        return payload

    def _checked_later(self, key: bytes, slot: memoryview, size: int) -> memoryview | None:
        """``_verified`` for ``SlotLoad.fetch_checking_later``, which counted the chunk fetched: a damaged one is
        missing."""
        payload = self._verified(key, slot, size)
        if payload is None:
            self.counters.count(fetched=-1, missing=1)
            self.recorder.record_rejected_after_fetch(self.spec.digest)
        return payload

    def _verified_scattered(self, key: bytes, head: memoryview, payload: Sequence[memoryview]) -> bool:
        try:
            decode_scattered(head, payload, key=key, namespace=self.spec.digest, mac_key=self.mac_key)
        except ChunkError as exc:
            self._reject(key, exc)
            return False
        return True

    def body_check(self, key: bytes, head: memoryview) -> BodyCheck:
        """The check of chunk ``key`` of this client's namespace whose header and tokens are in ``head``, for a
        caller that feeds it the payload piece by piece as it lands (raises ``ChunkError`` at once for a bad header)."""
        return BodyCheck(head, key=key, namespace=self.spec.digest, mac_key=self.mac_key)

    def _count_mac_failure(self) -> None:
        self.counters.count(mac_failures=1)
        self.recorder.record_mac_failure(self.spec.digest)

    def _reject(self, key: bytes, exc: ChunkError) -> None:
        self.counters.count(corrupt=1)
        if exc.reason == "mac":
            self._count_mac_failure()
        log.warning("chunk %s failed verification (%s): deleted, recomputing", key.hex(), exc)
        self._discard(key)

    def discard(self, key: bytes) -> None:
        """Remove a chunk's DRAM copy and its DRAM location: a read found it incomplete (the master evicted one
        of its parts), so that the next load reads NVMe instead of missing the same way."""
        self.counters.count(missing=1)
        self._discard(key)

    def _discard(self, key: bytes) -> None:
        """Remove a damaged DRAM copy so no one else loads it, and say so in the index."""
        self.dram.delete([key])
        try:
            entry = self.index.get([key])[0]
            for location in entry.locations if entry else ():
                if location.tier == "dram":
                    self.index.drop_location([key], location)
        except IndexUnavailableError:
            pass

    def close(self) -> None:
        self.peers.close()
        self._disk.shutdown(wait=True)
        self.recorder.close()
        self.dram.close()
        self.index.close()
        self._redis.close()
