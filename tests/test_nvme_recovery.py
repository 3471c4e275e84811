"""Recovery never deletes what it can read: a lost, empty or unreadable manifest is rebuilt from the chunk objects
in the pack files, on the tier itself and through a real daemon restart."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from prefixcache.cachestore.chunks.codec import ChunkMeta, encode
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import Daemon, connect, fetch_payloads, make_spec, publish_prompt, wait_persisted
from tests.test_cachestore import NVME

PACK_FILE = 256 << 10
MAC_KEY = ChunkMacKey(os.urandom(32))


def chunk_objects(count: int, payload_bytes: int = 50_000, first: int = 0) -> dict[bytes, bytes]:
    """``count`` signed chunk objects of one chain (tokens from ``first`` on), by key."""
    parent, objects = bytes(16), {}
    for i in range(first, first + count):
        meta = ChunkMeta(
            namespace=bytes(16),
            root=bytes(16),
            parent=parent,
            tokens=pack_tokens([i, i + 1]),
            dtype="uint8",
            shape=(payload_bytes,),
        )
        objects[meta.key] = bytes(encode(meta, os.urandom(payload_bytes), MAC_KEY))
        parent = chunk_key(parent, meta.tokens)
    return objects


def filled_store(directory: Path, objects: dict[bytes, bytes]) -> list[Path]:
    """Store ``objects`` (a few per pack file, so that several files hold them) and close; the pack files."""
    store = NvmeTier(directory, 4 * 1024 * 1024, pack_file_bytes=PACK_FILE)
    items = list(objects.items())
    for start in range(0, len(items), 3):
        assert all(store.put(items[start : start + 3]))
    store.close()
    return sorted((directory / "segments").glob("*.seg"))


def assert_all_hit(store: NvmeTier, objects: dict[bytes, bytes]) -> None:
    assert sorted(store.keys()) == sorted(objects)
    assert all(store.get(key) == obj for key, obj in objects.items())


def test_a_removed_manifest_is_rebuilt_from_the_objects(tmp_path: Path) -> None:
    objects = chunk_objects(24)
    packs = filled_store(tmp_path, objects)
    assert len(packs) > 2
    shutil.rmtree(tmp_path / "manifest")

    store = NvmeTier(tmp_path, 4 * 1024 * 1024, pack_file_bytes=PACK_FILE)
    assert (store.recovery.chunks, store.recovery.rebuilt, store.recovery.untouched_pack_files) == (24, 24, 0)
    assert_all_hit(store, objects)
    assert sorted((tmp_path / "segments").glob("*.seg")) == packs  # no file deleted
    extra = chunk_objects(1, 7000, first=1000)
    assert store.put(list(extra.items())) == [True]
    store.close()

    store = NvmeTier(tmp_path, 4 * 1024 * 1024, pack_file_bytes=PACK_FILE)
    assert (store.recovery.chunks, store.recovery.rebuilt) == (25, 0)  # the rebuilt manifest was written
    assert_all_hit(store, {**objects, **extra})
    store.close()


@pytest.mark.parametrize("current", [b"garbage, not a manifest name\n", b""])
def test_an_unreadable_manifest_is_moved_aside_and_rebuilt(tmp_path: Path, current: bytes) -> None:
    objects = chunk_objects(10)
    filled_store(tmp_path, objects)
    (tmp_path / "manifest" / "CURRENT").write_bytes(current)

    store = NvmeTier(tmp_path, 4 * 1024 * 1024, pack_file_bytes=PACK_FILE)
    assert store.recovery.manifest_moved_to is not None
    aside = Path(store.recovery.manifest_moved_to)
    assert aside.parent == tmp_path and (aside / "CURRENT").read_bytes() == current  # renamed, not deleted
    assert (store.recovery.chunks, store.recovery.rebuilt) == (10, 10)
    assert_all_hit(store, objects)
    store.close()


def test_a_torn_tail_is_truncated_and_damaged_objects_skipped(tmp_path: Path) -> None:
    objects = chunk_objects(9)
    packs = filled_store(tmp_path, objects)
    torn = chunk_objects(1, 90_000, first=1000)
    newest = packs[-1]
    whole = newest.stat().st_size
    with newest.open("ab") as f:  # a crash cut the last write: its header landed, not all its bytes
        f.write(b"\0" * (-whole % 4096) + next(iter(torn.values()))[:20_000])
    damaged_key, damaged = next(iter(objects.items()))
    with packs[0].open("r+b") as f:  # the first object's header no longer verifies: skipped, the rest found
        f.write(b"XXXX")
    shutil.rmtree(tmp_path / "manifest")

    store = NvmeTier(tmp_path, 4 * 1024 * 1024, pack_file_bytes=PACK_FILE)
    assert newest.stat().st_size == -(-whole // 4096) * 4096
    assert store.recovery.rebuilt == 8
    assert_all_hit(store, {k: v for k, v in objects.items() if k != damaged_key})
    store.close()


def test_chunks_hit_after_a_daemon_restart_without_its_manifest(tmp_path: Path) -> None:
    daemon = Daemon(tmp_path / "data").start()
    try:
        client = connect(daemon)
        tokens = list(range(64 * 12))
        keys, payloads = publish_prompt(client, tokens)
        wait_persisted(client, keys)
        client.close()
        manifest = tmp_path / "data" / "nvme" / "manifest"
        for damage in ("removed", "garbage CURRENT"):
            daemon.kill()
            if damage == "removed":
                shutil.rmtree(manifest)
            else:
                (manifest / "CURRENT").write_text("garbage\n")
            daemon.start()
            restarted = connect(daemon, make_spec())
            try:
                assert all(NVME in e.locations for e in restarted.index.get(keys)), damage
                assert fetch_payloads(restarted, keys) == payloads, damage
            finally:
                restarted.close()
        assert "rebuilding it from the pack files" in " ".join(daemon.log_path.read_text().split())
    finally:
        daemon.stop()
