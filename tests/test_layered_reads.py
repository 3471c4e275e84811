"""LayeredRead over a real pack file: each layer lands in its pages, each header with its layer 0, and a read
that fails is its chunk's miss, with the reason, while every wait still ends."""

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefixcache.cachestore.chunks.codec import BodyCheck, ChunkError, ChunkMeta, encode
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.tiers.nvme_io import PAGE, Extent
from prefixcache.connector.loaders.layered_reads import LayeredChunk, LayeredRead
from prefixcache.connector.metadata import LoadChunk
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.tokens import pack_tokens

NS, ROOT = b"n" * 16, b"r" * 16
LAYERS, TOKENS = 4, 64
SHAPE = (LAYERS, 2, TOKENS, 4, 32)  # float32: 64 KiB a layer, two 32 KiB pages
PAGE_BYTES = 32 << 10
MAC_KEY = ChunkMacKey(bytes(range(32)))


def body_check(key: bytes, head: memoryview) -> BodyCheck:
    return BodyCheck(head, key=key, namespace=NS, mac_key=MAC_KEY)


def chunk_meta(i: int) -> ChunkMeta:
    return ChunkMeta(
        namespace=NS,
        root=ROOT,
        parent=bytes([i]) * 16,
        tokens=pack_tokens(range(i, i + TOKENS)),
        dtype="float32",
        shape=SHAPE,
        tenant=0,
    )


@pytest.fixture
def segment(tmp_path: Path) -> tuple[Path, list[bytes], int]:
    """Two objects at page boundaries of one file, as the NVMe tier stores them; the path, the objects, and
    each object's padded length."""
    metas = [chunk_meta(i) for i in range(2)]
    rng = np.random.default_rng(1)
    objects = [
        bytes(encode(m, rng.integers(0, 256, m.payload_bytes, dtype=np.uint8).tobytes(), MAC_KEY)) for m in metas
    ]
    padded = -(-len(objects[0]) // PAGE) * PAGE
    path = tmp_path / "00000001.seg"
    path.write_bytes(b"".join(obj.ljust(padded, b"\0") for obj in objects))
    return path, objects, padded


def layered_chunks(path: Path, objects: list[bytes], padded: int) -> list[LayeredChunk]:
    """Each object's head in a page of its own and each layer's payload in two pages of a fake KV cache."""
    head = chunk_meta(0).payload_offset
    heads = memoryview(mmap.mmap(-1, head * len(objects)))
    pages = memoryview(mmap.mmap(-1, len(objects) * LAYERS * 2 * PAGE_BYTES))
    chunks = []
    for i, obj in enumerate(objects):
        layers = [
            [pages[((i * LAYERS + layer) * 2 + p) * PAGE_BYTES :][:PAGE_BYTES] for p in range(2)]
            for layer in range(LAYERS)
        ]
        key = chunk_meta(i).key
        assert key == chunk_key(bytes([i]) * 16, pack_tokens(range(i, i + TOKENS)))
        view = heads[i * head : (i + 1) * head]
        chunks.append(
            LayeredChunk(
                LoadChunk(key, TOKENS, 0, [i], in_dram=False),
                view,
                view,
                layers,
                Extent(str(path), i * padded, len(obj)),
            )
        )
    return chunks


@pytest.fixture
def read():
    """Starts a LayeredRead of chunks on two reader threads, shut down after the test."""
    with ThreadPoolExecutor(2) as readers:
        yield lambda chunks: LayeredRead(chunks, readers, parallel=2)


def test_each_layer_is_in_its_pages_once_its_wait_returns_and_both_chunks_verify(segment, read):
    path, objects, padded = segment
    chunks = layered_chunks(path, objects, padded)
    assert all(c.aligned() for c in chunks)
    reading = read(chunks)
    head = chunk_meta(0).payload_offset
    layer_bytes = 2 * PAGE_BYTES
    for layer in range(LAYERS):
        reading.wait_layer(layer)
        for c, obj in zip(chunks, objects, strict=True):
            assert b"".join(c.layers[layer]) == obj[head + layer * layer_bytes :][:layer_bytes]
    assert [bytes(c.head) for c in chunks] == [obj[:head] for obj in objects]  # read with layer 0
    checks = reading.check(body_check)
    assert [check.verdict() for check in checks] == [chunk_meta(0), chunk_meta(1)]  # type: ignore[union-attr]
    assert reading.waited == set(range(LAYERS))


def test_a_segment_cut_short_fails_the_chunk_at_its_first_missing_layer_and_every_wait_ends(segment, read):
    path, objects, padded = segment
    head = chunk_meta(0).payload_offset
    os.truncate(path, padded + head + 2 * 2 * PAGE_BYTES)  # the second object's layers 2 and 3 are gone
    reading = read(layered_chunks(path, objects, padded))
    for layer in range(LAYERS):
        reading.wait_layer(layer)
    first, second = reading.check(body_check)
    assert isinstance(first, BodyCheck) and first.verdict() == chunk_meta(0)
    assert isinstance(second, ChunkError) and "layer 2 could not be read" in str(second)


def test_a_segment_gone_since_it_was_located_fails_every_chunk_at_its_header(segment, read):
    path, objects, padded = segment
    chunks = layered_chunks(path, objects, padded)
    path.unlink()
    reading = read(chunks)
    checks = reading.check(body_check)
    assert all(isinstance(c, ChunkError) and "its header and layer 0 could not be read" in str(c) for c in checks)
