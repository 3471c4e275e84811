"""The DRAM tier: Mooncake Store objects, reached through this node's segment owner over shared memory.

A ``MooncakeTier`` attaches with ``setup_dummy`` and registers one arena (``self.arena``); callers
that build objects directly in arena slots move them with no copy at all, other buffers are staged
through a slot. ``shared_memory`` hands out further registered memory that the caller keeps (the
connector puts vLLM's KV cache there), and ``get_scattered`` writes objects straight into it.

A chunk's copy here is two objects: the header, tokens and first quarter of the payload's leading rows (the
connector's layers), then the rest (``split_offset``). A load into vLLM's pages fetches every chunk's first
part, lets the forward pass start on the first layers and fetches the second parts meanwhile: a whole-object
copy kept it waiting for every layer's bytes (connector/loaders/dram_in_place.py). Calls that move whole objects
(``put``, ``put_scattered``, ``get_into``) cut and join the parts themselves. The parts are named apart
from whole objects (``<prefix>:<key>:0`` and ``:1``), so a build that stored chunks whole and this one
find each other's copies missing, never of another size.

Errors are misses, never exceptions: an unreachable master or owner (-900, -901) opens a short
circuit breaker so that further calls return misses at once instead of each waiting for an RPC
timeout, and Mooncake reconnects by itself when the master is back. A failed transfer (-800) is a miss
of that call alone: it is what a read from another node that died answers, and this node's own
copies must go on hitting meanwhile. An owner that dropped this
process (no heartbeat for 10 s) is made to take it back (cachestore/tiers/mooncake_attachment.py).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import ExitStack
from typing import cast

from prefixcache.cachestore.chunks.arena import Arena, address_of, view_at
from prefixcache.cachestore.chunks.codec import ChunkError, ChunkMeta, read_meta
from prefixcache.cachestore.tiers.mooncake_attachment import AttachmentKeeper
from prefixcache.cachestore.tiers.mooncake_import import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from prefixcache.cachestore.tiers.mooncake_servers import bound_rpc_timeouts
from prefixcache.cachestore.tiers.tier import Removal, StorageTier, TierHealth
from prefixcache.cachestore.tiers.usage import TierUsage
from prefixcache.indexer.errors import PrefixCacheError
from prefixcache.indexer.index import Tier
from prefixcache.indexer.keyspace import Keyspace

log = logging.getLogger("prefixcache.dram")

OK, MISS, FULL = 0, -704, -200
#: What ``get_into`` answers for an object the pool does not hold.
ABSENT = -1
#: What ``get_into`` answers for an object whose read was abandoned at its deadline (Mooncake's codes are others).
LATE = -2
#: What ``get_into`` answers for an object it could not read though the pool may hold it: Mooncake answered an error
#: other than not found (a lease that ran out before the transfer was over, a call that timed out, the owner or the
#: master unreachable), or the tier serves misses (its breaker open). A reader that acts on an absent object (the
#: write-behind drops its location) tries such a one again instead.
FAILED = -3
#: Reads that may run past their deadline at once, each on a thread of its own: one stuck on a lost node leaves
#: the others theirs.
READ_LANES = 4
#: How long memory an abandoned read targeted stays out of use after Mooncake's call returned: the segment owner's
#: transfer can outlive the call (the attached process's RPC gives up after 30 s, the owner's transfer after at
#: most 60 s from its start, hard-coded in Mooncake), and a late write must never land in a slot in use again.
LATE_WRITE_MARGIN_S = 60.0
#: What every call answers once the segment owner has dropped this process (and a get into parts of the wrong size).
INVALID_PARAMS = -600
UNREACHABLE = frozenset({-1, -900, -901})
LOCAL_BUFFER_BYTES = 16 << 20
#: Warm-up objects of the owner-side pre-fault (``_prefault_owner_side``): size, and how many at once.
PREFAULT_WINDOW_BYTES = 4 << 20
PREFAULT_OBJECTS = 4
#: Registered bytes past the arena that the attachment probe reads into (it never finds its object).
PROBE_BYTES = 4096


class TierUnavailableError(PrefixCacheError, ConnectionError):
    """The tier cannot be attached at all (setup failed); a running tier reports misses instead."""


class MooncakeTier(StorageTier):
    """The DRAM tier (module docstring); a ``StorageTier`` (cachestore/tiers/tier.py)."""

    tier: Tier = "dram"

    def __init__(
        self,
        shm_address: str,
        *,
        arena_bytes: int,
        object_prefix: str = "pc",
        preferred_segment: str | None = None,
        metrics_url: str | None = None,
        put_retry_s: float = 1.0,
        breaker_s: float = 1.0,
        thread_setup: Callable[[], None] | None = None,
        on_unrepaired: Callable[[], None] | None = None,
    ) -> None:
        """``thread_setup`` runs first in the thread this tier starts (the connector binds it to cores);
        ``on_unrepaired``: what to do when the owner dropped this process and would not take it back
        (cachestore/tiers/mooncake_attachment.py; the daemon restarts its owner)."""
        bound_rpc_timeouts()
        self._store = MooncakeDistributedStore()
        rc = self._store.setup_dummy(0, LOCAL_BUFFER_BYTES, shm_address)
        if rc != 0:
            raise TierUnavailableError(
                f"cannot attach to this node's Mooncake segment owner at {shm_address} (rc={rc}); "
                "is `prefixcache serve` running on this node?"
            )
        self._closed = False
        self._close_lock = threading.Lock()
        self._lanes = ThreadPoolExecutor(
            READ_LANES, thread_name_prefix="prefixcache-dram-read", initializer=thread_setup
        )
        self.late_reads = 0  # reads abandoned at their deadline
        self._keeper: AttachmentKeeper | None = None
        registered = arena_bytes + PROBE_BYTES
        base = self._store.alloc_from_mem_pool(registered)
        if not base or self._store.register_buffer(base, registered) != 0:
            self.close()
            raise TierUnavailableError(f"cannot allocate and register a {arena_bytes}-byte shared-memory arena")
        # Touch every page now: a fresh shared-memory page faults on first use, which would slow the first
        # loads through each part of the arena; paying it once here keeps it out of every hit's path.
        ctypes.memset(base, 0, registered)
        self.arena = Arena(base, arena_bytes)
        self._probe_address = base + arena_bytes
        self._regions = [(base, registered)]  # registered memory gets may write into: (address, size)
        self._prefix = Keyspace(object_prefix).root  # Mooncake names its objects under the same prefix as Redis
        self._config = ReplicateConfig()
        if preferred_segment:
            self._config.preferred_segment = preferred_segment
        self._prefault_owner_side(base, arena_bytes)
        self.segment = preferred_segment
        self._metrics_url = metrics_url
        self._put_retry_s = put_retry_s
        self._breaker_s = breaker_s
        self._down_until = 0.0
        self._keeper = AttachmentKeeper(
            self._probe_attachment,
            self._answer_misses_for,
            shm_address,
            thread_setup=thread_setup,
            on_unrepaired=on_unrepaired,
        )
        self._keeper.start()

    def _probe_attachment(self) -> bool | None:
        """Whether the owner still maps this process's memory, from a read of an object that never exists: a
        miss while it does, -600 once it has dropped it; anything else cannot tell
        (cachestore/tiers/mooncake_attachment.py)."""
        name = self._prefix + "attachment-probe"
        code = self._store.batch_get_into([name], [self._probe_address], [PROBE_BYTES])[0]
        return {MISS: True, INVALID_PARAMS: False}.get(code)

    def _answer_misses_for(self, seconds: float) -> None:
        """Calls answer misses without reaching Mooncake for ``seconds`` (the circuit breaker, opened)."""
        self._down_until = max(self._down_until, time.monotonic() + seconds)

    @property
    def reattachments(self) -> int:
        """How many times the segment owner had dropped this process and was made to take it back."""
        return self._keeper.repairs if self._keeper is not None else 0

    def _prefault_owner_side(self, address: int, size: int) -> None:
        """Have the segment owner write once to every page of [address, address + size), as gets do.

        The owner process does the copies, through its own mapping of our memory, and that mapping
        faults page by page too, on the first write to a page even where the owner has read it
        before, so a first get into a part of the arena runs several times slower than a second one.
        cost out of the first loads; it rewrites what it read, so it runs before the memory is handed out.
        (Reading one object into many windows does not: Mooncake serves such repeats without the owner.)
        Best effort: a full pool only means the first loads pay it.
        """
        window = min(PREFAULT_WINDOW_BYTES, size)
        offsets = list(range(0, size - window + 1, window))
        for start in range(0, len(offsets), PREFAULT_OBJECTS):
            batch = [address + offset for offset in offsets[start : start + PREFAULT_OBJECTS]]
            names = [f"{self._prefix}prefault:{uuid.uuid4().hex}" for _ in batch]
            stored = self._store.batch_put_from(names, batch, [window] * len(batch), self._config)
            try:
                if any(code != OK for code in stored):
                    log.debug("memory not pre-faulted on the owner side: the pool refused the warm-up objects")
                    return
                self._store.batch_get_into(names, batch, [window] * len(batch))
            finally:
                self._store.batch_remove(names, True)

    def shared_memory(self, size: int) -> memoryview:
        """``size`` zeroed bytes of shared memory registered with Mooncake, for the life of this tier.

        Gets write straight into it (``get_scattered``): a caller whose own buffers live here, such as
        the connector's KV cache, receives chunks with no copy of its own. Before it is handed out, the
        owner writes every page of it once (``_prefault_owner_side``): gets into pages the owner has only
        read are still slower than a second get, and only pages it has written are as fast (docs/decisions.md,
        "The segment is warmed at start; the KV cache in shared memory is written once").
        """
        address = self._store.alloc_from_mem_pool(size)
        if not address or self._store.register_buffer(address, size) != 0:
            raise TierUnavailableError(f"cannot allocate and register {size} bytes of shared memory")
        ctypes.memset(address, 0, size)  # callers get zeros, and this process's own page faults happen now
        self._regions.append((address, size))
        started = time.perf_counter()
        self._prefault_owner_side(address, size)
        log.info(
            "shared memory: the segment owner wrote its %d MiB once in %.1f s",
            size >> 20,
            time.perf_counter() - started,
        )
        return view_at(address, size)

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open after the master or owner stopped answering."""
        return time.monotonic() >= self._down_until

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], *, soft_pin_s: float = 0) -> list[bool]:
        """Store objects; ``soft_pin_s`` > 0 asks the master to evict them only after unpinned ones for that long.

        Publishers soft-pin new chunks: until the write-behind has persisted them they exist nowhere else,
        and the master's eviction would otherwise pick them (older objects are often protected by the
        leases the write-behind's own reads grant).
        """
        if not items:
            return []
        config = self._config
        if soft_pin_s > 0:
            config = self._pinned_config(soft_pin_s)
        with ExitStack() as staging:
            views = [memoryview(obj).cast("B") for _, obj in items]
            objects = [self._address(view, staging, copy_in=True) for view in views]
            names, addresses, sizes = [], [], []
            for (key, _), view, address in zip(items, views, objects, strict=True):
                at = _split_offset_of(view)
                bounds = [(0, at), (at, len(view))] if at else [(0, len(view))]  # each part's (start, end)
                names.append(self._names(key)[: len(bounds)])
                addresses += [address + start for start, _ in bounds]
                sizes += [end - start for start, end in bounds]
            return self._put_parts(
                names,
                lambda parts, picked: self._store.batch_put_from(
                    parts, [addresses[i] for i in picked], [sizes[i] for i in picked], config
                ),
            )

    def put_scattered(self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store each object gathered from ``parts[i]``, in order, all in registered memory (the arena or
        ``shared_memory``): a chunk read from NVMe straight into KV pages goes into DRAM from those pages."""
        if len(keys) != len(parts):
            raise ValueError("one list of parts per key")
        names, pieces = [], []
        for key, views in zip(keys, parts, strict=True):
            split = split_pieces(views, _split_offset_of(views[0]) if views else None)
            names.append(self._names(key)[: len(split)])
            pieces += split
        addresses = [[self._registered_address(view) for view in views] for views in pieces]
        sizes = [[len(view) for view in views] for views in pieces]
        return self._put_parts(
            names,
            lambda parts, picked: self._store.batch_put_from_multi_buffers(
                parts, [addresses[i] for i in picked], [sizes[i] for i in picked], self._config
            ),
        )

    def _put_parts(
        self, names: Sequence[tuple[str, ...]], put: Callable[[list[str], list[int]], list[int]]
    ) -> list[bool]:
        """``_put_each`` over every object's parts (``names[i]``, in order, numbered on through the objects);
        which objects were stored whole. The stored parts of one that was not are removed."""
        flat = [name for parts in names for name in parts]
        stored = iter(self._put_each(flat, put))
        done = [all(next(stored) for _ in parts) for parts in names]
        if half := [name for parts, ok in zip(names, done, strict=True) if not ok and len(parts) > 1 for name in parts]:
            self._store.batch_remove(half, True)
        return done

    def _put_each(self, names: Sequence[str], put: Callable[[list[str], list[int]], list[int]]) -> list[bool]:
        """Run ``put(names, positions)`` over the objects not stored yet, again while the pool is full (the
        master evicts on a short period above its watermark) until ``put_retry_s`` has passed; which were stored."""
        done = [False] * len(names)
        pending = list(range(len(names)))
        deadline = time.monotonic() + self._put_retry_s
        while pending and self._usable():
            codes = put([names[i] for i in pending], pending)
            retry = []
            for i, code in zip(pending, codes, strict=True):
                if code == OK:
                    done[i] = True
                elif code == FULL and time.monotonic() < deadline:
                    retry.append(i)
                else:
                    self._note(code)
            pending = retry
            if pending:
                time.sleep(0.01)
        return done

    def _pinned_config(self, soft_pin_s: float) -> ReplicateConfig:
        config = ReplicateConfig()
        if self.segment:
            config.preferred_segment = self.segment
        config.soft_pin_action = SoftPinAction.ENABLE
        config.soft_pin_ttl_ms = int(soft_pin_s * 1000)
        return config

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        cuts: Sequence[int | None] = (),
        deadline_s: float | None = None,
    ) -> list[int]:
        """Read each object into its buffer, a chunk's two parts joined; its length, or a miss: ``ABSENT``,
        ``LATE`` or ``FAILED``.

        ``cuts``, where the caller knows them (``split_at`` of each chunk's geometry; None: unknown), say where
        each chunk's copy is cut, so that both its parts are asked for in one call. Otherwise the second
        parts follow in a second call, at the offsets the first parts' headers give: a round trip more, which
        a GPU's loads (every hit through arena slots, in groups) would pay per group. A wrong cut is a miss.

        ``deadline_s``, for reads that may cross the network: a read not over by then is abandoned, its objects
        answered ``LATE``, and its slots held out of use (``Arena.hold``) until Mooncake's call has returned and
        ``LATE_WRITE_MARGIN_S`` has passed, since Mooncake cannot cancel a transfer. Only reads into arena slots
        can be held so: others wait for Mooncake.
        """
        if len(keys) != len(buffers) or (cuts and len(cuts) != len(keys)):
            raise ValueError("one buffer per key, and one cut per key if any")
        if not keys or not self._usable():
            return [FAILED] * len(keys)
        views = [memoryview(b).cast("B") for b in buffers]
        cuts = cuts or [None] * len(keys)
        offsets = [self.arena.offset_of(view) for view in views]
        if deadline_s is not None and None not in offsets:
            in_arena = [self.arena.address + cast(int, offset) for offset in offsets]
            codes = self._get_by(keys, views, in_arena, cuts, deadline_s)
            return [LATE] * len(keys) if codes is None else [self._answered(code) for code in codes]
        with ExitStack() as staging:
            addresses = [self._address(view, staging, copy_in=False) for view in views]
            codes = self._get_parts(keys, addresses, [len(v) for v in views], cuts)
            for view, address, code, offset in zip(views, addresses, codes, offsets, strict=True):
                if code > 0 and offset is None:  # staged through a slot: copied out before the slot goes back
                    view[:code] = self.arena.view_at(address - self.arena.address, code)
            return [self._answered(code) for code in codes]

    def _answered(self, code: int) -> int:
        """What ``get_into`` answers for one object Mooncake answered ``code`` for: its length, ``ABSENT`` where
        Mooncake found no such object, else ``FAILED`` (the failure noted: ``_note``)."""
        if code > 0:
            return code
        self._note(code)
        return ABSENT if code == MISS else FAILED

    def _get_by(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        addresses: list[int],
        cuts: Sequence[int | None],
        deadline_s: float,
    ) -> list[int] | None:
        """``_get_parts`` into arena slots (``views``, at ``addresses``) on a read lane: Mooncake's codes, or None
        for a read abandoned at ``deadline_s``, whose slots are then held (``Arena.hold``)."""
        call = self._lanes.submit(self._get_parts, keys, addresses, [len(v) for v in views], cuts)
        try:
            return call.result(timeout=deadline_s)
        except FutureTimeoutError:
            holds = [self.arena.hold(view, LATE_WRITE_MARGIN_S) for view in views]

            def release(_: object) -> None:
                for hold in holds:
                    hold.over()

            call.add_done_callback(release)
            self.late_reads += 1
            log.info("a read of %d objects passed its %.2f s deadline: abandoned, a miss", len(keys), deadline_s)
            return None

    def _get_parts(
        self, keys: Sequence[bytes], addresses: list[int], sizes: list[int], cuts: Sequence[int | None]
    ) -> list[int]:
        """``get_into``'s reads, from registered addresses: each object's length joined, or its error code."""
        names: list[str] = []
        at: list[int] = []
        lengths: list[int] = []
        spans: list[tuple[int, int | None]] = []  # spans: per key, its first part's place in the call and its cut
        for key, address, size, cut in zip(keys, addresses, sizes, cuts, strict=True):
            first, second = self._names(key)
            if cut is not None and 0 < cut < size:
                spans.append((len(names), cut))
                names += [first, second]
                at += [address, address + cut]
                lengths += [cut, size - cut]
            else:
                spans.append((len(names), None))
                names.append(first)
                at.append(address)
                lengths.append(size)
        got = self._store.batch_get_into(names, at, lengths)
        codes = [_joined(got[i], got[i + 1], cut) if cut is not None else got[i] for i, cut in spans]
        # a chunk whose cut was not known: its second part goes on where its first ended
        unknown = [i for i, (_, cut) in enumerate(spans) if cut is None and codes[i] > 0]
        if rejoin := [i for i in unknown if _split_offset_of(view_at(addresses[i], codes[i])) == codes[i]]:
            rest = self._store.batch_get_into(
                [self._names(keys[i])[1] for i in rejoin],
                [addresses[i] + codes[i] for i in rejoin],
                [sizes[i] - codes[i] for i in rejoin],
            )
            for i, code in zip(rejoin, rest, strict=True):
                codes[i] = codes[i] + code if code > 0 else code
        return codes

    def get_scattered(
        self, keys: Sequence[bytes], parts: Sequence[Sequence[memoryview]], second: Sequence[bool] = ()
    ) -> list[int]:
        """Read the first part of each chunk's copy (its second part where ``second[i]``) straight into its
        ``parts``, in order; their lengths must add up to that part's exactly (``split_offset`` says where a
        chunk is cut; one it does not cut is all first part). Every part lies in registered memory (the arena
        or ``shared_memory``). Returns each part's size, or a miss as ``get_into`` answers it (``ABSENT``, or
        ``FAILED``: another size, or Mooncake down)."""
        if len(keys) != len(parts) or (second and len(second) != len(keys)):
            raise ValueError("one list of parts per key, and one part number per key if any")
        if not keys or not self._usable():
            return [FAILED] * len(keys)
        addresses = [[self._registered_address(view) for view in views] for views in parts]
        sizes = [[len(view) for view in views] for views in parts]
        names = [self._names(key)[bool(second) and second[i]] for i, key in enumerate(keys)]
        codes = self._store.batch_get_into_multi_buffers(names, addresses, sizes)
        return [self._answered(code) for code in codes]

    def registered_view(self, address: int, size: int) -> memoryview | None:
        """A view of [address, address + size) if it lies in memory from ``shared_memory``, else None."""
        if not self._within(address, size, shared_only=True):
            return None
        return view_at(address, size)

    def _registered_address(self, view: memoryview) -> int:
        address = address_of(view)
        if address is None or not self._within(address, len(view)):
            raise ValueError("get_scattered writes only into registered memory (the arena or shared_memory)")
        return address

    def _within(self, address: int, size: int, shared_only: bool = False) -> bool:
        """Whether [address, address + size) lies in one registered region (the arena is the first)."""
        regions = self._regions[1:] if shared_only else self._regions
        return any(base <= address and address + size <= base + length for base, length in regions)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Existence, at the price of a lease on each object (Mooncake grants one on every read). Of a chunk's
        first part: should the master have evicted its second alone, the read that needs it misses."""
        if not keys or not self._usable():
            return [False] * len(keys)
        return [code == 1 for code in self._store.batch_is_exist([self._names(k)[0] for k in keys])]

    def delete(self, keys: Sequence[bytes]) -> list[Removal]:
        """Remove objects from the pool, wherever they are. ``REMOVED`` where a chunk's first part was there,
        ``ABSENT`` where neither part was, ``FAILED`` while Mooncake is unreachable or refuses either part: the
        caller must go on saying the copy exists."""
        if not keys or not self._usable():
            return [Removal.FAILED] * len(keys)
        codes = self._store.batch_remove([name for k in keys for name in self._names(k)], True)
        for code in codes:
            self._note(code)
        return [_removal(first, second) for first, second in zip(codes[::2], codes[1::2], strict=True)]

    def usage(self) -> TierUsage:
        """This node's segment as the master reports it (zeros when the master's metrics are unreachable)."""
        used = capacity = 0
        if self._metrics_url and self.segment:
            try:
                text = urllib.request.urlopen(self._metrics_url, timeout=2).read().decode()
            except OSError:
                text = ""
            label = f'{{segment="{self.segment}"}}'
            for line in text.splitlines():
                if line.startswith("segment_allocated_bytes" + label):
                    used = int(float(line.split()[-1]))
                elif line.startswith("segment_total_capacity_bytes" + label):
                    capacity = int(float(line.split()[-1]))
        return TierUsage(tier="dram", bytes_used=used, live_bytes=used, capacity_bytes=capacity, chunks=-1)

    def health(self) -> TierHealth:
        """Down while the circuit breaker is open (the master or the segment owner stopped answering)."""
        if not self.available:
            return TierHealth(ok=False, detail="Mooncake unreachable; retrying")
        return TierHealth(ok=True, detail=f"segment {self.segment}")

    def close(self) -> None:
        with self._close_lock:
            if not self._closed:
                self._closed = True
                if self._keeper is not None:
                    self._keeper.stop()  # it calls the store too
                self._lanes.shutdown(wait=True)  # an abandoned read still in Mooncake must return first
                self._store.close()  # any call after this would crash the process: _usable() guards them

    def _usable(self) -> bool:
        if self._closed:
            raise RuntimeError("MooncakeTier used after close()")
        return self.available

    def _note(self, code: int) -> None:
        if code == INVALID_PARAMS and self._keeper is not None:
            self._keeper.suspect()  # the owner may have dropped this process
        elif code in UNREACHABLE:
            if self.available:
                log.warning(
                    "Mooncake unreachable (code %d): serving misses for %.1fs, then retrying", code, self._breaker_s
                )
            self._down_until = time.monotonic() + self._breaker_s

    def _names(self, key: bytes) -> tuple[str, str]:
        """The names of a chunk's two parts (one not cut is its first part alone)."""
        name = self._prefix + key.hex()
        return name + ":0", name + ":1"

    def _address(self, view: memoryview, staging: ExitStack, copy_in: bool) -> int:
        offset = self.arena.offset_of(view)
        if offset is None:
            slot = self.arena.alloc(len(view))
            staging.callback(self.arena.free, slot)
            if copy_in:
                slot[:] = view
            offset = self.arena.offset_of(slot)
            assert offset is not None  # a slot of the arena lies in it
        return self.arena.address + offset


def split_offset(meta: ChunkMeta) -> int | None:
    """Where a chunk's DRAM copy is cut in two: after the first rows of its payload (the connector's layers,
    ``first_part_rows``); None for a payload of one row, kept whole."""
    return split_at(meta.payload_offset, meta.shape[0], meta.payload_bytes)


def split_at(payload_offset: int, rows: int, payload_bytes: int) -> int | None:
    """``split_offset`` of a chunk whose payload starts at ``payload_offset`` and holds ``rows`` rows in
    ``payload_bytes``: what a reader that knows the chunk's geometry passes to ``get_into``."""
    first = first_part_rows(rows)
    return payload_offset + first * (payload_bytes // rows) if first and payload_bytes else None


def first_part_rows(rows: int) -> int:
    """How many of a payload's ``rows`` leading rows the first part of its DRAM copy holds (0: not cut): a quarter,
    rounded up. The forward pass waits for the first part's copy, then computes those layers while the owner
    copies the rest, which the first quarter of layers' compute outlasts, since a layer's compute takes longer
    than its copy. A quarter left less of the copy in the hit's path than a half or no cut (docs/decisions.md,
    "A chunk's DRAM copy is two objects")."""
    return -(-rows // 4) if rows > 1 else 0


def split_pieces(pieces: Sequence[memoryview], at: int | None) -> list[list[memoryview]]:
    """``pieces`` of one object, in order, as the pieces of its parts: cut at byte ``at`` (None: one part)."""
    if at is None:
        return [list(pieces)]
    first: list[memoryview] = []
    second: list[memoryview] = []
    start = 0
    for piece in pieces:
        cut = min(max(at - start, 0), len(piece))
        if cut:
            first.append(piece[:cut])
        if cut < len(piece):
            second.append(piece[cut:])
        start += len(piece)
    return [first, second]


def _removal(first: int, second: int) -> Removal:
    """What removing a chunk's two parts did, from Mooncake's answers for each."""
    if first not in (OK, MISS) or second not in (OK, MISS):
        return Removal.FAILED
    return Removal.REMOVED if first == OK else Removal.ABSENT


def _joined(first: int, second: int, cut: int) -> int:
    """The length of a chunk read as its two parts at a known cut (``first`` and ``second``, Mooncake's
    answers), or an error code: a first part of another length was cut elsewhere, and is a miss."""
    if first <= 0:
        return first
    if first != cut:
        return MISS
    return first + second if second > 0 else second


def _split_offset_of(head: memoryview) -> int | None:
    """``split_offset`` of the object that starts with ``head`` (None: not a chunk, whose copy is one object)."""
    try:
        return split_offset(read_meta(head))
    except ChunkError:
        return None
