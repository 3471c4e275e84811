"""A connector worker side in a process of its own, as each vLLM worker is, for tests that break its
Mooncake attachment (tests/test_worker_side.py): restart the daemon under it, or stop the process for
longer than the segment owner waits for its heartbeat. A process holds one attachment, as a vLLM worker does.

    python -m tests.worker_process SERVICE_URL

It publishes a chunk and loads it back, prints ``ready`` and waits for a line on stdin (the test breaks
the attachment meanwhile). Then, for up to 60 s, it publishes a second chunk until that works, loads both
chunks again and prints one JSON line of what happened.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from prefixcache.connector.worker_side import WorkerSide
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.tokens import pack_tokens
from tests.daemon_harness import make_spec, wait_persisted

LAYERS, BLOCKS, BLOCK_TOKENS, PAGE_BYTES, CHUNK_TOKENS = 2, 32, 16, 4096, 64
PAGES = CHUNK_TOKENS // BLOCK_TOKENS


def publish(worker: WorkerSide, seed: int, blocks: list[int]) -> tuple[bytes, list[torch.Tensor]]:
    """Fill ``blocks`` with random pages and publish them as one chunk; returns its key and the pages."""
    generator = torch.Generator().manual_seed(seed)
    for layer in worker.layers:
        layer[blocks] = torch.randint(0, 256, (len(blocks), PAGE_BYTES), dtype=torch.uint8, generator=generator)
    tokens = pack_tokens(range(seed * CHUNK_TOKENS, (seed + 1) * CHUNK_TOKENS))
    root = worker.client.spec.root()
    worker.save(PrefixCacheMetadata(saves=[SaveChunk("p", [root], tokens, blocks, None)]))
    return chunk_key(root, tokens), [layer[blocks].clone() for layer in worker.layers]


def load(worker: WorkerSide, key: bytes, blocks: list[int], expected: list[torch.Tensor]) -> bool:
    """Load a chunk into zeroed ``blocks``; whether it arrived intact."""
    for layer in worker.layers:
        layer[blocks] = 0
    worker.start_load(PrefixCacheMetadata(loads=[{"r": [LoadChunk(key, CHUNK_TOKENS, 0, blocks)]}]))
    for layer in range(len(worker.layers)):  # the forward pass: each attention layer waits for its KV
        worker.wait_for_layer(layer)
    if worker.take_load_errors():
        return False
    return all(torch.equal(layer[blocks], pages) for layer, pages in zip(worker.layers, expected, strict=True))


def published(worker: WorkerSide, count: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while worker.published_chunks < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def reattachments(client: CacheClient, timeout_s: float) -> int:
    """How often the segment owner was made to take this process back; the count lands just after the calls
    that needed it work again, so it is waited for a little."""
    deadline = time.monotonic() + timeout_s
    while not client.dram.reattachments and time.monotonic() < deadline:
        time.sleep(0.05)
    return client.dram.reattachments


def main(service_url: str) -> None:
    client = CacheClient.connect(service_url, make_spec(CHUNK_TOKENS), arena_bytes=16 << 20)
    memory = client.shared_memory(LAYERS * BLOCKS * PAGE_BYTES)
    layers = list(torch.frombuffer(memory, dtype=torch.uint8).view(LAYERS, BLOCKS, PAGE_BYTES))
    worker = WorkerSide(client, layers, BLOCK_TOKENS)
    first, first_pages = publish(worker, seed=1, blocks=[0, 1, 2, 3])
    ready = published(worker, 1, 10) and load(worker, first, [8, 9, 10, 11], first_pages)
    wait_persisted(client, [first])  # so that it outlives the restart, on NVMe
    print("ready" if ready else "not ready", flush=True)
    sys.stdin.readline()  # the daemon restarts meanwhile
    started = time.monotonic()
    while True:  # the same chunk each time, so a late success is the same chunk too
        second, second_pages = publish(worker, seed=2, blocks=[4, 5, 6, 7])
        if published(worker, 2, 1.0) or time.monotonic() - started > 60:
            break
    republished_s = time.monotonic() - started
    in_place = worker.loaded_in_place
    result = {
        "republished": worker.published_chunks >= 2,
        "republished_s": republished_s,
        "new_chunk_loaded": load(worker, second, [12, 13, 14, 15], second_pages),
        "new_chunk_in_place": worker.loaded_in_place > in_place,
        "old_chunk_loaded": load(worker, first, [16, 17, 18, 19], first_pages),
        "read_from_disk": client.counters.read_from_disk,
        "reattachments": reattachments(client, timeout_s=3),
    }
    print(json.dumps(result), flush=True)
    worker.close()


if __name__ == "__main__":
    main(sys.argv[1])
