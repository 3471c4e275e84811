"""The connector's CUDA copy path (connector/page_copies.py): pages between a GPU's KV cache and a pinned
host arena on streams of their own, ordered against the compute stream. Runs wherever CUDA is available
(the device tool's GPU machine); the CPU cache's path is covered by tests/test_worker_side.py."""

from __future__ import annotations

import mmap

import pytest
import torch

from cachestore.arena import address_of
from cachestore.client import CacheClient
from connector.page_copies import CudaPageCopies, HostPageCopies, page_copies_for
from connector.worker_side import WorkerSide
from tests.daemon_harness import make_spec
from tests.test_worker_side import (
    BLOCK_TOKENS,
    BLOCKS,
    CHUNK_TOKENS,
    LAYERS,
    PAGE_BYTES,
    load,
    loaded_partial_pages,
    partial_pages_plan,
    publish,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


def test_a_cpu_cache_is_copied_at_once_and_other_devices_are_refused():
    assert isinstance(page_copies_for([torch.zeros(4, 8)], (0, 0)), HostPageCopies)
    with pytest.raises(ValueError, match="CPU and CUDA caches only"):
        page_copies_for([torch.zeros(4, 8, device="meta")], (0, 0))


@pytest.fixture
def host_memory():
    """Page-aligned host memory standing in for the arena (256 MiB: large enough for a missed ordering to show)."""
    memory = mmap.mmap(-1, 256 << 20)
    view = memoryview(memory)
    yield view
    view.release()
    memory.close()


def device_cache(blocks: int, page_bytes: int, layers: int = LAYERS) -> list[torch.Tensor]:
    return list(torch.zeros(layers, blocks, page_bytes, dtype=torch.uint8, device="cuda"))


@needs_cuda
def test_gathered_pages_are_those_the_queued_forward_wrote_not_those_the_next_step_writes(host_memory):
    layers = device_cache(blocks=64, page_bytes=1 << 20)  # 4 layers of 64 MiB
    copies = CudaPageCopies(torch.device("cuda"), (address_of(host_memory), len(host_memory)))
    try:
        written = [torch.randint(0, 256, layer.shape, dtype=torch.uint8, device="cuda") for layer in layers]
        for layer, values in zip(layers, written, strict=True):
            layer.copy_(values)  # queued on the compute stream, like the forward pass's writes
        blocks = list(range(8, 40)) + list(range(44, 60))  # two runs of blocks
        out = host_tensor(host_memory, len(blocks))
        copies.gather(layers, blocks, out)
        copied = copies.saved()
        copies.before_step()
        for layer in layers:
            layer.fill_(7)  # the next step may reuse the blocks at once: it must wait for the copies
        copied()
        for values, got in zip(written, out, strict=True):
            assert torch.equal(got, values[blocks].cpu())
        assert all(int(layer.min()) == 7 for layer in layers)
    finally:
        copies.close()


@needs_cuda
def test_scattered_pages_are_in_place_once_loaded(host_memory):
    layers = device_cache(blocks=32, page_bytes=1 << 20)
    copies = CudaPageCopies(torch.device("cuda"), (address_of(host_memory), len(host_memory)))
    try:
        blocks = [3, 4, 5, 20, 21, 22, 23, 24, 25, 30]
        src = host_tensor(host_memory, len(blocks))
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
        expected = src.clone()
        copies.scatter(src, layers, blocks)
        copies.loaded()
        src.fill_(0)  # the slot goes back to the arena once the load is over
        others = [b for b in range(32) if b not in blocks]
        for layer, want in zip(layers, expected, strict=True):
            assert torch.equal(layer[blocks].cpu(), want)
            assert int(layer[others].count_nonzero()) == 0
    finally:
        copies.close()


def host_tensor(memory: memoryview, pages: int) -> torch.Tensor:
    """(layers, pages, 1 MiB) over the start of ``memory``, as a slot's payload view."""
    return torch.frombuffer(memory, dtype=torch.uint8)[: LAYERS * pages << 20].view(LAYERS, pages, 1 << 20)


@pytest.fixture
def cuda_workers(daemon):
    made = []
    for _ in range(2):
        client = CacheClient.connect(daemon.url, make_spec(CHUNK_TOKENS), arena_bytes=16 << 20)
        made.append(WorkerSide(client, device_cache(BLOCKS, PAGE_BYTES), BLOCK_TOKENS))
    yield made
    for w in made:
        w.close()


@needs_cuda
def test_a_gpu_worker_publishes_and_another_loads_bit_for_bit_through_pinned_slots(cuda_workers):
    publisher, loader = cuda_workers
    keys = publish(publisher, chunks=3)
    assert load(loader, {"r": partial_pages_plan(keys)}) == set()
    assert loader.loaded_chunks == 3
    assert loaded_partial_pages(loader, publisher)
