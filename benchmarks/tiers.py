"""Tier throughput, DRAM, NVMe and object, each against the ceiling of what lies under it, in one run.

For 1 MiB and 8 MiB chunks:

* DRAM tier: this process attaches (``setup_dummy``) to a segment owner of its own (a 1 GiB segment,
  warmed first as the daemon does: first-touch faults slow fresh shared memory) and moves
  objects built in arena slots (the zero-copy path clients use), 128 MiB per ``put``/``get_into``
  call, 512 MiB of fresh keys per round, deleted before the next. Anchor: numpy copies of chunk-sized
  slices of a 512 MiB array into another (so nothing is cache-resident), as many bytes.
* NVMe tier: ``NvmeTier.put`` of 1 GiB in 128 MiB batches (durable: each includes its fdatasync and
  synced manifest write), then, with the segments dropped from the page cache, ``get_into`` arena
  slots (page-aligned, so O_DIRECT reads land in them directly, as promotion does), 128 MiB per call.
  Anchor: plain O_DIRECT sequential reads of a 1 GiB file on the same disk, in chunk-sized requests,
  into the same slots (the destination buffers alone change how fast raw reads move, so the anchor
  must not use others).
* Object tier: a real S3 server on loopback (SeaweedFS's ``weed mini``, tests/s3_server.py), ``ObjectTier.put`` of
  ``OBJECT_ROUND`` bytes (sealed), then ``get_into`` arena slots, ``OBJECT_BATCH`` per call. Anchor: raw GETs of
  the same (sealed) objects with the same client (obstore, a store configured as the tier's), as many in flight
  as the tier's lanes, each copied into the same slots: what the tier adds is opening the seal and its dispatch.
  Then the latency of one chunk's get at a time, through the tier and raw, alternately (median and worst of
  ``LATENCY_GETS``).
* Verification and sealing: what every load computes over each chunk it reads, the MAC (keyed BLAKE3,
  cachestore/chunks/mac.py), beside xxh3-64 (the unkeyed checksum it replaced), memcpy, and the object tier's
  AEAD (AES-256-GCM seal and open, cachestore/chunks/seal.py), each over the chunks a DRAM get just filled, one
  chunk at a time on one thread, as a loader's check thread does; and the MAC on every core, as publishes sign.

Each get call is paired with its anchor on the same number of bytes, the two run back to back in
alternating order, so both see the same machine: a virtual disk's speed can swing by a factor of two
for tens of seconds at a time. Figures are medians of ``ROUNDS`` rounds, ratios medians of the per-round
ratios. Targets (8 MiB): DRAM get >= 0.5 x memcpy, NVMe get >= 0.7 x O_DIRECT, object get >= 0.8 x raw GET.
Run: ``python -m benchmarks.tiers`` (works under ``.bench-tmp/``, deleted afterwards).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from benchmarks.common import print_table, write_results
from prefixcache.cachestore.chunks.mac import KEY_BYTES, ChunkMacKey
from prefixcache.cachestore.chunks.seal import ChunkSealer
from prefixcache.cachestore.tiers.dram import MooncakeTier
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.tiers.object_store import LANES, ObjectStoreAddress, ObjectTier
from prefixcache.cachestore.tiers.tier import Removal, StorageTier
from tests.mooncake_pool import LocalMooncakePool
from tests.s3_server import SeaweedS3

ROOT = Path(__file__).resolve().parent.parent / ".bench-tmp"
CHUNK_SIZES = (1 << 20, 8 << 20)
BATCH = 128 << 20  # bytes per put / get_into call
DRAM_ROUND = 512 << 20  # bytes put and read back per DRAM round (half the segment)
NVME_ROUND = 1 << 30  # bytes put and read back per NVMe round
SEGMENT = 1 << 30
WARM_FRACTION = 0.8
OBJECT_ROUND = 128 << 20  # bytes put and read back per object round
OBJECT_BATCH = 64 << 20  # bytes per object get_into call
LATENCY_GETS = 30  # one-chunk gets timed per object round, through the tier and raw each
ROUNDS = 5
TARGETS = {"dram_get_over_memcpy": 0.5, "nvme_get_over_odirect": 0.7, "object_get_over_raw": 0.8}  # at 8 MiB

_keys_made = 0


def fresh_keys(n: int) -> list[bytes]:
    """Keys never used before in this run (16 bytes, as the store's chunk keys)."""
    global _keys_made
    _keys_made += n
    return [i.to_bytes(16, "big") for i in range(_keys_made - n, _keys_made)]


def gbps(nbytes: int, fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - start) / 1e9


def interleaved(n: int, tier: Callable[[int], None], anchor: Callable[[int], None]) -> tuple[float, float]:
    """Seconds spent in ``tier(i)`` and in ``anchor(i)`` for i < n, run in pairs, alternately first: the
    two then see the same machine (a virtual disk's speed can swing for tens of seconds)."""
    spent = [0.0, 0.0]
    for i in range(n):
        for which in (0, 1) if i % 2 == 0 else (1, 0):
            start = time.perf_counter()
            (tier, anchor)[which](i)
            spent[which] += time.perf_counter() - start
    return spent[0], spent[1]


def putting(tier: StorageTier, batches: list[list[bytes]], sources: list[memoryview], what: str) -> Callable[[], None]:
    """What puts every batch of keys, with ``sources`` as their objects, into ``tier``."""

    def put() -> None:
        for keys in batches:
            assert all(tier.put(list(zip(keys, sources, strict=True)))), f"{what} put failed"

    return put


def getting(tier: StorageTier, batches: list[list[bytes]], dests: list[memoryview], what: str) -> Callable[[int], None]:
    """What reads batch ``i`` of keys from ``tier`` into ``dests`` (every object the size of a slot)."""

    def get(i: int) -> None:
        assert tier.get_into(batches[i], dests) == [len(dests[0])] * len(batches[i]), f"{what} get missed"

    return get


def delete_all(tier: StorageTier, batches: list[list[bytes]]) -> None:
    """Delete every key of ``batches`` from ``tier``, each of them there."""
    keys = [k for batch in batches for k in batch]
    assert tier.delete(keys) == [Removal.REMOVED] * len(keys), "delete failed"


def drop_cache(path: Path) -> None:
    """Evict a file's pages, so that reads below come from the disk (fdatasync first: dirty pages stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_segment(tier: MooncakeTier, slot: memoryview) -> None:
    """What the daemon does at start: fill ~80% of the segment once with throwaway objects, delete them."""
    keys = fresh_keys(int(SEGMENT * WARM_FRACTION) // len(slot))
    per_call = BATCH // len(slot)
    for first in range(0, len(keys), per_call):
        assert all(tier.put([(k, slot) for k in keys[first : first + per_call]])), "warm-up put failed"
    assert tier.delete(keys) == [Removal.REMOVED] * len(keys)


@contextlib.contextmanager
def warmed_tier(work: Path, arena_bytes: int) -> Iterator[MooncakeTier]:
    """A DRAM tier attached to a segment owner of its own (``SEGMENT`` bytes, under ``work``), warmed as the
    daemon warms it (``warm_segment``); closed and stopped afterwards."""
    pool = LocalMooncakePool(work / "mooncake", segment_bytes=SEGMENT)
    try:
        tier = MooncakeTier(
            pool.owner.shm_address,
            arena_bytes=arena_bytes,
            preferred_segment=pool.owner.segment,
            metrics_url=pool.metrics_url,
        )
        try:
            warm = tier.arena.alloc(8 << 20)
            warm_segment(tier, warm)
            tier.arena.free(warm)
            yield tier
        finally:
            tier.close()
    finally:
        pool.stop()


def dram_round(
    tier: MooncakeTier, sources: list[memoryview], dests: list[memoryview], src: np.ndarray, dst: np.ndarray
) -> dict[str, float]:
    """Put DRAM_ROUND bytes from arena slots, read them back into arena slots, each batch paired with a
    memcpy of as many bytes in chunk-sized slices (``src``/``dst``: DRAM_ROUND bytes each), delete."""
    chunk, per_call = len(sources[0]), len(sources)
    batches = [fresh_keys(per_call) for _ in range(DRAM_ROUND // BATCH)]

    def memcpy(i: int) -> None:
        for start in range(i * BATCH, (i + 1) * BATCH, chunk):
            np.copyto(dst[start : start + chunk], src[start : start + chunk])

    put_gbps = gbps(DRAM_ROUND, putting(tier, batches, sources, "DRAM"))
    get_s, memcpy_s = interleaved(len(batches), getting(tier, batches, dests, "DRAM"), memcpy)
    assert dests[-1] == sources[-1]
    delete_all(tier, batches)
    return {
        "dram_put_gbps": put_gbps,
        "dram_get_gbps": DRAM_ROUND / get_s / 1e9,
        "memcpy_gbps": DRAM_ROUND / memcpy_s / 1e9,
    }


def verification_round(views: list[memoryview], src: np.ndarray, dst: np.ndarray) -> dict[str, float]:
    """GB/s of the MAC (keyed BLAKE3) on one thread, as chunks are verified, and on every core, as they are signed;
    of xxh3-64, of memcpy, and of the object tier's seal and open (AES-256-GCM) over the bytes of ``views``, chunk
    by chunk."""
    mac_key = ChunkMacKey(os.urandom(KEY_BYTES))
    sealer = ChunkSealer(mac_key)
    nbytes, chunk = sum(len(v) for v in views), len(views[0])
    sealed = [sealer.seal(str(i), view) for i, view in enumerate(views)]

    def mac(parallel: bool = False) -> None:
        for view in views:
            hasher = mac_key.hasher(parallel=parallel)
            hasher.update(view)
            hasher.digest()

    def xxh3() -> None:
        for view in views:
            xxhash.xxh3_64_intdigest(view)

    def memcpy() -> None:
        for start in range(0, nbytes, chunk):
            np.copyto(dst[start : start + chunk], src[start : start + chunk])

    def seal() -> None:
        for i, view in enumerate(views):
            sealer.seal(str(i), view)

    def unseal() -> None:  # into a buffer, as the tier opens an object into its caller's slot
        for i, data in enumerate(sealed):
            sealer.open_into(str(i), data, dst.data[i * chunk : (i + 1) * chunk])

    return {
        "mac_gbps": gbps(nbytes, mac),
        "mac_parallel_gbps": gbps(nbytes, functools.partial(mac, parallel=True)),
        "xxh3_gbps": gbps(nbytes, xxh3),
        "mac_memcpy_gbps": gbps(nbytes, memcpy),
        "seal_gbps": gbps(nbytes, seal),
        "open_gbps": gbps(nbytes, unseal),
    }


def nvme_round(store: NvmeTier, sources: list[memoryview], dests: list[memoryview], anchor: Path) -> dict[str, float]:
    """Put NVME_ROUND bytes (durably), drop the page cache, read them back, each batch paired with plain
    O_DIRECT sequential reads of as many bytes of ``anchor`` (a file of NVME_ROUND bytes) in chunk-sized
    requests, delete."""
    chunk, per_call = len(sources[0]), len(sources)
    batches = [fresh_keys(per_call) for _ in range(NVME_ROUND // BATCH)]

    def odirect(i: int) -> None:  # into the very buffers get_into fills: the buffers can change the speed
        for j, buffer in enumerate(dests):
            assert os.preadv(fd, [buffer], i * BATCH + j * chunk) == chunk

    put_gbps = gbps(NVME_ROUND, putting(store, batches, sources, "NVMe"))
    for path in [anchor, *(store.directory / "segments").glob("*.seg")]:
        drop_cache(path)
    fd = os.open(anchor, os.O_RDONLY | os.O_DIRECT)
    try:
        get_s, odirect_s = interleaved(len(batches), getting(store, batches, dests, "NVMe"), odirect)
    finally:
        os.close(fd)
    assert dests[-1] == sources[-1]
    delete_all(store, batches)
    return {
        "nvme_put_gbps": put_gbps,
        "nvme_get_gbps": NVME_ROUND / get_s / 1e9,
        "odirect_read_gbps": NVME_ROUND / odirect_s / 1e9,
    }


@contextlib.contextmanager
def object_tier(work: Path) -> Iterator[ObjectTier]:
    """An object tier on a SeaweedFS S3 server of its own (under ``work``), with a fresh cluster key; its
    credentials reach the client through the environment, as the AWS chain reads them."""
    server = SeaweedS3(work / "s3")
    server.start()
    try:
        os.environ.update(server.credentials())
        address = ObjectStoreAddress.parse(
            "s3://bench/tiers", endpoint=server.endpoint, region="us-east-1", path_style=True
        )
        tier = ObjectTier(address, ChunkSealer(ChunkMacKey(os.urandom(KEY_BYTES))), read_deadline_s=600)
        try:
            yield tier
        finally:
            tier.close()
    finally:
        server.stop()


def object_round(bucket: ObjectTier, sources: list[memoryview], dests: list[memoryview]) -> dict[str, float]:
    """Put OBJECT_ROUND bytes through the tier (sealed), read them back through it, each call paired with raw
    GETs of the same objects by the same client into the same slots, ``LANES`` in flight; then one chunk's get
    at a time, through the tier and raw, alternately; delete."""
    import obstore

    chunk = len(sources[0])
    per_call = OBJECT_BATCH // chunk
    batches = [fresh_keys(per_call) for _ in range(OBJECT_ROUND // OBJECT_BATCH)]
    raw_store = bucket.address.open(request_timeout_s=600)
    sources, slots = sources[:per_call], dests[:per_call]

    def raw_get(key: bytes, slot: memoryview) -> int:
        data = obstore.get(raw_store, bucket.address.name_of(key)).bytes()
        view = memoryview(slot).cast("B")
        view[: len(data)] = memoryview(data)[: len(view)]
        return len(data)

    def raw(i: int) -> None:
        assert all(size > 0 for size in lanes.map(raw_get, batches[i], slots)), "raw GET failed"

    with ThreadPoolExecutor(LANES) as lanes:
        put_gbps = gbps(OBJECT_ROUND, putting(bucket, batches, sources, "object"))
        get_s, raw_s = interleaved(len(batches), getting(bucket, batches, slots, "object"), raw)
        assert slots[-1] == sources[-1]
        one: tuple[list[float], list[float]] = ([], [])  # seconds of one chunk's get: through the tier, raw
        for i in range(LATENCY_GETS):
            key = batches[0][i % per_call]
            for which in (0, 1) if i % 2 == 0 else (1, 0):
                start = time.perf_counter()
                if which == 0:
                    assert bucket.get_into([key], slots[:1]) == [chunk], "object get missed"
                else:
                    raw_get(key, slots[0])
                one[which].append(time.perf_counter() - start)
    delete_all(bucket, batches)
    return {
        "object_put_gbps": put_gbps,
        "object_get_gbps": OBJECT_ROUND / get_s / 1e9,
        "object_raw_get_gbps": OBJECT_ROUND / raw_s / 1e9,
        "object_get_p50_ms": 1e3 * statistics.median(one[0]),
        "object_get_max_ms": 1e3 * max(one[0]),
        "object_raw_get_p50_ms": 1e3 * statistics.median(one[1]),
        "object_raw_get_max_ms": 1e3 * max(one[1]),
    }


def measure(
    chunk: int, work: Path, tier: MooncakeTier, bucket: ObjectTier, anchor: Path, src: np.ndarray, dst: np.ndarray
) -> dict:
    per_call = BATCH // chunk
    sources = [tier.arena.alloc(chunk) for _ in range(per_call)]
    dests = [tier.arena.alloc(chunk) for _ in range(per_call)]
    store = NvmeTier(work / f"nvme-{chunk >> 20}m", 4 * NVME_ROUND)
    try:
        for i, slot in enumerate(sources):
            slot[:] = src.data[i * chunk : (i + 1) * chunk]
        samples = []
        for _ in range(ROUNDS):
            sample = {
                **dram_round(tier, sources, dests, src, dst),
                **verification_round(dests, src, dst),
                **nvme_round(store, sources, dests, anchor),
                **object_round(bucket, sources, dests),
            }
            sample["dram_get_over_memcpy"] = sample["dram_get_gbps"] / sample["memcpy_gbps"]
            sample["mac_over_memcpy"] = sample["mac_gbps"] / sample["mac_memcpy_gbps"]
            sample["mac_over_xxh3"] = sample["mac_gbps"] / sample["xxh3_gbps"]
            sample["mac_parallel_over_mac"] = sample["mac_parallel_gbps"] / sample["mac_gbps"]
            sample["nvme_get_over_odirect"] = sample["nvme_get_gbps"] / sample["odirect_read_gbps"]
            sample["object_get_over_raw"] = sample["object_get_gbps"] / sample["object_raw_get_gbps"]
            sample["seal_over_mac"] = sample["seal_gbps"] / sample["mac_gbps"]
            sample["open_over_mac"] = sample["open_gbps"] / sample["mac_gbps"]
            samples.append(sample)
        return {name: statistics.median(s[name] for s in samples) for name in samples[0]}
    finally:
        store.close()
        for slot in sources + dests:
            tier.arena.free(slot)


def main() -> None:
    ROOT.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiers-", dir=ROOT))
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, DRAM_ROUND, dtype=np.uint8)  # incompressible, in case the disk compresses
    dst = np.ones_like(src)  # touched now, not while timed
    results: dict[str, list] = {"chunk_mib": [size >> 20 for size in CHUNK_SIZES]}
    try:
        anchor = work / "anchor.bin"
        with anchor.open("wb") as f:
            for _ in range(NVME_ROUND // len(src)):
                f.write(src.data)
        with warmed_tier(work, arena_bytes=2 * BATCH) as tier, object_tier(work) as bucket:
            for chunk in CHUNK_SIZES:
                for name, value in measure(chunk, work, tier, bucket, anchor, src, dst).items():
                    results.setdefault(name, []).append(value)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with contextlib.suppress(OSError):  # left alone while anything else works in it
            ROOT.rmdir()
    columns = [name for name in results if name != "chunk_mib"]
    rows = [[f"{mib} MiB", *(results[name][i] for name in columns)] for i, mib in enumerate(results["chunk_mib"])]
    print_table(
        f"Tier throughput, GB/s, median of {ROUNDS} rounds (ratios: median of per-round ratios)",
        ["chunk", *(name.removesuffix("_gbps") for name in columns)],
        rows,
    )
    path = write_results("tiers", results)
    print(f"wrote {path}")
    at_8m = results["chunk_mib"].index(8)
    for name, target in TARGETS.items():
        value = results[name][at_8m]
        print(f"8 MiB {name} = {value:.2f} (target >= {target}): {'met' if value >= target else 'MISSED'}")


if __name__ == "__main__":
    main()
