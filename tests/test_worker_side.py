"""The connector's worker side against the real stack (``prefixcache serve``: redis-server, mooncake_master,
a segment owner, RocksDB files), with KV caches as CPU tensors: publishes from one worker, loads into another
whose cache lies in shared memory (pages written in place) or in ordinary memory (through arena slots)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import httpx
import pytest
import redis
import torch

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.cachestore.client.node_requests import ExtentsAsked, ask_extents
from prefixcache.cachestore.client.scattered_reads import ScatteredRead
from prefixcache.cachestore.tiers.dram import first_part_rows
from prefixcache.cachestore.tiers.tier import Removal
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from prefixcache.connector.worker_side import WorkerSide
from prefixcache.connector.worker_states import WorkerStates
from prefixcache.indexer.index import Location
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import (
    CallCounter,
    Daemon,
    damage_dram_copy,
    damage_nvme_copy,
    forge_dram_copy,
    forge_nvme_copy,
    make_spec,
    wait_for,
    wait_persisted,
)
from tests.netns import freeze_processes

LAYERS, BLOCKS, BLOCK_TOKENS, PAGE_BYTES = 4, 64, 16, 4096
CHUNK_TOKENS = 64  # four pages a chunk
PAGES = CHUNK_TOKENS // BLOCK_TOKENS
REPO = Path(__file__).resolve().parent.parent


def kv_cache(memory: memoryview | None = None) -> list[torch.Tensor]:
    """Per-layer (blocks, page) uint8 views of one buffer, layer after layer, as vLLM lays out the CPU cache."""
    size = LAYERS * BLOCKS * PAGE_BYTES
    flat = torch.frombuffer(memory, dtype=torch.uint8) if memory is not None else torch.zeros(size, dtype=torch.uint8)
    return list(flat.view(LAYERS, BLOCKS, PAGE_BYTES))


def worker(
    daemon: Daemon, shared: bool, arena_bytes: int = 16 << 20, check_threads: int | Literal["auto"] = "auto"
) -> WorkerSide:
    client = CacheClient.connect(daemon.url, make_spec(CHUNK_TOKENS), arena_bytes=arena_bytes)
    layers = kv_cache(client.shared_memory(LAYERS * BLOCKS * PAGE_BYTES) if shared else None)
    return WorkerSide(client, layers, BLOCK_TOKENS, check_threads=check_threads)


@pytest.fixture
def publisher(daemon):
    w = worker(daemon, shared=False)
    yield w
    w.close()


@pytest.fixture
def loader(daemon):
    w = worker(daemon, shared=True)
    yield w
    w.close()


def publish(w: WorkerSide, chunks: int, seed: int = 0, tail: int = 0) -> list[bytes]:
    """Fill blocks 0.. with random pages and publish them as ``chunks`` chunks of one prompt, then its ``tail``
    tokens as a partial chunk (none if 0); returns keys."""
    generator = torch.Generator().manual_seed(seed)
    tokens = chunks * CHUNK_TOKENS + tail
    filled = -(-tokens // BLOCK_TOKENS)
    for rows in w.pages:  # whatever the layers' layout, as the bytes of each page
        rows[:filled] = torch.randint(0, 256, (filled, PAGE_BYTES), dtype=torch.uint8, generator=generator)
    parent, saves, keys = w.client.spec.root(), [], []
    for start in range(0, tokens, CHUNK_TOKENS):
        end = min(tokens, start + CHUNK_TOKENS)
        packed = pack_tokens(list(range(seed * 1000 + start, seed * 1000 + end)))
        blocks = list(range(start // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)))
        saves.append(SaveChunk("p", [parent], packed, blocks, None))
        parent = chunk_key(parent, packed)
        keys.append(parent)
    w.save(PrefixCacheMetadata(saves=saves))
    deadline = time.monotonic() + 10
    while w.published_chunks < len(keys):
        assert time.monotonic() < deadline, "publishes did not finish"
        time.sleep(0.01)
    return keys


def daemon_stats(daemon: Daemon) -> dict:
    return httpx.get(daemon.url + "/v1/stats", headers=daemon.headers).json()


def reported_client_stats(daemon: Daemon, client: CacheClient) -> dict[str, int]:
    """What the node's daemon reports its clients did in the client's namespace (``/v1/stats``), once this
    client's own counts are flushed to it."""
    client.recorder.flush()
    return daemon_stats(daemon)["namespaces"][client.spec.digest.hex()]["clients"]


def load(w: WorkerSide, loads: dict[str, list[LoadChunk]], asked: list[ExtentsAsked] | None = None) -> set[int]:
    """One step's loads as vLLM drives them: start them, wait for each layer's KV as its attention layer comes
    (the forward pass), then ask for load errors. ``asked``: the scheduler side's requests for where chunks on NVMe
    alone lie."""
    w.start_load(PrefixCacheMetadata(loads=[loads], extents_asked=asked or []))
    forward_pass(w)
    return w.take_load_errors()


def forward_pass(w: WorkerSide) -> None:
    """What the forward pass asks of the worker side: each attention layer, in turn, waits for its KV."""
    for layer in range(LAYERS):
        w.wait_for_layer(layer)


def pages(w: WorkerSide, blocks: list[int]) -> list[torch.Tensor]:
    return [rows[blocks].cpu() for rows in w.pages]


def equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def partial_pages_plan(keys: list[bytes]) -> list[LoadChunk]:
    """Chunk 0 whole; chunk 1 from its second page (vLLM holds the first); chunk 2 without its last page."""
    return [
        LoadChunk(keys[0], CHUNK_TOKENS, 0, [40, 41, 42, 43]),
        LoadChunk(keys[1], CHUNK_TOKENS, 1, [20, 22, 23]),
        LoadChunk(keys[2], CHUNK_TOKENS, 0, [50, 51, 52]),
    ]


def loaded_partial_pages(loader: WorkerSide, publisher: WorkerSide) -> bool:
    """Whether ``partial_pages_plan`` put the publisher's pages into the loader's blocks."""
    return (
        equal(pages(loader, [40, 41, 42, 43]), pages(publisher, [0, 1, 2, 3]))
        and equal(pages(loader, [20, 22, 23]), pages(publisher, [5, 6, 7]))
        and equal(pages(loader, [50, 51, 52]), pages(publisher, [8, 9, 10]))
    )


def test_a_cache_in_shared_memory_is_loaded_in_place_page_for_page(publisher, loader):
    keys = publish(publisher, chunks=6)
    assert loader.in_shared_memory
    assert load(loader, {"r": partial_pages_plan(keys)}) == set()
    assert loader.loaded_in_place == loader.loaded_chunks == 3
    assert loaded_partial_pages(loader, publisher)
    # what vLLM collects after the step (get_kv_connector_stats), then nothing until more moves
    chunk_bytes = PAGES * LAYERS * PAGE_BYTES
    assert publisher.transfers.take().data == {"published_chunks": 6, "published_bytes": 6 * chunk_bytes}
    assert loader.transfers.take().data == {"loaded_chunks": 3, "loaded_bytes": 10 * LAYERS * PAGE_BYTES}
    assert loader.transfers.take() is None
    untouched = [b for b in range(BLOCKS) if b not in (40, 41, 42, 43, 20, 22, 23, 50, 51, 52)]
    assert all(not layer[untouched].any() for layer in loader.layers)  # skipped pages went to scratch


@pytest.mark.parametrize("ends_mid_block", [False, True], ids=["on-a-block-boundary", "inside-its-last-block"])
def test_a_load_begun_at_the_steps_first_hook_is_finished_by_start_load(publisher, loader, ends_mid_block):
    keys = publish(publisher, chunks=2)
    plan = {
        "r": [
            LoadChunk(
                key, CHUNK_TOKENS, 0, list(range(10 + 4 * i, 14 + 4 * i)), ends_mid_block=ends_mid_block and i == 1
            )
            for i, key in enumerate(keys)
        ]
    }
    meta = PrefixCacheMetadata(loads=[plan], load_early=True)
    loader.begin_load(meta)
    loader.start_load(meta)
    forward_pass(loader)
    assert loader.take_load_errors() == set()
    assert loader.loaded_early == loader.loaded_in_place == loader.loaded_chunks == 2
    assert equal(pages(loader, list(range(10, 18))), pages(publisher, list(range(8))))


def test_a_load_vllm_writes_blocks_of_first_does_not_begin_early(publisher, loader):
    keys = publish(publisher, chunks=1)
    meta = PrefixCacheMetadata(loads=[{"r": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [4, 5, 6, 7])]}], load_early=False)
    loader.begin_load(meta)
    time.sleep(0.2)  # a read begun now would have landed
    assert not any(layer[4:8].any() for layer in loader.layers)  # nothing written before start_load
    assert load(loader, meta.loads[0]) == set()
    assert loader.loaded_early == 0 and loader.loaded_in_place == 1
    assert equal(pages(loader, [4, 5, 6, 7]), pages(publisher, [0, 1, 2, 3]))


def test_a_dram_hit_whose_last_block_vllm_writes_this_step_is_verified_before_the_forward_pass(publisher, loader):
    """vLLM writes the step's first computed token into that block while the forward pass runs. Verified where it
    landed, behind the forward pass, the chunk failed its check whenever that token's last bits differed from the
    stored one's (a multimodal e2e run: the recompute then stopped vLLM on an encoder cache miss). That block's
    pages wait in the chunk's slot until it is verified; the rest lands in place."""
    keys = publish(publisher, chunks=2)
    wait_persisted(loader.client, keys)
    damage_dram_copy(loader.client.dram, keys[1])
    chunks = [
        LoadChunk(key, CHUNK_TOKENS, 0, list(range(4 + 4 * i, 8 + 4 * i)), ends_mid_block=True)
        for i, key in enumerate(keys)
    ]
    for i, chunk in enumerate(chunks):  # a step each
        loader.start_load(PrefixCacheMetadata(loads=[{"r": [chunk]}]))
        published = pages(publisher, list(range(4 * i, 4 * i + 4)))
        assert equal(pages(loader, chunk.blocks), published)  # in before the forward pass
        for rows in loader.pages:
            rows[chunk.blocks[-1]] += 1  # the forward pass writes its token into the last block
        forward_pass(loader)
        assert loader.take_load_errors() == set()
    assert loader.loaded_chunks == 2 and loader.loaded_in_place == 1
    # the intact chunk came from DRAM, though NVMe holds it too; the damaged copy was found, and NVMe read instead
    assert (loader.client.counters.read_from_disk, loader.client.counters.corrupt) == (1, 1)


def test_a_dram_hit_ending_inside_the_only_block_it_loads_holds_that_block_between_pages_it_does_not_load(
    publisher, loader
):
    """A chunk of whose pages vLLM's own prefix cache holds the first two, and the load ends inside the third: that
    page waits in the slot, between the scratch for the pages before and after it, until the chunk is verified."""
    keys = publish(publisher, chunks=1)
    untouched = pages(loader, [9, 11])
    assert load(loader, {"r": [LoadChunk(keys[0], CHUNK_TOKENS, 2, [10], ends_mid_block=True)]}) == set()
    assert equal(pages(loader, [10]), pages(publisher, [2]))
    assert equal(pages(loader, [9, 11]), untouched)
    assert loader.loaded_in_place == 1


def test_a_held_block_whose_verification_fails_to_run_is_read_from_nvme_in_the_same_load(
    publisher, loader, monkeypatch
):
    """Verifying before the forward pass raised (say, Redis gone while a damaged copy was unlisted): the chunk loads
    through a slot from NVMe instead, and the step neither fails nor keeps unverified pages."""
    keys = publish(publisher, chunks=1)
    wait_persisted(loader.client, keys)

    def broken(*args, **kwargs):
        raise RuntimeError("verifier down")

    monkeypatch.setattr(ScatteredRead, "verify", broken)
    assert load(loader, {"r": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [20, 21, 22, 23], ends_mid_block=True)]}) == set()
    assert equal(pages(loader, [20, 21, 22, 23]), pages(publisher, [0, 1, 2, 3]))
    assert (loader.loaded_chunks, loader.loaded_in_place, loader.client.counters.read_from_disk) == (1, 0, 1)


def test_a_damaged_dram_copy_read_in_place_is_a_load_error_and_the_next_load_reads_nvme(daemon, publisher, loader):
    keys = publish(publisher, chunks=2)
    wait_persisted(loader.client, keys)
    damage_dram_copy(loader.client.dram, keys[1])
    plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(30 + 4 * i, 34 + 4 * i))) for i, key in enumerate(keys)]}
    assert load(loader, plan) == {34, 35, 36, 37}  # vLLM recomputes these and drops the step's output
    assert loader.loaded_chunks == loader.loaded_in_place == 1 and loader.client.counters.corrupt == 1
    assert loader.transfers.take().data == {
        "loaded_chunks": 1,
        "loaded_bytes": PAGES * LAYERS * PAGE_BYTES,
        "load_failed_blocks": 4,
    }
    assert loader.client.dram.contains([keys[1]]) == [False]  # the damaged copy is gone
    assert load(loader, plan) == set()
    assert loader.client.counters.read_from_disk == 1
    assert equal(pages(loader, list(range(30, 38))), pages(publisher, list(range(8))))


def test_a_dram_hits_later_layers_are_copied_while_the_forward_pass_computes_its_first(publisher, loader, monkeypatch):
    """Each chunk's DRAM copy is its first layers and the rest (cachestore/tiers/dram.py): the step starts once
    the first     are in, and the first attention layer of the rest waits for them."""
    keys = publish(publisher, chunks=2)
    copying = threading.Event()
    fetch_rest = ScatteredRead.fetch_rest

    def held_back(read):  # the owner still copying the later layers when the forward pass starts
        copying.wait(10)
        return fetch_rest(read)

    monkeypatch.setattr(ScatteredRead, "fetch_rest", held_back)
    blocks = list(range(20, 28))
    loader.start_load(
        PrefixCacheMetadata(
            loads=[{"r": [LoadChunk(key, CHUNK_TOKENS, 0, blocks[4 * i : 4 * i + 4]) for i, key in enumerate(keys)]}]
        )
    )
    published = pages(publisher, list(range(8)))
    first = first_part_rows(LAYERS)
    assert equal(pages(loader, blocks)[:first], published[:first])  # in when start_load_kv returns
    assert not any(layer[blocks].any() for layer in loader.layers[first:])  # not yet
    for layer in range(first):
        loader.wait_for_layer(layer)  # the first layers compute without waiting
    assert not any(layer[blocks].any() for layer in loader.layers[first:])
    copying.set()
    loader.wait_for_layer(first)
    assert equal(pages(loader, blocks), published)
    forward_pass(loader)
    assert loader.take_load_errors() == set() and loader.loaded_in_place == 2


def test_a_dram_hit_whose_later_layers_are_gone_is_a_load_error_and_the_next_load_reads_nvme(publisher, loader):
    """The master may evict one part of a chunk's copy; the part that arrived is never taken for the whole."""
    keys = publish(publisher, chunks=2)
    wait_persisted(loader.client, keys)
    assert loader.client.dram._store.batch_remove([loader.client.dram._names(keys[1])[1]], True) == [0]
    plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(30 + 4 * i, 34 + 4 * i))) for i, key in enumerate(keys)]}
    assert load(loader, plan) == {34, 35, 36, 37}
    assert loader.loaded_chunks == 1 and loader.client.counters.corrupt == 0 and loader.client.counters.missing == 1
    assert loader.client.dram.contains([keys[1]]) == [False]  # what was left of the copy is gone
    assert all(location.tier != "dram" for location in loader.client.index.get([keys[1]])[0].locations)
    assert load(loader, plan) == set()
    assert loader.client.counters.read_from_disk == 1
    assert equal(pages(loader, list(range(30, 38))), pages(publisher, list(range(8))))


def test_a_hit_whose_later_layers_vllm_did_not_wait_for_is_recomputed_and_later_hits_copy_every_layer_first(
    publisher, loader
):
    keys = publish(publisher, chunks=2)
    plan = {"r": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [4, 5, 6, 7])]}
    loader.start_load(PrefixCacheMetadata(loads=[plan]))
    for layer in range(first_part_rows(LAYERS)):  # a forward pass that never asks for the later layers' KV
        loader.wait_for_layer(layer)
    assert loader.take_load_errors() == {4, 5, 6, 7}
    loader.start_load(PrefixCacheMetadata(loads=[{"r": [LoadChunk(keys[1], CHUNK_TOKENS, 0, [8, 9, 10, 11])]}]))
    assert equal(pages(loader, [8, 9, 10, 11]), pages(publisher, [4, 5, 6, 7]))  # every layer in before the forward
    assert loader.take_load_errors() == set()


def test_a_forged_dram_copy_read_in_place_is_a_load_error_counted_as_a_mac_failure_and_dropped(publisher, loader):
    """A copy replaced by a valid header over zeros, signed with another key: its zeros reach the pages, fail the
    MAC while the forward pass runs, and vLLM recomputes them; the next load reads the genuine NVMe copy."""
    keys = publish(publisher, chunks=2)
    wait_persisted(loader.client, keys)
    forge_dram_copy(loader.client.dram, keys[1])
    plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(30 + 4 * i, 34 + 4 * i))) for i, key in enumerate(keys)]}
    assert load(loader, plan) == {34, 35, 36, 37}
    assert loader.client.counters.corrupt == loader.client.counters.mac_failures == 1
    assert loader.client.dram.contains([keys[1]]) == [False]  # the forgery is gone
    assert load(loader, plan) == set()
    assert equal(pages(loader, list(range(30, 38))), pages(publisher, list(range(8))))


@pytest.mark.parametrize("damage", [damage_dram_copy, forge_dram_copy], ids=["flipped-byte", "forged"])
@pytest.mark.parametrize("check_threads", [0, 4], ids=["checked-by-the-fetch", "checked-while-the-next-is-read"])
def test_a_damaged_dram_copy_loaded_through_slots_is_read_from_nvme_in_the_same_load(
    daemon, publisher, check_threads, damage
):
    """A GPU's path: every chunk is verified before anything of it is placed (check threads: a GPU worker's
    default), so a copy with a flipped byte, or forged (a valid header over zeros, signed with another key), never
    reaches the pages; both fail the MAC."""
    loader = worker(daemon, shared=False, check_threads=check_threads)
    try:
        keys = publish(publisher, chunks=2)
        wait_persisted(loader.client, keys)
        damage(loader.client.dram, keys[1])
        plan = {
            "r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(30 + 4 * i, 34 + 4 * i))) for i, key in enumerate(keys)]
        }
        before = reported_client_stats(daemon, loader.client)
        assert load(loader, plan) == set()
        assert loader.loaded_chunks == 2 and loader.loaded_in_place == 0
        assert loader.client.counters.corrupt == 1 and loader.client.counters.read_from_disk == 1
        # the node's statistics count the damaged copy as corrupt, and each chunk fetched once, however it was checked
        after = reported_client_stats(daemon, loader.client)
        assert {name: after[name] - before[name] for name in ("corrupt_chunks", "mac_failures", "fetched_chunks")} == {
            "corrupt_chunks": 1,
            "mac_failures": 1,
            "fetched_chunks": 2,
        }
        assert loader.client.dram.contains([keys[1]]) == [False]  # the damaged copy is gone
        assert equal(pages(loader, list(range(30, 38))), pages(publisher, list(range(8))))
    finally:
        loader.close()


def fresh_chunks(w: WorkerSide, requests: list[str], first_token: int, first_block: int) -> list[SaveChunk]:
    """A newly computed chunk per request to publish, each on pages of its own from ``first_block`` on."""
    return [
        SaveChunk(
            request,
            [w.client.spec.root()],
            pack_tokens(range(first_token + i, first_token + i + CHUNK_TOKENS)),
            [first_block + PAGES * i + p for p in range(PAGES)],
            None,
        )
        for i, request in enumerate(requests)
    ]


def test_a_request_whose_load_failed_publishes_nothing_that_step(daemon, publisher, loader):
    keys = publish(publisher, chunks=1)
    damage_dram_copy(loader.client.dram, keys[0])
    loader.start_load(PrefixCacheMetadata(loads=[{"bad": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [0, 1, 2, 3])]}]))
    fresh = fresh_chunks(loader, ["bad", "good"], first_token=7000, first_block=8)
    loader.save(PrefixCacheMetadata(saves=fresh))
    assert loader.take_load_errors() == {0, 1, 2, 3}
    deadline = time.monotonic() + 10
    while loader.published_chunks < 1:
        assert time.monotonic() < deadline, "the good request's chunk was not published"
        time.sleep(0.01)
    time.sleep(0.2)
    assert loader.published_chunks == 1
    stored = loader.client.index.get([chunk_key(save.parents[0], save.tokens) for save in fresh])
    assert stored[0] is None and stored[1] is not None


def test_a_steps_chunks_are_copied_out_as_each_layer_hands_its_pages_over_and_the_rest_after_the_forward(
    publisher, loader
):
    """On the CPU each layer's pages of the step's chunks are copied out at its ``save_kv_layer`` and signed behind
    the later layers; those of a layer whose hook did not come, after the forward pass (``save``)."""
    saves = fresh_chunks(publisher, ["r"], first_token=9000, first_block=0)
    generator = torch.Generator().manual_seed(9)
    for rows in publisher.pages:
        rows[:PAGES] = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=generator)
    meta = PrefixCacheMetadata(saves=saves)
    for layer in (0, 2):  # layers 1 and 3 call no hook
        publisher.save_layer(meta, layer)
    at_the_hooks = pages(publisher, list(range(PAGES)))
    for rows in publisher.pages:  # written after the hooks: published only where no hook copied them out
        rows[:PAGES] = torch.randint(0, 256, (PAGES, PAGE_BYTES), dtype=torch.uint8, generator=generator)
    after = pages(publisher, list(range(PAGES)))
    publisher.save(meta)
    assert wait_for(lambda: publisher.published_chunks == 1), "the step's chunk was not published"
    key = chunk_key(saves[0].parents[0], saves[0].tokens)
    assert load(loader, {"r": [LoadChunk(key, CHUNK_TOKENS, 0, [30, 31, 32, 33])]}) == set()
    loaded = pages(loader, [30, 31, 32, 33])
    assert equal(loaded, [at_the_hooks[0], after[1], at_the_hooks[2], after[3]])


def test_chunks_missing_from_dram_load_through_slots_from_nvme(daemon, publisher):
    keys = publish(publisher, chunks=3)
    wait_persisted(publisher.client, keys)
    # the first chunk is read in place, the rest come from disk
    assert publisher.client.dram.delete(keys[1:]) == [Removal.REMOVED] * 2
    loader = worker(daemon, shared=True)
    try:
        assert (
            load(
                loader,
                {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(4 * i, 4 * i + 4))) for i, key in enumerate(keys)]},
            )
            == set()
        )
        assert loader.loaded_chunks == 3 and loader.client.counters.read_from_disk == 2
        assert equal(pages(loader, list(range(12))), pages(publisher, list(range(12))))
    finally:
        loader.close()


def test_chunks_missing_from_dram_are_read_from_nvme_from_the_steps_first_hook(daemon, publisher):
    keys = publish(publisher, chunks=3)
    wait_persisted(publisher.client, keys)
    assert publisher.client.dram.delete(keys[:2]) == [Removal.REMOVED] * 2
    loader = worker(daemon, shared=True)
    try:
        # the lookup says which chunks DRAM lacks: the first is read from disk at once, the second found missing
        plan = {
            "r": [
                LoadChunk(key, CHUNK_TOKENS, 0, list(range(20 + 4 * i, 24 + 4 * i)), in_dram=i > 0)
                for i, key in enumerate(keys)
            ]
        }
        meta = PrefixCacheMetadata(loads=[plan], load_early=True)
        loader.begin_load(meta)
        loader.start_load(meta)
        forward_pass(loader)
        assert loader.take_load_errors() == set()
        assert loader.loaded_early == loader.loaded_layer_by_layer == 1 and loader.loaded_chunks == 3
        assert loader.client.counters.read_from_disk == 2
        assert equal(pages(loader, list(range(20, 32))), pages(publisher, list(range(12))))
    finally:
        loader.close()


def nvme_only(publisher: WorkerSide, chunks: int, tail: int = 0) -> list[bytes]:
    """Publish ``chunks`` chunks (and a ``tail``, as ``publish``) and leave them on NVMe alone, as after a restart
    of the node; their keys."""
    keys = publish(publisher, chunks=chunks, tail=tail)
    wait_persisted(publisher.client, keys)
    assert publisher.client.dram.delete(keys) == [Removal.REMOVED] * len(keys)
    return keys


def locations(client: CacheClient, key: bytes) -> list[Location]:
    """Where the index says chunk ``key`` lies."""
    entry = client.index.get([key])[0]
    return list(entry.locations) if entry is not None else []


def from_nvme(keys: list[bytes], first_block: int, first_page: int = 0) -> dict[str, list[LoadChunk]]:
    """A request's plan for chunks the lookup found on NVMe alone, into consecutive blocks from ``first_block``."""
    return {
        "r": [
            LoadChunk(
                key,
                CHUNK_TOKENS,
                first_page,
                list(range(first_block + i * PAGES, first_block + (i + 1) * PAGES))[first_page:],
                in_dram=False,
            )
            for i, key in enumerate(keys)
        ]
    }


def test_chunks_on_nvme_alone_are_read_into_their_pages_layer_by_layer_then_stored_back_into_dram(publisher, loader):
    keys = nvme_only(publisher, chunks=3)
    loader.start_load(PrefixCacheMetadata(loads=[from_nvme(keys, first_block=8)]))
    for layer in range(LAYERS):  # each attention layer finds its pages in once its wait returns
        loader.wait_for_layer(layer)
        assert torch.equal(loader.pages[layer][8:20], publisher.pages[layer][:12])
    assert loader.take_load_errors() == set()
    assert loader.loaded_chunks == loader.loaded_layer_by_layer == 3
    assert loader.client.counters.read_from_disk == loader.client.counters.fetched == 3
    loader.save(PrefixCacheMetadata())  # after the forward pass: put into DRAM from the pages
    assert wait_for(lambda: loader.client.dram.contains(keys) == [True] * 3)
    again = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(40 + 4 * i, 44 + 4 * i))) for i, key in enumerate(keys)]}
    assert load(loader, again) == set() and loader.loaded_in_place == 3  # those copies verify
    assert equal(pages(loader, list(range(40, 52))), pages(publisher, list(range(12))))


@pytest.fixture
def node_requests(daemon) -> Iterator[tuple[redis.Redis, Keyspace, str]]:
    """A connection to the daemon's index, its keyspace and its node: what a scheduler asks the daemon through."""
    config = fetch_config(daemon.url)
    client = redis.Redis.from_url(index_url(config))
    yield client, Keyspace(config.key_prefix), config.node
    client.close()


def test_a_load_takes_where_its_chunks_lie_from_the_answer_the_scheduler_side_asked_for(
    daemon, publisher, loader, node_requests
):
    """Asked as the load was planned, the daemon's answer waits in Redis when the step begins: the load reads the
    chunks with the daemon stopped by then (asked then, a locate would wait out its timeout, and the load miss)."""
    client, keyspace, node = node_requests
    keys = nvme_only(publisher, chunks=2)
    (asked,) = ask_extents(client, keyspace, node, [keys])
    assert wait_for(lambda: client.exists(keyspace.extents_reply(asked.reply_id)) == 1)
    freeze_processes([daemon.proc.pid])
    try:
        assert load(loader, from_nvme(keys, first_block=0), asked=[asked]) == set()
        assert loader.loaded_layer_by_layer == 2 and client.exists(keyspace.extents_reply(asked.reply_id)) == 0
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert equal(pages(loader, list(range(8))), pages(publisher, list(range(8))))


def test_an_answer_asked_of_another_nodes_daemon_is_not_taken(daemon, publisher, loader, node_requests):
    """Its extents name another node's pack files: the load asks this node's daemon instead, and reads intact."""
    client, keyspace, node = node_requests
    keys = nvme_only(publisher, chunks=2)
    (elsewhere,) = ask_extents(client, keyspace, "another-node", [keys])
    client.rpush(keyspace.extents_reply(elsewhere.reply_id), json.dumps([["/nowhere", 0, 4096]] * len(keys)))
    assert load(loader, from_nvme(keys, first_block=0), asked=[elsewhere]) == set()
    assert loader.loaded_layer_by_layer == 2 and client.llen(keyspace.extents_reply(elsewhere.reply_id)) == 1
    client.delete(keyspace.extents_queue("another-node"), keyspace.extents_reply(elsewhere.reply_id))


def test_a_chunk_read_layer_by_layer_whose_first_page_vllm_holds_reads_that_page_aside(publisher, loader):
    keys = nvme_only(publisher, chunks=2)
    for rows in loader.pages:
        rows[[20, 24]] = 7  # pages vLLM's own prefix cache holds: the load must leave them alone
    assert load(loader, from_nvme(keys, first_block=20, first_page=1)) == set()
    assert loader.loaded_layer_by_layer == 2
    assert all(bool((rows[[20, 24]] == 7).all()) for rows in loader.pages)
    loaded = [21, 22, 23, 25, 26, 27]
    assert equal(pages(loader, loaded), pages(publisher, [b - 20 for b in loaded]))


def test_a_damaged_nvme_copy_read_layer_by_layer_is_a_load_error_and_is_not_stored_into_dram(daemon, publisher, loader):
    keys = nvme_only(publisher, chunks=2)
    damage_nvme_copy(daemon, keys[1])  # its last byte: in the last layer's last page
    assert load(loader, from_nvme(keys, first_block=0)) == {4, 5, 6, 7}  # recomputed; the step's output dropped
    assert loader.loaded_layer_by_layer == 1 and loader.client.counters.missing == 1
    loader.save(PrefixCacheMetadata())
    assert wait_for(lambda: loader.client.dram.contains(keys[:1]) == [True])
    # the daemon, asked to promote the chunk, read it again, found it damaged and deleted it
    assert wait_for(lambda: not any(loc.tier == "nvme" for loc in locations(loader.client, keys[1])))
    assert loader.client.dram.contains(keys[1:]) == [False]


def test_a_forged_nvme_copy_read_layer_by_layer_is_a_load_error_and_the_daemon_drops_and_counts_it(
    daemon, publisher, loader
):
    """A pack file's object replaced by a self-consistent forgery: the layers land, the MAC fails behind them,
    vLLM recomputes the chunk; the daemon, asked to promote it, finds the same and deletes it from NVMe."""
    keys = nvme_only(publisher, chunks=2)
    forged_before = daemon_stats(daemon)["corrupt_by_reason"]["mac"]
    forge_nvme_copy(daemon, keys[1])
    assert load(loader, from_nvme(keys, first_block=0)) == {4, 5, 6, 7}
    assert loader.loaded_layer_by_layer == 1
    assert wait_for(lambda: not any(loc.tier == "nvme" for loc in locations(loader.client, keys[1])))
    assert wait_for(lambda: daemon_stats(daemon)["corrupt_by_reason"]["mac"] == forged_before + 1)
    assert loader.client.dram.contains(keys[1:]) == [False]


def test_a_partial_chunk_on_nvme_alone_whose_load_ends_on_a_block_boundary_is_read_layer_by_layer(publisher, loader):
    """A prompt's stored tail of 40 tokens is three pages, the last partly filled; a hit ending at its token 32
    takes two, and vLLM computes the rest from a fresh block."""
    keys = nvme_only(publisher, chunks=1, tail=40)
    plan = from_nvme(keys[:1], first_block=30)
    plan["r"].append(LoadChunk(keys[1], 40, 0, [34, 35], in_dram=False))
    for rows in loader.pages:
        rows[36] = 7  # the block after the hit's: its page in the chunk is read aside, not into it
    assert load(loader, plan) == set()
    assert loader.loaded_layer_by_layer == 2
    assert equal(pages(loader, list(range(30, 36))), pages(publisher, list(range(6))))
    assert all(bool((rows[36] == 7).all()) for rows in loader.pages)


def test_a_chunk_whose_last_block_vllm_writes_this_step_is_in_its_pages_before_the_forward_pass(publisher, loader):
    # vLLM writes a step's new keys and values into a layer's pages before that layer waits for its KV
    keys = nvme_only(publisher, chunks=1)
    plan = from_nvme(keys, first_block=12)
    plan["r"][0].ends_mid_block = True
    loader.start_load(PrefixCacheMetadata(loads=[plan]))
    assert equal(pages(loader, [12, 13, 14, 15]), pages(publisher, [0, 1, 2, 3]))  # before any layer's wait
    assert loader.take_load_errors() == set() and loader.loaded_layer_by_layer == 0


def test_a_load_vllm_did_not_wait_for_every_layer_of_is_recomputed_and_later_ones_are_read_whole(
    publisher, loader, caplog
):
    keys = nvme_only(publisher, chunks=2)
    loader.start_load(PrefixCacheMetadata(loads=[from_nvme(keys, first_block=0)]))
    loader.wait_for_layer(0)  # an engine whose attention layers, but the first, never called wait_for_layer_load
    assert loader.take_load_errors() == set(range(8))
    assert "vLLM waited for 1 of 4 layers" in caplog.text
    loader.start_load(PrefixCacheMetadata(loads=[from_nvme(keys, first_block=16)]))
    assert equal(pages(loader, list(range(16, 24))), pages(publisher, list(range(8))))  # in before any wait
    assert loader.take_load_errors() == set() and loader.loaded_layer_by_layer == 2  # the first load's only


def test_a_cache_outside_shared_memory_loads_through_slots(daemon, publisher):
    keys = publish(publisher, chunks=1)
    other = worker(daemon, shared=False)
    try:
        assert not other.in_shared_memory
        other.client.dram._store = counter = CallCounter(other.client.dram._store)
        assert load(other, {"r": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [9, 10, 11, 12])]}) == set()
        assert other.loaded_chunks == 1 and other.loaded_in_place == 0
        # from DRAM, its two parts in one call: the connector knows where its chunks are cut
        assert other.client.counters.read_from_disk == 0 and counter.reads == 1
        assert equal(pages(other, [9, 10, 11, 12]), pages(publisher, [0, 1, 2, 3]))
    finally:
        other.close()


#: An arena with room for three chunks' slots at a time (a chunk's object is 69632 bytes read-aligned)
THREE_SLOTS = 3 * 69632


@pytest.mark.parametrize("check_threads", [0, 4], ids=["checked-by-the-fetch", "checked-while-the-next-is-read"])
def test_a_load_larger_than_the_arena_loads_whole_in_windows(daemon, publisher, check_threads):
    keys = publish(publisher, chunks=8)
    small = worker(daemon, shared=False, arena_bytes=THREE_SLOTS, check_threads=check_threads)
    try:
        plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(4 * i, 4 * i + 4))) for i, key in enumerate(keys)]}
        assert load(small, plan) == set()
        assert small.loaded_chunks == 8
        assert equal(pages(small, list(range(32))), pages(publisher, list(range(32))))
        assert small.client.dram.arena.free_bytes == THREE_SLOTS  # every window's slots given back
    finally:
        small.close()


def test_a_load_from_nvme_larger_than_the_arena_loads_whole_and_its_last_window_goes_back_to_dram(daemon, publisher):
    keys = publish(publisher, chunks=8)
    wait_persisted(publisher.client, keys)
    assert publisher.client.dram.delete(keys) == [Removal.REMOVED] * 8
    small = worker(daemon, shared=False, arena_bytes=THREE_SLOTS)  # in shared memory, they are read layer by layer
    try:
        plan = {
            "r": [
                LoadChunk(key, CHUNK_TOKENS, 0, list(range(4 * i, 4 * i + 4)), in_dram=False)
                for i, key in enumerate(keys)
            ]
        }
        assert load(small, plan) == set()
        assert small.loaded_chunks == 8 and small.client.counters.read_from_disk == 8
        assert equal(pages(small, list(range(32))), pages(publisher, list(range(32))))
        small.save(PrefixCacheMetadata())  # after the forward pass: the last window's reads are stored back
        deadline = time.monotonic() + 10
        while small.client.dram.contains(keys[-1:]) != [True]:
            assert time.monotonic() < deadline, "the last window's chunks were not put back into DRAM"
            time.sleep(0.01)
    finally:
        small.close()


def test_a_step_publishing_more_than_the_arena_holds_publishes_what_fits_and_says_so(daemon, caplog):
    small = worker(daemon, shared=False, arena_bytes=THREE_SLOTS)
    try:
        parent, saves = small.client.spec.root(), []
        for i in range(8):
            tokens = pack_tokens(range(50_000 + i * CHUNK_TOKENS, 50_000 + (i + 1) * CHUNK_TOKENS))
            saves.append(SaveChunk("p", [parent], tokens, list(range(i * PAGES, (i + 1) * PAGES)), None))
            parent = chunk_key(parent, tokens)
        with caplog.at_level("WARNING", logger="prefixcache.connector"):
            small.save(PrefixCacheMetadata(saves=saves))
        deadline = time.monotonic() + 10
        while small.published_chunks < 3:
            assert time.monotonic() < deadline, "the chunks that fit were not published"
            time.sleep(0.01)
        assert small.published_chunks == 3
        published = {"published_chunks": 3, "published_bytes": 3 * PAGES * LAYERS * PAGE_BYTES}
        assert small.transfers.take().data == {**published, "unpublished_chunks": 5}
        assert [r.getMessage() for r in caplog.records if "arena_mb" in r.getMessage()] == [
            "the arena was full: chunks computed in a step were not published; raise arena_mb (warned once)"
        ]
    finally:
        small.close()


def worker_process_across(daemon: Daemon, break_attachment: Callable[[subprocess.Popen], None]) -> dict:
    """Run tests/worker_process.py against ``daemon``, breaking its attachment once it is ready; its report."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.worker_process", daemon.url],
        cwd=REPO,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        break_attachment(child)
        child.stdin.write("go\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())
    finally:
        child.kill()
        child.wait()


def test_a_worker_process_publishes_and_loads_in_place_again_after_the_daemon_restarts_under_it(tmp_path):
    """vLLM keeps running while ``prefixcache serve`` restarts (an upgrade, a crash under systemd): its one
    Mooncake attachment per process reconnects to the new segment owner with its memory, KV cache included.
    (Two attachments in one process fail to: each vLLM worker, like tests/worker_process.py, holds one.)"""
    daemon = Daemon(tmp_path / "data").start()
    try:
        result = worker_process_across(daemon, lambda _: (daemon.stop(), daemon.start()))
        assert result["republished"] and result["new_chunk_loaded"] and result["new_chunk_in_place"], result
        assert result["old_chunk_loaded"] and result["read_from_disk"] == 1, result  # DRAM restarted empty
    finally:
        daemon.stop()


def test_a_worker_process_the_segment_owner_dropped_is_taken_back_with_its_memory(tmp_path):
    """The owner drops a process it heard no heartbeat from for 10 s (stopped, starved of CPU) and, left to
    Mooncake, every later call fails for good; seen in CI as a prefill instance that stopped publishing. The
    attachment keeper has the owner map the process's memory again: publishes and in-place loads work."""
    daemon = Daemon(tmp_path / "data").start()

    def stop_for_longer_than_the_heartbeat_ttl(child: subprocess.Popen) -> None:
        child.send_signal(signal.SIGSTOP)
        time.sleep(13)
        child.send_signal(signal.SIGCONT)

    try:
        result = worker_process_across(daemon, stop_for_longer_than_the_heartbeat_ttl)
        assert result["reattachments"] == 1, result
        assert result["republished"] and result["new_chunk_loaded"] and result["new_chunk_in_place"], result
        assert result["old_chunk_loaded"] and result["read_from_disk"] == 0, result  # still in DRAM
    finally:
        daemon.stop()


def finished_async(w: WorkerSide, timeout_s: float = 10) -> set[str]:
    """Poll as vLLM does once per step until an asynchronous load is reported over."""
    deadline = time.monotonic() + timeout_s
    while not (over := w.finished_async_loads()):
        assert time.monotonic() < deadline, "the asynchronous load was never reported over"
        time.sleep(0.005)
    return over


def test_an_asynchronous_load_is_reported_over_once_its_pages_are_in_beside_a_synchronous_one(publisher, loader):
    keys = publish(publisher, chunks=3)
    loads = {
        "now": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [0, 1, 2, 3])],
        "later": [
            LoadChunk(key, CHUNK_TOKENS, 0, list(range(4 * i, 4 * i + 4))) for i, key in enumerate(keys) if i > 0
        ],
    }
    loader.start_load(PrefixCacheMetadata(loads=[loads], load_async={"later"}))
    forward_pass(loader)
    assert loader.take_load_errors() == set()
    assert equal(pages(loader, [0, 1, 2, 3]), pages(publisher, [0, 1, 2, 3]))  # the synchronous one is in now
    assert finished_async(loader) == {"later"}
    assert loader.take_load_errors() == set() and loader.loaded_async == 1 and loader.loaded_chunks == 3
    assert equal(pages(loader, list(range(4, 12))), pages(publisher, list(range(4, 12))))
    assert loader.finished_async_loads() == set()  # reported once


def test_a_damaged_chunk_of_an_asynchronous_load_fails_in_the_pass_that_reports_the_load_over(publisher, loader):
    keys = publish(publisher, chunks=2)
    damage_dram_copy(loader.client.dram, keys[1])
    plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(40 + 4 * i, 44 + 4 * i))) for i, key in enumerate(keys)]}
    loader.start_load(PrefixCacheMetadata(loads=[plan], load_async={"r"}))
    assert finished_async(loader) == {"r"}
    assert loader.take_load_errors() == {44, 45, 46, 47}  # vLLM recomputes from the first of them
    assert equal(pages(loader, [40, 41, 42, 43]), pages(publisher, [0, 1, 2, 3]))


def test_an_asynchronous_load_from_nvme_puts_what_it_read_back_into_dram(daemon, publisher):
    keys = publish(publisher, chunks=2)
    wait_persisted(publisher.client, keys)
    assert publisher.client.dram.delete(keys) == [Removal.REMOVED] * 2
    loader = worker(daemon, shared=True)
    try:
        plan = {
            "r": [
                LoadChunk(key, CHUNK_TOKENS, 0, list(range(8 + 4 * i, 12 + 4 * i)), in_dram=False)
                for i, key in enumerate(keys)
            ]
        }
        loader.start_load(PrefixCacheMetadata(loads=[plan], load_async={"r"}))
        assert finished_async(loader) == {"r"}
        assert loader.take_load_errors() == set() and loader.client.counters.read_from_disk == 2
        assert equal(pages(loader, list(range(8, 16))), pages(publisher, list(range(8))))
        deadline = time.monotonic() + 10  # stored from the slots it was read into, in the background
        while loader.client.dram.contains(keys) != [True, True]:
            assert time.monotonic() < deadline, "chunks read from NVMe were not put back into DRAM"
            time.sleep(0.01)
    finally:
        loader.close()


def test_a_step_whose_loads_are_all_asynchronous_begins_them_at_its_first_hook(publisher, loader):
    keys = publish(publisher, chunks=2)
    plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, list(range(24 + 4 * i, 28 + 4 * i))) for i, key in enumerate(keys)]}
    meta = PrefixCacheMetadata(loads=[plan], load_early=True, load_async={"r"})
    loader.begin_load(meta)
    assert finished_async(loader) == {"r"}  # vLLM calls start_load_kv only after such a step's forward pass
    loader.start_load(meta)
    assert loader.take_load_errors() == set() and loader.loaded_chunks == 2 and loader.loaded_async == 1
    time.sleep(0.2)
    assert loader.finished_async_loads() == set() and loader.loaded_chunks == 2  # begun once, not again
    assert equal(pages(loader, list(range(24, 32))), pages(publisher, list(range(8))))


def connector_threads() -> set[threading.Thread]:
    """The connector's threads running, but the client's statistics flusher, which starts with its first count."""
    return {
        thread
        for thread in threading.enumerate()
        if thread.name.startswith("prefixcache") and thread.name != "prefixcache-client-stats"
    }


@pytest.mark.parametrize("shared", [True, False], ids=["in-shared-memory", "through-slots"])
def test_a_worker_side_let_go_of_while_vllm_sleeps_loads_nothing_and_loads_again_once_restored(
    daemon, publisher, shared
):
    """vLLM 0.33's sleep mode: ``unregister_kv_caches`` before the KV cache's memory is unmapped, ``restore_kv_caches``
    once it is mapped again (connector/worker_states.py). Asleep, nothing of the worker side touches the pages and a
    load is a miss (its blocks reported failed, vLLM computes them), never KV read into unmapped memory; what was left
    to report is reported once; restored, the same tensors load again."""
    keys = publish(publisher, chunks=3)
    client = CacheClient.connect(daemon.url, make_spec(CHUNK_TOKENS), arena_bytes=16 << 20)
    before = connector_threads()  # the client's own, which stay while it is open
    layers = kv_cache(client.shared_memory(LAYERS * BLOCKS * PAGE_BYTES) if shared else None)
    states = WorkerStates(lambda: client, lambda c, transfers: WorkerSide(c, layers, BLOCK_TOKENS, transfers=transfers))
    try:
        states.adopt()
        awake = states.attached
        assert awake is not None and awake.in_shared_memory == shared
        assert load(awake, {"r": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [0, 1, 2, 3])]}) == set()
        awake.save(PrefixCacheMetadata(finished={"done"}))  # a finished request whose pages are copied out
        assert connector_threads() > before

        states.unregister()
        states.unregister()  # idempotent, as vLLM's contract asks
        assert states.attached is None and states.asleep
        assert connector_threads() == before  # every thread of the worker side is over; the client stays open
        assert states.current.finished_saves() == {"done"}  # reported once, by the side that took over
        assert states.current.finished_saves() == set()
        assert states.current.transfers.take().data["loaded_chunks"] == 1  # the counts vLLM had not collected
        asleep_blocks = [8, 9, 10, 11]
        assert load(states.current, {"r": [LoadChunk(keys[1], CHUNK_TOKENS, 0, asleep_blocks)]}) == set(asleep_blocks)
        assert all(not layer[asleep_blocks].any() for layer in layers)  # nothing written: a miss
        states.adopt()  # the next step's first hooks while asleep
        assert states.attached is None

        states.restore()
        restored = states.attached
        assert restored is not None and restored is not awake and restored.layers[0] is layers[0]
        blocks = [20, 21, 22, 23, 24, 25, 26, 27]
        plan = {"r": [LoadChunk(key, CHUNK_TOKENS, 0, blocks[4 * i : 4 * i + 4]) for i, key in enumerate(keys[1:])]}
        assert load(restored, plan) == set()
        assert equal(pages(restored, blocks), pages(publisher, list(range(4, 12))))
        states.restore()  # idempotent
        assert states.attached is restored
    finally:
        states.close()
    assert connector_threads() <= before


def test_in_the_v2_runners_order_finished_saves_are_reported_once_saved_and_a_failed_load_publishes_nothing(
    publisher, loader
):
    """vLLM 0.33's V2 model runner with a speculator collects a step's results (``get_finished``, load errors, stats)
    before ``wait_for_save`` (``post_forward(defer_finalize=True)``, then ``finalize_step`` after the drafter). A
    finished request is reported once its pages are copied out, a step later than in the V1 order; the request whose
    load failed publishes nothing though its errors were taken before the save."""
    keys = publish(publisher, chunks=2)
    damage_dram_copy(loader.client.dram, keys[1])
    fresh = fresh_chunks(loader, ["bad", "good"], first_token=9000, first_block=40)
    loads = {
        "good": [LoadChunk(keys[0], CHUNK_TOKENS, 0, [0, 1, 2, 3])],
        "bad": [LoadChunk(keys[1], CHUNK_TOKENS, 0, [4, 5, 6, 7])],
    }
    step = PrefixCacheMetadata(loads=[loads], saves=fresh, finished={"ended"})
    loader.begin_step(step)
    loader.start_load(step)
    forward_pass(loader)
    # post_forward(defer_finalize=True)
    assert loader.finished_saves() == set()  # "ended"'s pages are copied out by wait_for_save, not yet
    assert loader.finished_async_loads() == set()
    assert loader.take_load_errors() == {4, 5, 6, 7}
    assert loader.transfers.take().data["loaded_chunks"] == 1
    # finalize_step: wait_for_save, then clear_connector_metadata
    loader.save(step)
    # the next step, as vLLM runs it
    after = PrefixCacheMetadata(loads=[{}])
    loader.begin_step(after)
    loader.start_load(after)
    forward_pass(loader)
    assert loader.finished_saves() == {"ended"}
    assert loader.take_load_errors() == set()
    loader.save(after)
    assert loader.finished_saves() == set()  # reported once
    deadline = time.monotonic() + 10
    while loader.published_chunks < 1:
        assert time.monotonic() < deadline, "the good request's chunk was not published"
        time.sleep(0.01)
    time.sleep(0.2)
    stored = loader.client.index.get([chunk_key(save.parents[0], save.tokens) for save in fresh])
    assert loader.published_chunks == 1 and stored[0] is None and stored[1] is not None
