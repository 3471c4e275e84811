"""The persistent NVMe tier: chunk objects in append-only pack files, located by a RocksDB manifest.

Why not RocksDB for the bytes: it reads 1-8 MiB values cold at about half the speed of O_DIRECT reads of
the same disk (docs/decisions.md). So objects live in append-only pack files, ``<dir>/segments/<id>.seg`` (the
names on disk predate the term), each at a 4096-aligned offset and padded to 4096, so that reading one is a
single O_DIRECT ``preadv``, straight into the caller's buffer when that buffer is page-aligned.
RocksDB (``<dir>/manifest``) only maps key -> (pack file, offset, length, created).

Durability granularity: one ``put`` batch. Its objects are written with one ``pwritev`` per pack file
it touches, each such pack file is ``fdatasync``ed (and the directory of pack files fsynced when a file was
created), and only then are the batch's manifest entries written as one synced RocksDB write (WAL on).
So a put costs one fdatasync per pack file touched (one, unless the batch crosses a pack file boundary)
plus one synced manifest write, and an object it reports stored survives kill -9 and power loss. A
crash between the two steps leaves unreferenced bytes in a pack file (dead space, reclaimed later),
never an entry pointing at missing bytes. Compaction follows the same order, and pack files are
deleted only after the manifest stopped referencing them.

Space: ``capacity_bytes`` bounds the total size of pack files: the configured size, or less where the
filesystem holds less (what the tier uses plus the free space, less a headroom for the manifest), measured
again at every put, so that space other files take or give back counts at once. Writes keep one pack file of
it free (half of it on a filesystem smaller than two pack files) so that compaction, which copies a pack file's
live objects before deleting it, can always run without passing the bound. A put that needs room evicts
least-recently-used unpinned chunks, deletes pack files left without live objects and compacts the pack file
with the most dead bytes. A put the disk refuses (ENOSPC, EIO) is measured and tried once more; what it
still cannot store is reported False, and ``write_failure`` says why, so that the caller keeps its copy.

Recovery never deletes what it can read: pack files the manifest does not reference (all of them, when
the manifest is missing, empty or had to be moved aside because RocksDB cannot open it) are scanned for
their self-describing objects (``cachestore/tiers/nvme_scan.py``), which are taken back into the manifest; files
holding none are left as they are. Files are deleted only at run time, once the manifest no longer names them.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Literal, NamedTuple

import rocksdict

from prefixcache.cachestore.tiers.eviction_policy import EvictionPolicy, LruPolicy
from prefixcache.cachestore.tiers.nvme_io import PAGE, Extent, open_for_reading, page_align, page_aligned, read_size
from prefixcache.cachestore.tiers.nvme_scan import scan_pack_file
from prefixcache.cachestore.tiers.tier import Removal, StorageTier, TierHealth
from prefixcache.cachestore.tiers.usage import TierUsage
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import Tier
from prefixcache.indexer.keys import KEY_BYTES

log = logging.getLogger(__name__)

_ZEROS = memoryview(bytes(PAGE))
_IOV_MAX = os.sysconf("SC_IOV_MAX")
#: Keys per ``is_pinned`` call: the daemon answers it from the index, one round trip per call.
_PIN_QUERY_KEYS = 256
#: Bytes of live objects compaction copies per put-like batch (one read buffer, one fdatasync).
_COMPACTION_BATCH_BYTES = 64 << 20
_RECORD = struct.Struct("<IQQQ")  # pack file id, offset, length, created (ms since the epoch)


#: Free space the tier leaves on its filesystem for the manifest (a memtable flush, its WAL): after one failed
#: write RocksDB refuses every other until it is reopened, so the tier's own writes must not take it.
_MANIFEST_HEADROOM = 16 << 20

#: Why a put stored less than it was given: no room (the filesystem's or the tier's, every unpinned chunk
#: evicted), or the disk failed the write.
WriteFailure = Literal["enospc", "eio"]


def failure_of(error: OSError) -> WriteFailure:
    return "enospc" if error.errno in (errno.ENOSPC, errno.EDQUOT) else "eio"


#: Reads in flight for a multi-object ``get_into``: a disk moves more with several O_DIRECT reads in flight
#: than with one at a time.
_READERS = 4


def read_extent(extent: Extent, view: memoryview) -> int:
    """Read an object straight from its pack file into a page-aligned buffer of at least ``read_size``
    bytes; its length, or -1 (file gone, buffer unusable, short read).

    For clients on the daemon's node: one O_DIRECT ``preadv``, no daemon, no DRAM copy. The extent may
    be stale by the time it is read (compaction moved the object, the segment was deleted); the caller
    verifies what it read, as every load does, and treats a failure as a miss.
    """
    if view.nbytes < read_size(extent.length) or not page_aligned(view):
        return -1
    try:
        fd = open_for_reading(extent.path)
    except OSError:
        return -1
    try:
        got = os.preadv(fd, [view[: read_size(extent.length)]], extent.offset)
    except OSError:
        return -1
    finally:
        os.close(fd)
    return extent.length if got >= extent.length else -1


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"chunk keys are {KEY_BYTES} bytes, got {key!r:.60}")


def _byte_view(buffer: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buffer)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _batches(extents: list[tuple[bytes, _Extent]], limit: int) -> Iterable[list[tuple[bytes, _Extent]]]:
    """Consecutive groups of at most ``limit`` padded bytes (a larger extent goes alone)."""
    group: list[tuple[bytes, _Extent]] = []
    size = 0
    for item in extents:
        if group and size + item[1].padded > limit:
            yield group
            group, size = [], 0
        group.append(item)
        size += item[1].padded
    if group:
        yield group


def _fsync_dir(path: Path) -> None:
    """Make a created or removed directory entry durable: fdatasync of the file does not cover its name."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_all(fd: int, views: Iterable[memoryview], offset: int) -> None:
    """Write views back to back at offset, IOV_MAX per syscall, resuming after short writes."""
    pending = deque(views)
    while pending:
        written = os.pwritev(fd, list(islice(pending, _IOV_MAX)), offset)
        if written == 0:
            raise OSError(errno.ENOSPC, "pack file write made no progress")
        offset += written
        while written:
            head = pending[0]
            if len(head) <= written:
                written -= len(head)
                pending.popleft()
            else:
                pending[0] = head[written:]
                written = 0


@dataclass(frozen=True)
class RecoveryReport:
    """What opening the directory found. The manifest is trusted only where the bytes it names exist."""

    chunks: int
    dropped_entries: int  # manifest entries whose pack file is missing or ends before their bytes
    rebuilt: int  # objects found in pack files the manifest did not reference, taken back into it
    untouched_pack_files: int  # pack files without one readable object: not used, left as they are
    manifest_moved_to: str | None = None  # where a manifest RocksDB could not open or read was moved


@dataclass(frozen=True, slots=True)
class _Extent:
    """Where one object's bytes are; also its manifest record."""

    pack_id: int
    offset: int
    length: int
    created_ms: int

    @property
    def padded(self) -> int:
        return page_align(self.length)

    def pack(self) -> bytes:
        return _RECORD.pack(self.pack_id, self.offset, self.length, self.created_ms)

    @classmethod
    def unpack(cls, record: bytes) -> _Extent:
        return cls(*_RECORD.unpack(record))


class _PackFile:
    """One pack file: append offset, live accounting and descriptors.

    Readers take a reference while they read without the store lock. A retired (deleted) pack file closes
    its read descriptor only when the last reader lets go, so a descriptor number is never reused under
    a reader's feet, and an unlinked file stays readable until then.
    """

    def __init__(self, directory: Path, pack_id: int, end: int) -> None:
        self.id = pack_id
        self.path = directory / f"{pack_id:08d}.seg"
        self.end = end  # aligned append offset; what the file costs on disk
        self.live = 0  # padded bytes of live objects
        self.keys: set[bytes] = set()
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._readers = 0
        self._retired = False

    @property
    def dead(self) -> int:
        return self.end - self.live

    def writer(self) -> int:
        if self._write_fd is None:  # chunks hold their tokens in clear: the file is its owner's alone
            self._write_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._write_fd

    def close_writer(self) -> None:
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None

    def acquire(self, open_reader: Callable[[Path], int]) -> int:
        if self._read_fd is None:
            self._read_fd = open_reader(self.path)
        self._readers += 1
        return self._read_fd

    def release(self) -> None:
        self._readers -= 1
        self._close_reader_if_unused()

    def retire(self) -> None:
        self._retired = True
        self.close_writer()
        self._close_reader_if_unused()

    def _close_reader_if_unused(self) -> None:
        if self._retired and self._readers == 0 and self._read_fd is not None:
            os.close(self._read_fd)
            self._read_fd = None


class _Located(NamedTuple):
    """An object a reader is about to read: its pack file stays referenced until the reader releases it."""

    pack: _PackFile
    fd: int
    extent: _Extent


class _Manifest:
    """key -> packed ``_Extent`` in RocksDB. Every write is one batch, synced through the WAL.

    rocksdict raises a bare ``Exception`` for every RocksDB status; this class raises ``OSError`` instead
    (ENOSPC or EIO), so that the store handles a failed manifest write like a failed pack file write.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db = self._open()
        self._sync = rocksdict.WriteOptions()
        self._sync.sync = True

    def _open(self) -> rocksdict.Rdict:
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        # Records are 44 bytes and only read in full at open: no block cache or bloom filter to tune,
        # but a small memtable and WAL bound what a restart has to replay.
        options.set_write_buffer_size(8 << 20)
        options.set_max_total_wal_size(64 << 20)
        options.set_keep_log_file_num(2)
        return rocksdict.Rdict(str(self.path), options)

    def items(self) -> list[tuple[bytes, bytes]]:
        return list(self._db.items())  # type: ignore[arg-type]  # rocksdict's stub: RdictItems, with no item type

    def write(self, puts: Iterable[tuple[bytes, bytes]] = (), deletes: Iterable[bytes] = ()) -> None:
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key, record in puts:
            batch.put(key, record)
        for key in deletes:
            batch.delete(key)
        try:
            self._db.write(batch, self._sync)
        except Exception as exc:  # noqa: BLE001 - rocksdict's one exception type
            self._reopen()
            code = errno.ENOSPC if "No space left" in str(exc) else errno.EIO
            raise OSError(code, f"NVMe manifest write failed: {exc}") from exc

    def _reopen(self) -> None:
        """After a failed write RocksDB refuses all others until reopened (what it wrote before stays)."""
        with contextlib.suppress(Exception):
            self._db.close()
        try:
            self._db = self._open()
        except Exception as exc:  # noqa: BLE001 - still failing: the next write tries again
            log.warning("NVMe manifest %s cannot be reopened yet: %s", self.path, exc)

    def close(self) -> None:
        self._db.close()


def _open_manifest(path: Path) -> tuple[_Manifest, list[tuple[bytes, bytes]], Path | None]:
    """The manifest, its records, and where a broken one was moved: one that RocksDB cannot open or read (a
    garbage ``CURRENT``, say) is renamed aside, never deleted, and a new one started for recovery to fill."""
    try:
        manifest = _Manifest(path)
    except Exception as exc:  # noqa: BLE001 - rocksdict's one exception type
        return _move_aside(path, exc)
    try:
        return manifest, manifest.items(), None
    except Exception as exc:  # noqa: BLE001 - rocksdict's one exception type
        with contextlib.suppress(Exception):
            manifest.close()
        return _move_aside(path, exc)


def _move_aside(path: Path, error: Exception) -> tuple[_Manifest, list[tuple[bytes, bytes]], Path]:
    aside = path.with_name(f"{path.name}.broken-{time.time_ns()}")
    try:
        path.rename(aside)
        _fsync_dir(path.parent)
    except OSError as exc:
        raise ConfigError(
            f"NVMe manifest {path} is unreadable ({error}) and cannot be moved aside ({exc}); pack files untouched"
        ) from exc
    log.warning(
        "NVMe manifest %s is unreadable (%s): moved to %s; rebuilding it from the pack files",
        path,
        str(error).splitlines()[0],
        aside,
    )
    return _Manifest(path), [], aside


class _Scratch(threading.local):
    """A per-thread page-aligned bounce buffer for reads whose destination O_DIRECT cannot use."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, size: int) -> memoryview:
        if self._map is None or len(self._map) < size:
            self._map = mmap.mmap(-1, max(size, 1 << 20))
        return memoryview(self._map)[:size]


def _validate(capacity_bytes: int, pack_file_bytes: int) -> None:
    if pack_file_bytes <= 0 or pack_file_bytes % PAGE:
        raise ConfigError(f"pack_file_bytes must be a positive multiple of {PAGE} (O_DIRECT), got {pack_file_bytes}")
    if capacity_bytes < 2 * pack_file_bytes:
        raise ConfigError(
            f"capacity_bytes must be at least 2 x pack_file_bytes = {2 * pack_file_bytes} (one pack file is kept free "
            f"so that compaction can always run), got {capacity_bytes}; lower pack_file_bytes for a small tier"
        )


class _PinAnswers:
    """The pins one put knows, asked outside the write lock, and the keys its eviction wanted and did not know.
    A pin set after it was asked is missed, as it was when asked under the lock: pins guard against eviction
    for room, not against a put racing the pin."""

    __slots__ = ("_is_pinned", "known", "wanted")

    def __init__(self, is_pinned: Callable[[Sequence[bytes]], list[bool]]) -> None:
        self._is_pinned = is_pinned
        self.known: dict[bytes, bool] = {}
        self.wanted: list[bytes] = []

    def ask(self, keys: Sequence[bytes]) -> None:
        keys = list(keys)
        self.known.update(zip(keys, self._is_pinned(keys), strict=True))
        self.wanted = []


class NvmeTier(StorageTier):
    """The NVMe tier of one node (see the module docstring for layout, durability and space rules); a
    ``StorageTier`` (cachestore/tiers/tier.py), evicting in its ``EvictionPolicy``'s order.

    Two locks: ``_write_lock`` serialises mutations (put, delete, eviction, compaction) across their
    data I/O; ``_lock`` guards the in-memory maps and is never held across data I/O, so request threads
    locate and read objects while a write-behind put is syncing. ``is_pinned`` (a round trip to the
    index) runs under neither: a put asks it before taking the write lock, and again, the lock let go,
    for the next keys eviction would examine (``_PinAnswers``). ``on_evict`` runs under the write lock:
    it may read the store, not put to or delete from it.
    """

    tier: Tier = "nvme"

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        *,
        pack_file_bytes: int = 256 << 20,
        is_pinned: Callable[[Sequence[bytes]], list[bool]] = lambda keys: [False] * len(keys),
        on_evict: Callable[[list[bytes]], None] = lambda keys: None,
        policy: EvictionPolicy | None = None,
    ) -> None:
        """``policy`` orders the chunks evicted for room (least recently used first unless given)."""
        _validate(capacity_bytes, pack_file_bytes)
        self.directory = Path(directory)
        self.setting_bytes = capacity_bytes  # what it was given; ``capacity_bytes`` is what it may use now
        self.capacity_bytes = capacity_bytes
        self.pack_file_bytes = pack_file_bytes
        self._write_budget = capacity_bytes - pack_file_bytes
        #: why the last put stored less than it was given; None once one stores everything
        self.write_failure: WriteFailure | None = None
        self._is_pinned = is_pinned
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._entries: dict[bytes, _Extent] = {}
        self._policy: EvictionPolicy = policy if policy is not None else LruPolicy()
        self._packs: dict[int, _PackFile] = {}
        self._active: _PackFile | None = None
        self._next_pack_id = 1
        self._live_length = 0
        self._direct = True
        self._scratch = _Scratch()
        self._scratch_lock = threading.Lock()
        self._readers = ThreadPoolExecutor(_READERS, thread_name_prefix="prefixcache-nvme-read")
        self._closed = False
        self._pack_dir = self.directory / "segments"
        try:
            self._pack_dir.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise ConfigError(f"NVMe tier directory {self.directory} is not a directory: {e}") from e
        _fsync_dir(self.directory)
        self._manifest, records, moved_to = _open_manifest(self.directory / "manifest")
        self.recovery = self._recover(records, moved_to)
        log.info("NVMe tier at %s: %s", self.directory, self.recovery)
        if self.refresh_capacity() < capacity_bytes:
            log.warning(
                "NVMe tier at %s: set to %d MiB, but its filesystem holds %d MiB for it (%d MiB used by "
                "the tier, the rest free, %d MiB left for the manifest); it uses at most that",
                self.directory,
                capacity_bytes >> 20,
                self.capacity_bytes >> 20,
                self.usage_bytes() >> 20,
                _MANIFEST_HEADROOM >> 20,
            )

    # ---- public API -------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store each object; True where it is durable now. A key given twice stores its last object.

        False only for objects larger than the write budget, for objects that do not fit once every
        unpinned chunk is evicted, and when the disk fails the write twice (the capacity is measured
        again in between); ``write_failure`` then says why.
        """
        objects: dict[bytes, memoryview] = {}
        for key, value in items:
            _check_key(key)
            view = _byte_view(value)
            if not view.nbytes:
                raise ValueError("chunk objects are never empty (the codec writes a header)")
            objects[key] = view
        pins = _PinAnswers(self._is_pinned)
        self._ask_pins_ahead(objects, pins)
        stored: set[bytes] = set()
        while True:
            with self._write_lock:
                self._check_open()
                stored |= self._store({key: view for key, view in objects.items() if key not in stored}, pins)
            if len(stored) == len(objects) or not pins.wanted:
                return [key in stored for key, _ in items]
            pins.ask(pins.wanted)  # eviction stopped at chunks whose pins were not asked: asked now, unlocked

    def _ask_pins_ahead(self, objects: dict[bytes, memoryview], pins: _PinAnswers) -> None:
        """Where the put will need room, ask the pins of the first chunks eviction would examine, before the
        write lock is taken."""
        need = sum(page_align(view.nbytes) for view in objects.values())
        with self._lock:
            if self._space()[0] + need <= self._write_budget:
                return
            keys = self._policy.coldest(objects.keys(), _PIN_QUERY_KEYS)
        pins.ask(keys)

    def _store(self, objects: dict[bytes, memoryview], pins: _PinAnswers) -> set[bytes]:
        """Admit and write the objects; after a write error, once more with the capacity measured again."""
        for attempt in range(2):
            self.refresh_capacity()
            try:
                admitted = self._admit(objects, pins)
                now_ms = time.time_ns() // 1_000_000
                stored = self._append([(key, objects[key], now_ms) for key in admitted], touch=True)
            except OSError as exc:
                self.write_failure = failure_of(exc)
                log.warning(
                    "NVMe tier: writing %d objects failed (%s)%s",
                    len(objects),
                    exc,
                    "; evicting and trying again" if attempt == 0 else "; they are not stored",
                )
                continue
            self.write_failure = None if len(stored) == len(objects) else "enospc"
            return stored
        return set()

    def refresh_capacity(self) -> int:
        """Measure what the tier may use now: its setting, or what its filesystem holds for it if less."""
        fs = os.statvfs(self._pack_dir)
        with self._lock:
            room = self._space()[0] + fs.f_bavail * fs.f_frsize - _MANIFEST_HEADROOM
            self.capacity_bytes = max(0, min(self.setting_bytes, room))
            self._write_budget = self.capacity_bytes - min(self.pack_file_bytes, page_align(self.capacity_bytes // 2))
            return self.capacity_bytes

    def usage_bytes(self) -> int:
        """Bytes of pack files the tier holds."""
        with self._lock:
            return self._space()[0]

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into its buffer; its length, or -1 (unknown key, buffer too small, I/O error)."""
        if len(keys) != len(buffers):
            raise ValueError(f"get_into needs one buffer per key, got {len(keys)} keys and {len(buffers)} buffers")
        for key in keys:
            _check_key(key)
        views = [_byte_view(buffer) for buffer in buffers]
        if any(view.readonly for view in views):
            raise ValueError("get_into needs writable buffers")
        with self._lock:
            self._check_open()
            reads = [self._locate(key) for key in keys]
        try:
            jobs = list(zip(reads, views, strict=True))
            if len(jobs) == 1:
                return [self._read_located(jobs[0])]
            return list(self._readers.map(self._read_located, jobs))
        finally:
            with self._lock:
                for at in reads:
                    if at is not None:
                        at.pack.release()

    def extents(self, keys: Sequence[bytes]) -> list[Extent | None]:
        """Where each object lies now, for same-node readers (``read_extent``); None if absent."""
        with self._lock:
            self._check_open()
            found = [self._entries.get(key) for key in keys]
            return [
                Extent(str(self._packs[e.pack_id].path), e.offset, e.length) if e is not None else None for e in found
            ]

    def get(self, key: bytes) -> bytes | None:
        """One object as bytes (one copy, from a page-aligned buffer read with O_DIRECT)."""
        size = self.size_of([key])[0]
        if size < 0:
            return None
        buffer = mmap.mmap(-1, page_align(size))
        length = self.get_into([key], [memoryview(buffer)])[0]
        return buffer[:length] if length >= 0 else None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def size_of(self, keys: Sequence[bytes]) -> list[int]:
        with self._lock:
            return [extent.length if (extent := self._entries.get(key)) else -1 for key in keys]

    def delete(self, keys: Sequence[bytes]) -> list[Removal]:
        """Forget these keys (durably, one synced manifest write); ``FAILED`` for those present when the
        manifest refuses the write, which leaves them stored."""
        for key in keys:
            _check_key(key)
        with self._write_lock:
            with self._lock:
                self._check_open()
                present = {key for key in keys if key in self._entries}
            done = Removal.REMOVED
            if present:
                try:
                    self._forget(list(present))
                except OSError as exc:
                    log.warning("NVMe tier: deleting %d chunks failed (%s); they stay stored", len(present), exc)
                    done = Removal.FAILED
        return [done if key in present else Removal.ABSENT for key in keys]

    def keys(self) -> list[bytes]:
        """Every stored key, the first to evict first."""
        with self._lock:
            return list(self._policy)

    def usage(self) -> TierUsage:
        self.refresh_capacity()
        with self._lock:
            used, _ = self._space()
            return TierUsage(self.tier, used, self._live_length, self.capacity_bytes, len(self._entries))

    def health(self) -> TierHealth:
        """Down when its directory is gone; degraded while its last put stored less than it was given."""
        usage = self.usage()
        detail = f"{usage.chunks} chunks, {usage.bytes_used >> 20} MiB of {usage.capacity_bytes >> 20} MiB"
        if not self.directory.is_dir():
            return TierHealth(ok=False, detail=f"{self.directory} is gone; {detail}")
        if self.write_failure is not None:
            return TierHealth(ok=True, degraded=True, detail=f"the last put failed ({self.write_failure}); {detail}")
        return TierHealth(ok=True, detail=detail)

    def close(self) -> None:
        """Release files and the manifest. Reads in flight finish; later calls raise."""
        with self._write_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._readers.shutdown(wait=True)
            for pack in self._packs.values():
                pack.retire()
            self._manifest.close()

    # ---- restart ----------------------------------------------------------------------------------

    def _recover(self, records: list[tuple[bytes, bytes]], moved_to: Path | None) -> RecoveryReport:
        """Rebuild memory from the manifest, keeping only entries whose bytes are on disk, then take back the
        objects of pack files it does not reference. Nothing is deleted here but manifest entries."""
        sizes = {}
        for path in self._pack_dir.glob("*.seg"):
            if path.stem.isdigit():
                sizes[int(path.stem)] = path.stat().st_size
        self._next_pack_id = max(sizes, default=0) + 1  # ids only grow, even past deleted files
        found: dict[bytes, _Extent] = {}
        dropped: list[bytes] = []
        for key, record in records:
            try:
                extent = _Extent.unpack(record)
            except struct.error:
                dropped.append(key)
                continue
            self._next_pack_id = max(self._next_pack_id, extent.pack_id + 1)
            size = sizes.get(extent.pack_id)
            if len(key) != KEY_BYTES or size is None or extent.offset + extent.length > size:
                dropped.append(key)
            else:
                found[key] = extent
        if dropped:
            log.warning("NVMe manifest: dropped %d entries whose bytes are missing", len(dropped))
            self._manifest.write(deletes=dropped)
        for pack_id in {extent.pack_id for extent in found.values()}:
            self._packs[pack_id] = _PackFile(self._pack_dir, pack_id, page_align(sizes[pack_id]))
        rebuilt, untouched = self._rebuild(sorted(set(sizes) - set(self._packs)), found)
        # Recency does not survive a restart; creation order is the best guess of it.
        for key, extent in sorted(
            found.items(), key=lambda item: (item[1].created_ms, item[1].pack_id, item[1].offset)
        ):
            self._place(key, extent, used=False)
        if self._packs:
            newest = self._packs[max(self._packs)]
            # Keep appending to the newest pack file: restarts then leave no trail of small files.
            if newest.end < self.pack_file_bytes:
                self._active = newest
        return RecoveryReport(len(found), len(dropped), rebuilt, untouched, str(moved_to) if moved_to else None)

    def _rebuild(self, pack_ids: list[int], found: dict[bytes, _Extent]) -> tuple[int, int]:
        """Scan pack files no manifest entry names (a crash before the manifest write, a lost manifest) and
        enter their objects whose keys it lacks, a later copy winning; (objects entered, files left untouched).

        A file without one readable object is not used at all. One read whole whose objects are all known
        (what a crash between a compaction and its unlink leaves) stays, its bytes dead: compaction reclaims it.
        """
        adopted: dict[bytes, _Extent] = {}
        untouched = 0
        for pack_id in pack_ids:
            path = self._pack_dir / f"{pack_id:08d}.seg"
            try:
                scan = scan_pack_file(path)
                created_ms = path.stat().st_mtime_ns // 1_000_000
            except OSError as exc:
                raise ConfigError(
                    f"NVMe pack file {path} cannot be read to rebuild the manifest ({exc}); nothing was changed"
                ) from exc
            if not scan.objects:
                untouched += 1
                log.warning("NVMe tier: %s holds no readable chunk object; left as it is, unused", path)
                continue
            end = path.stat().st_size
            if scan.torn_at is not None:  # the tail of a write a crash cut: truncated to the last whole object
                os.truncate(path, scan.torn_at)
                log.warning("NVMe tier: %s ended inside an object at %d; truncated there", path, scan.torn_at)
                end = scan.torn_at
            self._packs[pack_id] = _PackFile(self._pack_dir, pack_id, page_align(end))
            for obj in scan.objects:
                if obj.key not in found:
                    adopted[obj.key] = _Extent(pack_id, obj.offset, obj.length, created_ms)
        if adopted:
            self._manifest.write(puts=[(key, extent.pack()) for key, extent in adopted.items()])
            log.warning(
                "NVMe tier: %d chunk objects found in %d pack files the manifest did not name: entered",
                len(adopted),
                len(pack_ids) - untouched,
            )
        found.update(adopted)
        return len(adopted), untouched

    # ---- space ------------------------------------------------------------------------------------

    def _admit(self, objects: dict[bytes, memoryview], pins: _PinAnswers) -> list[bytes]:
        """Make room for the batch and return the keys that will be written (all, unless space runs out)."""
        padded = {key: page_align(view.nbytes) for key, view in objects.items()}
        sizes = {key: size for key, size in padded.items() if size <= self._write_budget}
        if not sizes:  # nothing would fit in an empty tier: evict nothing for it
            return []
        if self._make_room(sum(sizes.values()), set(objects), pins):
            return list(sizes)
        # Everything evictable is gone: keep, in the order given, what fits beside the pinned chunks.
        with self._lock:
            room = self._write_budget - self._space()[1]
        admitted = []
        for key, size in sizes.items():
            if size <= room:
                admitted.append(key)
                room -= size
        fits = self._make_room(sum(sizes[key] for key in admitted), set(objects), pins)
        return admitted if fits else []

    def _make_room(self, need: int, protected: set[bytes], pins: _PinAnswers) -> bool:
        """Evict and compact until ``need`` more bytes fit in the write budget; False if they cannot.

        Compaction runs only where it copies no more than it frees (a pack file at least half dead);
        otherwise evicting more cold chunks is cheaper than rewriting live ones, which under scattered
        access would double the bytes written. It copies more only when nothing is left to evict.
        """
        while True:
            with self._lock:
                used, live = self._space()
                victim = self._compaction_victim(used)
            overflow = used + need - self._write_budget
            if overflow <= 0:
                return True
            if live + need > self._write_budget:
                progress = self._evict(live + need - self._write_budget, protected, pins)
            elif victim is not None and victim.dead >= victim.live:
                progress = self._compact(victim)
            else:
                progress = self._evict(overflow, protected, pins) or (victim is not None and self._compact(victim))
            if not progress:
                return False

    def _space(self) -> tuple[int, int]:
        """(bytes of pack files, padded bytes of live objects); call under the lock."""
        packs = self._packs.values()
        return sum(pack.end for pack in packs), sum(pack.live for pack in packs)

    def _compaction_victim(self, used: int) -> _PackFile | None:
        """The pack file with the most dead bytes among those whose live objects can be copied within capacity."""
        candidates = [s for s in self._packs.values() if s.dead > 0 and used + s.live <= self.capacity_bytes]
        return max(candidates, key=lambda pack: pack.dead, default=None)

    def _evict(self, amount: int, protected: set[bytes], pins: _PinAnswers) -> bool:
        """Drop least-recently-used unpinned chunks totalling ``amount`` padded bytes; False if none could go.
        It stops at the first keys whose pins ``pins`` does not know, leaving them in ``pins.wanted``."""
        victims: list[bytes] = []
        skipped = set(protected)
        freed = 0
        while freed < amount:
            with self._lock:
                candidates = [(key, self._entries[key].padded) for key in self._unskipped(skipped)]
            if not candidates:
                break
            if unknown := [key for key, _ in candidates if key not in pins.known]:
                pins.wanted = unknown
                break
            for key, padded in candidates:
                pin = pins.known[key]
                skipped.add(key)
                if not pin and freed < amount:
                    victims.append(key)
                    freed += padded
        if victims:
            self._drop(victims)
        return bool(victims)

    def _unskipped(self, skipped: set[bytes]) -> list[bytes]:
        """The next keys in eviction order not yet examined."""
        return self._policy.coldest(skipped, _PIN_QUERY_KEYS)

    def _compact(self, pack: _PackFile) -> bool:
        """Copy the pack file's live objects to the active pack file (put's durability order), then delete it."""
        with self._lock:
            if pack is self._active:
                self._seal_active()
            extents = sorted(((key, self._entries[key]) for key in pack.keys), key=lambda item: item[1].offset)
            fd = pack.acquire(self._open_reader)
        try:
            copied = all(self._copy(fd, group) for group in _batches(extents, _COMPACTION_BATCH_BYTES))
        finally:
            with self._lock:
                pack.release()
        self._delete_empty([pack])  # its copies replaced it, or it had no live object
        return copied

    # ---- writes -----------------------------------------------------------------------------------

    def _append(self, objects: list[tuple[bytes, memoryview, int]], *, touch: bool) -> set[bytes]:
        """Write objects to the active pack file(s), sync, then record them in the manifest and in memory;
        raises ``OSError`` when the disk or the manifest fails, with none of them stored."""
        if not objects:
            return set()
        runs: dict[_PackFile, list[tuple[bytes, memoryview, _Extent]]] = {}
        with self._lock:
            for key, view, created_ms in objects:
                padded = page_align(view.nbytes)
                pack = self._active
                if pack is None or (pack.end and pack.end + padded > self.pack_file_bytes):
                    pack = self._roll()
                extent = _Extent(pack.id, pack.end, view.nbytes, created_ms)
                runs.setdefault(pack, []).append((key, view, extent))
                pack.end += padded
        placed = [(key, extent) for run in runs.values() for key, _, extent in run]
        try:
            self._write_runs(runs)
            self._manifest.write(puts=[(key, extent.pack()) for key, extent in placed])
        except OSError:  # nothing of the batch is stored
            with self._lock:
                self._seal_active()  # the next put starts a fresh file after whatever this one left
                self._close_sealed_writers(runs)
            self._delete_empty(runs)
            raise
        with self._lock:
            emptied = [old for key, extent in placed if (old := self._place(key, extent, used=touch)) is not None]
            self._close_sealed_writers(runs)
        self._delete_empty(emptied)
        return {key for key, _ in placed}

    def _write_runs(self, runs: dict[_PackFile, list[tuple[bytes, memoryview, _Extent]]]) -> None:
        """One pwritev (plus padding) and one fdatasync per pack file; the page cache copy is then dropped,
        since reads bypass it with O_DIRECT and it would only crowd out the DRAM tier."""
        created = False
        for pack, run in runs.items():
            created |= not pack.path.exists()
            fd = pack.writer()
            start = run[0][2].offset
            views: list[memoryview] = []
            for _, view, extent in run:
                views.append(view)
                if extent.padded > extent.length:
                    views.append(_ZEROS[: extent.padded - extent.length])
            _pwrite_all(fd, views, start)
            os.fdatasync(fd)
            os.posix_fadvise(fd, start, run[-1][2].offset + run[-1][2].padded - start, os.POSIX_FADV_DONTNEED)
        if created:
            _fsync_dir(self._pack_dir)

    def _copy(self, fd: int, group: list[tuple[bytes, _Extent]]) -> bool:
        """Compaction step: read a group of live objects into one aligned buffer and append them."""
        buffer = memoryview(mmap.mmap(-1, sum(extent.padded for _, extent in group)))
        objects, lost, position = [], [], 0
        for key, extent in group:
            view = buffer[position : position + extent.padded]
            position += extent.padded
            if self._read(fd, extent, view) == extent.length:
                objects.append((key, view[: extent.length], extent.created_ms))
            else:
                lost.append(key)
        if lost:
            self._drop(lost)
        return len(self._append(objects, touch=False)) == len(objects)

    # ---- removal ----------------------------------------------------------------------------------

    def _drop(self, keys: list[bytes]) -> None:
        """Evict: forget the keys and tell the daemon, whose index must stop pointing here."""
        self._forget(keys)
        try:
            self._on_evict(keys)
        except Exception:
            log.exception("NVMe tier: on_evict failed for %d keys", len(keys))

    def _forget(self, keys: list[bytes]) -> None:
        """Manifest first (synced), then memory, then the pack files left without live objects."""
        self._manifest.write(deletes=keys)
        with self._lock:
            emptied = [self._unlink(key) for key in keys]
            for key in keys:
                self._policy.forgotten(key)
        self._delete_empty(emptied)

    def _delete_empty(self, candidates: Iterable[_PackFile]) -> None:
        with self._lock:
            empty = [s for s in set(candidates) if not s.keys and self._packs.get(s.id) is s]
            for pack in empty:
                del self._packs[pack.id]
                if pack is self._active:
                    self._active = None
                pack.retire()
        for pack in empty:
            pack.path.unlink(missing_ok=True)

    # ---- in-memory state (call under the lock) ----------------------------------------------------

    def _place(self, key: bytes, extent: _Extent, *, used: bool) -> _PackFile | None:
        """Point key at extent (``used``: a caller's write, which the policy counts as a use); the pack file of
        the copy it replaces, if any."""
        old = self._unlink(key) if key in self._entries else None
        self._entries[key] = extent
        self._policy.stored(key, used=used)
        pack = self._packs[extent.pack_id]
        pack.keys.add(key)
        pack.live += extent.padded
        self._live_length += extent.length
        return old

    def _unlink(self, key: bytes) -> _PackFile:
        extent = self._entries.pop(key)
        pack = self._packs[extent.pack_id]
        pack.keys.discard(key)
        pack.live -= extent.padded
        self._live_length -= extent.length
        return pack

    def _roll(self) -> _PackFile:
        """Start a new pack file. The previous one's writer stays open until its batch is synced."""
        pack = _PackFile(self._pack_dir, self._next_pack_id, 0)
        self._next_pack_id += 1
        self._packs[pack.id] = pack
        self._active = pack
        return pack

    def _close_sealed_writers(self, packs: Iterable[_PackFile]) -> None:
        """After a batch is synced: its pack files that are no longer active will never be written again."""
        for pack in packs:
            if pack is not self._active:
                pack.close_writer()

    def _seal_active(self) -> None:
        if self._active is not None:
            self._active.close_writer()
            self._active = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NVMe tier at {self.directory} is closed")

    # ---- reads ------------------------------------------------------------------------------------

    def _locate(self, key: bytes) -> _Located | None:
        """Under the lock: the object's pack file (referenced until released), a read descriptor, its extent."""
        extent = self._entries.get(key)
        if extent is None:
            return None
        pack = self._packs[extent.pack_id]
        try:
            fd = pack.acquire(self._open_reader)
        except OSError:
            log.exception("NVMe tier: cannot open %s", pack.path)
            return None
        self._policy.used(key)
        return _Located(pack, fd, extent)

    def _open_reader(self, path: Path) -> int:
        if self._direct:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct = False
                log.warning("%s rejects O_DIRECT; the NVMe tier reads through the page cache", path.parent)
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def _read_located(self, job: tuple[_Located | None, memoryview]) -> int:
        at, view = job
        return self._read(at.fd, at.extent, view) if at else -1

    def _read(self, fd: int, extent: _Extent, view: memoryview) -> int:
        """One preadv of the padded extent: into the caller's buffer when O_DIRECT can use it, else bounced."""
        if view.nbytes < extent.length:
            return -1
        try:
            if view.nbytes >= extent.padded and page_aligned(view):
                got = os.preadv(fd, [view[: extent.padded]], extent.offset)
            else:
                with self._scratch_lock:
                    scratch = self._scratch.view(extent.padded)
                    got = os.preadv(fd, [scratch], extent.offset)
                    if got >= extent.length:
                        view[: extent.length] = scratch[: extent.length]
        except OSError:
            log.exception("NVMe tier: reading %d bytes of pack file %d failed", extent.length, extent.pack_id)
            return -1
        return extent.length if got >= extent.length else -1
