"""The NVMe tier against real files and a real RocksDB manifest: round trips, crashes, capacity, compaction."""

from __future__ import annotations

import mmap
import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prefixcache.cachestore.tiers.nvme import PAGE, NvmeTier
from prefixcache.cachestore.tiers.tier import Removal
from prefixcache.indexer.errors import ConfigError

SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def index_of(k: bytes) -> int:
    return int.from_bytes(k, "big")


def payload(i: int, size: int) -> bytes:
    """Deterministic bytes per key, so another process (or thread) can check what it reads."""
    return random.Random(i).randbytes(size)


def aligned(size: int) -> memoryview:
    return memoryview(mmap.mmap(-1, size))


def pack_files(directory: Path) -> list[Path]:
    return sorted((directory / "segments").glob("*.seg"))


def test_round_trip_of_odd_sizes_through_every_buffer_kind(tmp_path: Path) -> None:
    store = NvmeTier(tmp_path, 16 << 20, pack_file_bytes=4 << 20)
    objects = {key(i): payload(i, size) for i, size in enumerate(SIZES)}
    assert store.put(list(objects.items())) == [True] * len(SIZES)
    keys = list(objects)

    padded = [aligned(-(-len(v) // PAGE) * PAGE) for v in objects.values()]  # direct into the caller's buffer
    exact = [aligned(len(v)) for v in objects.values()]  # aligned but short of the padding: bounced
    unaligned = [memoryview(bytearray(len(v) + 1))[1:] for v in objects.values()]  # bounced
    for buffers in (padded, exact, unaligned):
        assert store.get_into(keys, buffers) == [len(v) for v in objects.values()]
        for buffer, value in zip(buffers, objects.values(), strict=True):
            assert bytes(buffer[: len(value)]) == value
    for k, value in objects.items():
        assert store.get(k) == value

    assert store.get_into([key(99), keys[1]], [aligned(PAGE), aligned(PAGE)]) == [-1, 4095]
    assert store.get_into([keys[3]], [aligned(PAGE)]) == [-1]  # 4097 bytes do not fit
    assert store.get(key(99)) is None
    usage = store.usage()
    assert (usage.tier, usage.chunks, usage.live_bytes) == ("nvme", len(SIZES), sum(SIZES))
    assert usage.bytes_used == sum(os.path.getsize(p) for p in pack_files(tmp_path))
    store.close()


def test_objects_survive_sigkill_right_after_put(tmp_path: Path) -> None:
    script = f"""
import os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
from prefixcache.cachestore.tiers.nvme import NvmeTier
from test_nvme import SIZES, key, payload
store = NvmeTier(Path({str(tmp_path)!r}), 16 << 20, pack_file_bytes=4 << 20)
assert store.put([(key(i), payload(i, size)) for i, size in enumerate(SIZES)]) == [True] * len(SIZES)
assert store.put([(key(100), payload(100, 5000))]) == [True]
os.kill(os.getpid(), 9)
"""
    child = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()

    store = NvmeTier(tmp_path, 16 << 20, pack_file_bytes=4 << 20)
    assert store.recovery.chunks == len(SIZES) + 1
    for i, size in [*enumerate(SIZES), (100, 5000)]:
        assert store.get(key(i)) == payload(i, size)
    store.close()


def test_reopen_drops_entries_whose_bytes_are_gone(tmp_path: Path) -> None:
    """What a crash between pack file write and manifest write, or a lost file, leaves behind."""
    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert all(store.put([(key(i), payload(i, 20000)) for i in range(9)]))  # three per 64 KiB pack file
    store.close()
    first, second, third = pack_files(tmp_path)
    with first.open("ab") as f:
        f.write(b"unreferenced bytes of a put that never reached the manifest")
    os.truncate(second, 20480 + 100)  # keeps key 3, cuts keys 4 and 5
    third.unlink()  # keys 6, 7 and 8
    orphan = tmp_path / "segments" / "00000042.seg"
    orphan.write_bytes(b"x" * 8192)

    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert (store.recovery.chunks, store.recovery.dropped_entries, store.recovery.untouched_pack_files) == (4, 5, 1)
    assert orphan.read_bytes() == b"x" * 8192  # no chunk object in it: left as it was, never deleted at open
    assert store.contains([key(i) for i in range(9)]) == [True] * 4 + [False] * 5
    assert all(store.get(key(i)) == payload(i, 20000) for i in range(4))
    assert store.put([(key(50), payload(50, 3000))]) == [True]  # appends after the garbage
    store.close()

    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert (store.recovery.chunks, store.recovery.dropped_entries) == (5, 0)  # the drop was durable
    assert store.get(key(50)) == payload(50, 3000)
    assert store.keys()[-1] == key(50)  # recency after a restart follows creation order
    store.close()


def test_fill_to_three_times_capacity(tmp_path: Path) -> None:
    capacity = 256 << 10
    pinned = {key(i) for i in range(0, 40, 7)}
    pin_all = False
    evicted: list[bytes] = []
    store = NvmeTier(
        tmp_path,
        capacity,
        pack_file_bytes=32 << 10,
        is_pinned=lambda keys: [pin_all or k in pinned for k in keys],
        on_evict=evicted.extend,
    )
    rng = random.Random(7)
    sizes: dict[int, int] = {}
    hot = [key(1), key(2)]
    written = 0
    i = 0
    while written < 3 * capacity:
        batch = list(range(i, i + 4))
        i += 4
        sizes.update({j: rng.randrange(1000, 12000) for j in batch})
        assert store.put([(key(j), payload(j, sizes[j])) for j in batch]) == [True] * 4
        written += sum(sizes[j] for j in batch)
        assert store.get_into(hot, [aligned(16384), aligned(16384)]) == [sizes[1], sizes[2]]
        assert store.usage().bytes_used <= capacity

    assert evicted and not set(evicted) & pinned
    assert len(set(evicted)) == len(evicted)
    assert not any(store.contains(evicted))
    assert set(store.keys()) | set(evicted) == {key(j) for j in sizes}
    survivors = [*pinned, *hot, *(key(j) for j in range(i - 8, i))]
    assert all(store.get(k) == payload(index_of(k), sizes[index_of(k)]) for k in survivors)

    pin_all = True
    before = set(store.keys())
    results = store.put([(key(10_000 + j), payload(j, 12000)) for j in range(40)])
    assert False in results
    assert before <= set(store.keys())
    assert store.put([(key(20_000), b"x" * capacity)]) == [False]  # never fits, pinned or not
    assert store.usage().bytes_used <= capacity
    store.close()


def test_dead_space_of_deleted_chunks_is_compacted_not_evicted(tmp_path: Path) -> None:
    evicted: list[bytes] = []
    store = NvmeTier(tmp_path, 512 << 10, pack_file_bytes=64 << 10, on_evict=evicted.extend)
    budget = (512 - 64) << 10  # one pack file stays free for compaction
    assert all(store.put([(key(i), payload(i, 8192)) for i in range(budget // 8192)]))
    assert store.usage().bytes_used == budget
    assert store.delete([key(i) for i in range(1, budget // 8192, 2)]).count(Removal.REMOVED) == budget // 8192 // 2
    deleted = store.usage()
    assert deleted.bytes_used == budget  # deleting leaves dead space in every pack file

    assert all(store.put([(key(1000 + i), payload(1000 + i, 8192)) for i in range(8)]))
    assert not evicted
    usage = store.usage()
    assert usage.bytes_used <= budget  # 64 KiB more live data, no eviction: dead space was reclaimed
    assert usage.bytes_used - usage.live_bytes < deleted.bytes_used - deleted.live_bytes
    assert all(store.get(key(i)) == payload(i, 8192) for i in range(0, budget // 8192, 2))
    assert all(store.get(key(1000 + i)) == payload(1000 + i, 8192) for i in range(8))
    assert not (tmp_path / "segments" / "00000001.seg").exists()
    store.close()


def test_scattered_evictions_around_pinned_chunks_are_compacted(tmp_path: Path) -> None:
    evicted: list[bytes] = []
    store = NvmeTier(
        tmp_path,
        512 << 10,
        pack_file_bytes=64 << 10,
        is_pinned=lambda keys: [index_of(k) % 2 == 0 for k in keys],
        on_evict=evicted.extend,
    )
    for i in range(0, 96, 4):  # 768 KiB written, 384 KiB of it pinned, every pack file half pinned
        assert all(store.put([(key(j), payload(j, 8192)) for j in range(i, i + 4)]))
        assert store.usage().bytes_used <= 512 << 10
    assert evicted and all(index_of(k) % 2 for k in evicted)
    assert all(store.get(key(i)) == payload(i, 8192) for i in range(0, 96, 2))
    assert not (tmp_path / "segments" / "00000001.seg").exists()  # its pinned chunks were moved
    store.close()


def test_pins_are_asked_with_the_write_lock_free(tmp_path: Path) -> None:
    """Asking pins is a round trip to the index: while a put asks them, a delete (which takes the write lock) runs."""
    held_up: list[bool] = []

    def is_pinned(keys: list[bytes]) -> list[bool]:
        delete = threading.Thread(target=store.delete, args=([key(99_999)],))
        delete.start()
        delete.join(timeout=2)
        held_up.append(delete.is_alive())
        return [index_of(k) % 2 == 0 for k in keys]

    evicted: list[bytes] = []
    store = NvmeTier(tmp_path, 512 << 10, pack_file_bytes=64 << 10, is_pinned=is_pinned, on_evict=evicted.extend)
    for i in range(0, 96, 4):
        assert all(store.put([(key(j), payload(j, 8192)) for j in range(i, i + 4)]))
    assert held_up and not any(held_up)
    assert evicted and all(index_of(k) % 2 for k in evicted)
    assert all(store.get(key(i)) == payload(i, 8192) for i in range(0, 96, 2))
    store.close()


def test_delete_contains_size_of_keys_and_overwrite(tmp_path: Path) -> None:
    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    store.put([(key(1), b"a" * 10), (key(2), b"b" * 20), (key(1), b"c" * 30)])  # a repeated key: last wins
    assert store.get(key(1)) == b"c" * 30
    assert store.keys() == [key(2), key(1)]
    assert store.contains([key(1), key(3)]) == [True, False]
    assert store.size_of([key(2), key(3)]) == [20, -1]
    store.put([(key(2), b"d" * 5000)])
    assert store.get(key(2)) == b"d" * 5000
    assert store.usage().live_bytes == 5030
    assert store.delete([key(1), key(3), key(1)]) == [Removal.REMOVED, Removal.ABSENT, Removal.REMOVED]
    assert store.keys() == [key(2)]
    assert store.delete([key(2)]) == [Removal.REMOVED]
    usage = store.usage()
    assert (usage.chunks, usage.bytes_used, pack_files(tmp_path)) == (0, 0, [])  # empty files are deleted
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.put([(key(1), b"x")])


def test_concurrent_reads_while_puts_evict_and_compact(tmp_path: Path) -> None:
    store = NvmeTier(tmp_path, 512 << 10, pack_file_bytes=64 << 10, is_pinned=lambda ks: [index_of(k) < 8 for k in ks])
    sizes = {i: 3000 + (i * 997) % 9000 for i in range(400)}
    assert all(store.put([(key(i), payload(i, sizes[i])) for i in range(8)]))
    done = threading.Event()
    failures: list[BaseException] = []
    hits = [0]

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not done.is_set():
                ids = [rng.randrange(400) for _ in range(8)]
                buffers = [aligned(16384) if rng.random() < 0.5 else memoryview(bytearray(12001)) for _ in ids]
                for i, buffer, got in zip(ids, buffers, store.get_into([key(i) for i in ids], buffers), strict=True):
                    if got >= 0:
                        assert bytes(buffer[:got]) == payload(i, sizes[i])
                        hits[0] += 1
        except BaseException as e:  # surfaced by the main thread
            failures.append(e)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    try:
        for i in range(8, 400, 8):
            assert all(store.put([(key(j), payload(j, sizes[j])) for j in range(i, i + 8)]))
    finally:
        done.set()
        for thread in threads:
            thread.join()
    assert not failures, failures[0]
    assert hits[0] > 0
    assert all(store.get(key(i)) == payload(i, sizes[i]) for i in range(8))
    store.close()


def test_io_errors_are_misses_and_unstored_objects_not_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert store.put([(key(1), b"kept")]) == [True]

    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    with monkeypatch.context() as patch:
        patch.setattr(os, "fdatasync", fail)
        assert store.put([(key(2), b"x" * 70_000)]) == [False]  # rolls to a new pack file, then fails
    with monkeypatch.context() as patch:
        patch.setattr(os, "preadv", fail)
        assert store.get_into([key(1)], [aligned(PAGE)]) == [-1]
    assert store.contains([key(1), key(2)]) == [True, False]
    assert store.put([(key(3), b"after")]) == [True]
    assert (store.get(key(1)), store.get(key(3))) == (b"kept", b"after")
    store.close()
    reopened = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert sorted(reopened.keys()) == [key(1), key(3)]
    reopened.close()


def test_falls_back_to_buffered_reads_without_o_direct(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")  # what tmpfs answers
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    store = NvmeTier(tmp_path, 1 << 20, pack_file_bytes=64 << 10)
    assert store.put([(key(1), payload(1, 5000))]) == [True]
    assert store.get(key(1)) == payload(1, 5000)
    store.close()


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pack_file_bytes must be a positive multiple of 4096"):
        NvmeTier(tmp_path, 1 << 20, pack_file_bytes=10_000)
    with pytest.raises(ConfigError, match="at least 2 x pack_file_bytes"):
        NvmeTier(tmp_path, 100 << 10, pack_file_bytes=64 << 10)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        NvmeTier(tmp_path / "file", 1 << 20, pack_file_bytes=64 << 10)

    store = NvmeTier(tmp_path / "ok", 1 << 20, pack_file_bytes=64 << 10)
    with pytest.raises(ValueError, match="16 bytes"):
        store.put([(b"short", b"x")])
    with pytest.raises(ValueError, match="never empty"):
        store.put([(key(1), b"")])
    with pytest.raises(ValueError, match="one buffer per key"):
        store.get_into([key(1)], [])
    with pytest.raises(ValueError, match="writable"):
        store.get_into([key(1)], [memoryview(b"read-only")])
    with pytest.raises(ValueError, match="16 bytes"):
        store.delete([b"k" * 17])
    store.close()
