"""The object tier (cachestore/tiers/object_store.py) and its reconcile (cachestore/services/bucket_reconcile.py)
against a real S3 server (SeaweedFS, tests/s3_server.py)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.cachestore.chunks.codec import ChunkMeta, encode
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.chunks.seal import OVERHEAD, ChunkSealer
from prefixcache.cachestore.node.settings import load_settings
from prefixcache.cachestore.services.bucket_reconcile import BucketLimits, reconcile_bucket
from prefixcache.cachestore.tiers.object_store import LATE, ObjectStoreAddress, ObjectTier
from prefixcache.cachestore.tiers.tier import Removal
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import Location
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import wait_for
from tests.in_memory_index import InMemoryIndex
from tests.s3_server import SeaweedS3


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    server = SeaweedS3(tmp_path_factory.mktemp("s3"))
    server.start()
    with pytest.MonkeyPatch.context() as env:
        for name, value in server.credentials().items():
            env.setenv(name, value)
        yield server
    server.stop()


SEALER = ChunkSealer(ChunkMacKey(os.urandom(32)))


def tier_of(s3: SeaweedS3, prefix: str | None = None, sealer: ChunkSealer = SEALER, **options) -> ObjectTier:
    """A tier on a prefix (a fresh one unless given) of one bucket (created by the first put: the identity is an
    admin)."""
    url = f"s3://prefixcache-test/{prefix or secrets.token_hex(4)}"
    address = ObjectStoreAddress.parse(url, endpoint=s3.endpoint, region="us-east-1", path_style=True)
    return ObjectTier(address, sealer, **options)


@pytest.fixture
def tier(s3: SeaweedS3) -> Iterator[ObjectTier]:
    tier = tier_of(s3)
    yield tier
    tier.close()


def test_put_get_contains_delete_and_list_in_pages(tier: ObjectTier) -> None:
    objects = {os.urandom(16): os.urandom(size) for size in (1, 4096, 1 << 20, 3 << 20)}
    assert tier.put(list(objects.items())) == [True] * 4
    absent = os.urandom(16)
    keys = [*objects, absent]
    buffers = [memoryview(bytearray(4 << 20)) for _ in keys]
    lengths = tier.get_into(keys, buffers)
    assert lengths == [len(data) for data in objects.values()] + [-1]
    assert all(bytes(buffer[: len(data)]) == data for buffer, data in zip(buffers, objects.values(), strict=False))
    assert tier.get_into([next(iter(objects))], [memoryview(bytearray(0))]) == [-1]  # a buffer too small: a miss
    assert tier.contains(keys) == [True] * 4 + [False]
    pages = list(tier.list_pages(page_keys=3))
    assert [len(page) for page in pages] == [3, 1]
    assert {key: size for page in pages for key, size, _ in page} == {k: len(v) + OVERHEAD for k, v in objects.items()}
    usage = tier.usage()
    sealed = sum(len(data) + OVERHEAD for data in objects.values())
    assert (usage.tier, usage.chunks, usage.bytes_used) == ("object", 4, sealed)
    assert tier.delete([keys[0], absent]) == [Removal.REMOVED, Removal.ABSENT]
    assert tier.contains(keys[:2]) == [False, True]
    assert tier.health().ok and not tier.health().degraded


def test_a_stopped_bucket_is_fast_misses_degraded_health_then_service_again(tmp_path: Path, monkeypatch) -> None:
    server = SeaweedS3(tmp_path / "s3")
    server.start()
    for name, value in server.credentials().items():
        monkeypatch.setenv(name, value)
    tier = tier_of(server, read_deadline_s=0.5, request_timeout_s=2.0, breaker_s=0.5)
    try:
        key = os.urandom(16)
        assert tier.put([(key, b"kept")]) == [True]
        server.stop()
        assert tier.put([(os.urandom(16), b"x")]) == [False]
        assert tier.health().degraded and "unreachable" in tier.health().detail
        started = time.monotonic()
        assert tier.get_into([key], [memoryview(bytearray(16))]) == [-1]  # the breaker is open: answered at once
        assert tier.delete([key]) == [Removal.FAILED]
        assert time.monotonic() - started < 0.1
        server.start()
        buffer = memoryview(bytearray(16))
        # the breaker (0.5 s) over and the server serving again, which takes a moment more on a loaded machine
        assert wait_for(lambda: tier.get_into([key], [buffer]) == [4], timeout_s=30)
        assert bytes(buffer[:4]) == b"kept"
        assert not tier.health().degraded
    finally:
        tier.close()
        server.stop()


def test_a_read_past_its_deadline_is_a_miss(tier: ObjectTier, monkeypatch) -> None:
    key = os.urandom(16)
    assert tier.put([(key, b"slow")]) == [True]
    import obstore

    real_get = obstore.get
    monkeypatch.setattr(obstore, "get", lambda *args: time.sleep(1.0) or real_get(*args))
    tier._read_deadline_s = 0.2
    assert tier.get_into([key], [memoryview(bytearray(16))]) == [LATE]
    assert tier.late_reads == 1


@pytest.mark.parametrize(
    ("url", "endpoint", "why"),
    [
        ("http://bucket/prefix", None, "s3://BUCKET"),
        ("s3:///prefix", None, "s3://BUCKET"),
        ("s3://key:secret@bucket/prefix", None, "no credentials"),
        ("s3://bucket/prefix?x=1", None, "no credentials, query"),
        ("s3://bucket", "ftp://host", "http(s)://HOST"),
        ("s3://bucket", "http://user:pw@host:9000", "without credentials"),
    ],
)
def test_bad_addresses_are_refused_clearly(url: str, endpoint: str | None, why: str) -> None:
    with pytest.raises(ConfigError, match=why.replace("(", r"\(").replace(")", r"\)")):
        ObjectStoreAddress.parse(url, endpoint=endpoint)


def test_object_names_hold_keys_under_the_prefix() -> None:
    address = ObjectStoreAddress.parse("s3://bucket/a/b/")
    key = bytes(range(16))
    assert address.name_of(key) == "a/b/chunks/" + key.hex()
    assert address.key_of(address.name_of(key)) == key
    assert address.key_of("a/b/other/" + key.hex()) is None
    assert address.key_of("a/b/chunks/zz") is None
    assert ObjectStoreAddress.parse("s3://bucket").name_of(key) == "chunks/" + key.hex()


def test_sealed_objects_reveal_nothing_and_a_tampered_swapped_or_foreign_one_is_a_counted_miss(s3: SeaweedS3) -> None:
    import obstore

    tier = tier_of(s3)
    try:
        first, second = os.urandom(16), os.urandom(16)
        data = {first: b"tokens and KV values " * 200, second: os.urandom(5000)}
        assert tier.put(list(data.items())) == [True, True]
        names = {key: tier.address.name_of(key) for key in data}
        raw = bytes(obstore.get(tier._store, names[first]).bytes())
        assert b"tokens and KV values" not in raw and len(raw) == len(data[first]) + OVERHEAD
        buffer = memoryview(bytearray(8192))

        tampered = bytearray(raw)
        tampered[100] ^= 1
        obstore.put(tier._store, names[first], bytes(tampered))
        assert tier.get_into([first], [buffer]) == [-1] and (tier.rejected.total, tier.rejected.mac) == (1, 1)

        obstore.put(tier._store, names[first], bytes(obstore.get(tier._store, names[second]).bytes()))  # swapped
        assert tier.get_into([first], [buffer]) == [-1] and (tier.rejected.total, tier.rejected.mac) == (2, 2)

        assert tier.get_into([second], [buffer]) == [5000] and bytes(buffer[:5000]) == data[second]
        other_cluster = tier_of(s3, prefix=tier.address.prefix, sealer=ChunkSealer(ChunkMacKey(os.urandom(32))))
        assert other_cluster.get_into([second], [buffer]) == [-1] and other_cluster.rejected.total == 1
        other_cluster.close()
        assert tier.health().ok and not tier.health().degraded  # a bad object is the object's fault, not the bucket's
    finally:
        tier.close()


def test_a_pass_registers_what_the_index_lacks_and_keeps_the_tier_within_its_limits(tier: ObjectTier) -> None:
    chunks = [chunk_object(layers=2) for _ in range(3)]
    for key, data in chunks:  # one a second: the bucket's times are whole seconds
        assert tier.put([(key, data)]) == [True]
        time.sleep(1.1)
    keys = [key for key, _ in chunks]
    index = InMemoryIndex()
    report = reconcile_bucket(index, tier, "node-x", deadline_s=30)
    assert (report.listed, report.registered, report.complete, report.expired) == (3, 3, True, 0)
    assert all(e is not None and e.locations == {Location("object", "node-x")} for e in index.get(keys))
    assert [e.size_bytes for e in index.get(keys)] == [len(data) for _, data in chunks]

    room = sum(len(data) + OVERHEAD for _, data in chunks[1:])  # all but one object
    oldest_pinned = lambda asked: [key == keys[0] for key in asked]  # noqa: E731
    report = reconcile_bucket(index, tier, "node-x", 30, BucketLimits(capacity_bytes=room), oldest_pinned)
    assert (report.registered, report.expired) == (0, 1)
    assert tier.contains(keys) == [True, False, True]  # the oldest unpinned went
    assert [e is not None for e in index.get(keys)] == [True, False, True]  # with its last location, its entry
    report = reconcile_bucket(index, tier, "node-x", 30, BucketLimits(max_age_s=0.5))
    assert report.expired == 2 and tier.contains(keys) == [False] * 3


def chunk_object(layers: int) -> tuple[bytes, bytes]:
    """A chunk's stored form (key, object): a root chunk of 40 tokens, ``layers`` rows of random bytes."""
    meta = ChunkMeta(
        os.urandom(16), os.urandom(16), os.urandom(16), pack_tokens(list(range(40))), "uint8", (layers, 5000)
    )
    return meta.key, bytes(encode(meta, os.urandom(layers * 5000), ChunkMacKey(os.urandom(32))))


def test_credentials_come_from_the_shared_file_where_the_environment_has_none(s3: SeaweedS3, tmp_path, monkeypatch):
    credentials = tmp_path / "credentials"
    credentials.write_text(
        f"[other]\naws_access_key_id = nobody\naws_secret_access_key = nothing\n\n"
        f"[cache]\naws_access_key_id = {s3.access_key}\naws_secret_access_key = {s3.secret_key}\n"
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_PROFILE", "cache")
    tier = tier_of(s3)
    try:
        assert tier.put([(os.urandom(16), b"signed with the file's keys")]) == [True]
    finally:
        tier.close()
    monkeypatch.setenv("AWS_PROFILE", "other")
    tier = tier_of(s3)
    try:
        assert tier.put([(os.urandom(16), b"refused")]) == [False]
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("setting", "value", "why"),
    [
        ("object_store_url", "http://bucket/prefix", "must be s3://BUCKET"),
        ("object_store_url", "s3://AKIAEXAMPLE:secret@bucket", "without credentials"),
        ("object_store_endpoint", "https://AKIAEXAMPLE:secret@s3.example:9000", "without credentials"),
    ],
)
def test_bad_object_store_settings_are_refused_clearly_and_never_echoed(setting, value, why, tmp_path):
    with pytest.raises(ConfigError, match=why) as refused:
        load_settings({setting: value, "data_dir": tmp_path}, None)
    assert "secret" not in str(refused.value) and value not in str(refused.value)
