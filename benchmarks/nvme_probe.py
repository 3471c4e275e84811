"""NVMe tier throughput against what the disk itself reads with O_DIRECT, measured in the same run.

For 1 MiB and 8 MiB objects: ``NvmeStore.put`` 1 GiB in 64 MiB batches, drop the segments from the
page cache, then ``get_into`` everything into page-aligned buffers, 64 MiB per call, in write order.
The anchor is a plain O_DIRECT sequential read of a 1 GiB file on the same disk, with reads of the
object's size and of 8 MiB, alternated with the store's reads. Target: get >= 0.7 x O_DIRECT for
8 MiB objects.
Run: ``python -m benchmarks.nvme_probe`` (works under ``.bench-tmp/``, deleted afterwards).
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.common import print_table
from cachestore.nvme import NvmeStore

ROOT = Path(__file__).resolve().parent.parent / ".bench-tmp"
TOTAL = 1 << 30
BATCH = 64 << 20
OBJECT_SIZES = (1 << 20, 8 << 20)
ROUNDS = 5


def drop_cache(path: Path) -> None:
    """Evict a file's pages, so that reads below come from the disk (fdatasync first: dirty pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_direct_gbps(path: Path, read_size: int) -> float:
    """Sequential O_DIRECT reads of the whole file, one read_size request at a time."""
    drop_cache(path)
    buffer = mmap.mmap(-1, read_size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start, offset = time.perf_counter(), 0
        while got := os.preadv(fd, [buffer], offset):
            offset += got
        return offset / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def write_anchor_file(path: Path, data: memoryview) -> None:
    with path.open("wb") as f:
        for _ in range(TOTAL // len(data)):
            f.write(data)


def put_all(store: NvmeStore, keys: list[bytes], data: memoryview, object_size: int) -> float:
    """Write every key in 64 MiB batches; GB/s including the fdatasync and manifest write of each batch."""
    per_batch = BATCH // object_size
    objects = [data[i * object_size : (i + 1) * object_size] for i in range(per_batch)]
    start = time.perf_counter()
    for first in range(0, len(keys), per_batch):
        assert all(store.put(list(zip(keys[first : first + per_batch], objects, strict=False))))
    return len(keys) * object_size / (time.perf_counter() - start) / 1e9


def get_all(store: NvmeStore, keys: list[bytes], object_size: int) -> float:
    """Read every key back, cold, 64 MiB per get_into call, into page-aligned buffers; GB/s."""
    for segment in (store.directory / "segments").glob("*.seg"):
        drop_cache(segment)
    buffers = [memoryview(mmap.mmap(-1, object_size)) for _ in range(BATCH // object_size)]
    start = time.perf_counter()
    for first in range(0, len(keys), len(buffers)):
        assert store.get_into(keys[first : first + len(buffers)], buffers) == [object_size] * len(buffers)
    return len(keys) * object_size / (time.perf_counter() - start) / 1e9


def main() -> None:
    """Alternate raw and store reads, ratios per round, medians: a shared or virtual disk drifts by tens of percent."""
    ROOT.mkdir(exist_ok=True)
    data = memoryview(os.urandom(BATCH))  # incompressible, in case the disk or hypervisor compresses
    rows = []
    try:
        anchor = ROOT / "anchor.bin"
        write_anchor_file(anchor, data)
        for size in OBJECT_SIZES:
            store = NvmeStore(ROOT / f"store-{size >> 20}m", 4 * TOTAL)
            keys = [i.to_bytes(16, "big") for i in range(TOTAL // size)]
            put_gbps = put_all(store, keys, data, size)
            samples = []
            for _ in range(ROUNDS):
                direct = raw_direct_gbps(anchor, size)
                get_gbps = get_all(store, keys, size)
                direct_8m = raw_direct_gbps(anchor, 8 << 20)
                samples.append((get_gbps, direct, get_gbps / direct, direct_8m, get_gbps / direct_8m))
            store.close()
            rows.append((f"{size >> 20} MiB", put_gbps, *(statistics.median(c) for c in zip(*samples, strict=True))))
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)
    columns = [
        "object",
        "put GB/s",
        "get GB/s",
        "O_DIRECT GB/s (same size)",
        "get/O_DIRECT",
        "O_DIRECT 8 MiB",
        "get/8 MiB",
    ]
    print_table(f"NvmeStore vs raw O_DIRECT, 1 GiB, median of {ROUNDS} alternating rounds", columns, rows)


if __name__ == "__main__":
    main()
