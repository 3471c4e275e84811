"""A full disk under the NVMe tier: nothing is acknowledged as persisted that is not on disk, failures are
counted and reported, and persistence resumes by itself once there is room again.

The tier lives on a real small filesystem (a loop-mounted ext4 image: it takes O_DIRECT and fills up for real)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.tiers.nvme import NvmeTier
from tests.daemon_harness import Daemon, connect, fetch_payloads, publish_prompt, wait_for, wait_persisted
from tests.test_cachestore import NVME

FS_BYTES = 120 << 20
CHUNK_BYTES_PER_TOKEN = 16384  # 64 tokens: 1 MiB of KV per chunk


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    image, mount = tmp_path / "fs.img", tmp_path / "small"
    mount.mkdir()
    with image.open("wb") as f:
        f.truncate(FS_BYTES)
    made = subprocess.run(["mkfs.ext4", "-q", str(image)], capture_output=True)
    if (
        made.returncode
        or subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode
    ):
        pytest.skip("cannot make and loop-mount a small ext4 filesystem here (needs root and mkfs.ext4)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(path: Path, leave_bytes: int) -> None:
    """Write ``path`` until its filesystem is full, then give ``leave_bytes`` back."""
    block = b"\xff" * (1 << 20)
    with path.open("wb") as f:
        try:
            while True:
                f.write(block)
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        f.truncate(max(0, f.tell() - leave_bytes))
        os.fsync(f.fileno())


def test_a_setting_larger_than_the_filesystem_is_bounded_and_named(small_fs: Path, caplog) -> None:
    store = NvmeTier(small_fs / "nvme", 1 << 30, pack_file_bytes=32 << 20)
    assert 64 << 20 < store.capacity_bytes < FS_BYTES
    assert "set to 1024 MiB, but its filesystem holds" in caplog.text
    store.close()


def test_a_write_the_disk_refuses_is_not_stored_and_named(small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = NvmeTier(small_fs / "nvme", 1 << 30, pack_file_bytes=32 << 20)
    assert store.put([(bytes([1]) * 16, b"k" * 300_000)]) == [True]
    measured = os.statvfs(small_fs)
    fill(small_fs / "filler", leave_bytes=0)
    # a stale measure of the free space (another writer filled the disk right after it): the write itself fails
    monkeypatch.setattr(os, "statvfs", lambda path: measured)
    assert store.put([(bytes([2]) * 16, b"x" * (2 << 20))]) == [False]
    assert store.write_failure == "enospc"
    monkeypatch.undo()
    assert store.put([(bytes([3]) * 16, b"y" * (2 << 20))]) == [False]  # measured now: no room, nothing written
    assert store.write_failure == "enospc"
    (small_fs / "filler").unlink()
    assert store.put([(bytes([2]) * 16, b"x" * (2 << 20))]) == [True]
    assert store.write_failure is None
    store.close()
    reopened = NvmeTier(small_fs / "nvme", 1 << 30, pack_file_bytes=32 << 20)
    assert sorted(reopened.keys()) == [bytes([1]) * 16, bytes([2]) * 16]
    assert reopened.get(bytes([2]) * 16) == b"x" * (2 << 20)
    reopened.close()


def stats(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()


def health(daemon: Daemon) -> tuple[int, dict]:
    reply = httpx.get(daemon.url + "/v1/health")
    return reply.status_code, reply.json()


def test_no_chunk_acknowledged_as_persisted_is_lost_on_a_full_disk(tmp_path: Path, small_fs: Path) -> None:
    daemon = Daemon(tmp_path / "data", "--nvme-dir", str(small_fs / "nvme"), nvme="1GiB").start()
    published: dict[bytes, bytes] = {}
    try:
        assert "but its filesystem holds" in " ".join(daemon.log_path.read_text().split())  # rich wraps lines
        client = connect(daemon)

        def publish(prompts: int, first: int) -> list[bytes]:
            keys = []
            for p in range(first, first + prompts):
                tokens = [p * 1000 + t for t in range(64 * 8)]
                got, payloads = publish_prompt(client, tokens, seed=p, bytes_per_token=CHUNK_BYTES_PER_TOKEN)
                published.update(zip(got, payloads, strict=True))
                keys += got
            return keys

        # 1. the disk is full (another file took it): nothing persists, nothing is acknowledged, all is said
        fill(small_fs / "filler", leave_bytes=4 << 20)
        waiting = publish(2, first=0)
        assert wait_for(lambda: stats(daemon)["persist_failures"].get("enospc", 0) >= len(waiting), 15)
        code, report = health(daemon)
        assert (code, report["status"]) == (200, "degraded")
        assert report["components"]["nvme"]["degraded"] and "enospc" in report["components"]["nvme"]["detail"]
        assert not any(NVME in e.locations for e in client.index.get(waiting))
        assert stats(daemon)["queues"]["write_behind"] > 0  # their events wait
        assert fetch_payloads(client, waiting[:8]) == [published[k] for k in waiting[:8]]  # still in DRAM
        metrics = httpx.get(daemon.url + "/metrics", headers=daemon.headers).text
        assert 'prefixcache_persist_failures_total{reason="enospc"}' in metrics

        # 2. room again: the waiting chunks persist by themselves, without a restart; the node is ready again
        (small_fs / "filler").unlink()
        wait_persisted(client, waiting, timeout_s=20)
        assert wait_for(lambda: health(daemon)[1]["status"] == "ready", 10)

        # 3. publish past the filesystem's size: the tier evicts its least recently used chunks to stay within it
        publish(16, first=2)  # 128 MiB more
        assert wait_for(lambda: stats(daemon)["queues"]["write_behind"] == 0, 60)
        acknowledged = [e.key for e in client.index.get(list(published)) if e is not None and NVME in e.locations]
        assert 0 < len(acknowledged) < len(published)
        assert stats(daemon)["evictions"]["nvme_capacity"] > 0
        client.close()

        # 4. kill -9: every chunk the index called persisted is on disk and hits after the restart
        daemon.kill()
        daemon.start()
        restarted = connect(daemon)
        try:
            entries = restarted.index.get(acknowledged)
            assert all(e is not None and NVME in e.locations for e in entries)
            for start in range(0, len(acknowledged), 8):
                group = acknowledged[start : start + 8]
                assert fetch_payloads(restarted, group) == [published[k] for k in group]
        finally:
            restarted.close()
        print(f"published {len(published)}, acknowledged as persisted {len(acknowledged)}, all hit after kill -9")
    finally:
        daemon.stop()
