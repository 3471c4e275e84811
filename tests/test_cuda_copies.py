"""The connector's CUDA copy path (connector/page_copies.py): pages between a GPU's KV cache and a pinned
host arena on streams of their own, ordered against the compute stream. Runs wherever CUDA is available
(the device tool's GPU machine); the CPU cache's path is covered by tests/test_worker_side.py."""

from __future__ import annotations

import functools
import mmap
import random

import pytest
import torch

from prefixcache.cachestore.chunks.arena import address_of
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.page_copies import (
    CudaPageCopies,
    HostPageCopies,
    layer_groups,
    page_copies_for,
    pin_host_memory,
    unpin_host_memory,
)
from prefixcache.connector.pages import page_rows
from prefixcache.connector.settings import Directions
from prefixcache.connector.worker_side import WorkerSide
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
    assert isinstance(page_copies_for([torch.zeros(4, 8, dtype=torch.uint8)], (0, 0), 2), HostPageCopies)
    with pytest.raises(ValueError, match="CPU and CUDA caches only"):
        page_copies_for([torch.zeros(4, 8, dtype=torch.uint8, device="meta")], (0, 0), 2)


def test_layers_a_constant_stride_apart_in_one_allocation_are_moved_as_one_group():
    one_buffer = [page_rows(layer) for layer in torch.zeros(6, 10, 16, 2, 8, dtype=torch.bfloat16)]
    ((first, group),) = layer_groups(one_buffer)
    assert first == 0 and group.shape == (6, 10, 512)
    group[4, 7].fill_(9)  # a view: the group's page is the layer's
    assert torch.equal(one_buffer[4][7], torch.full((512,), 9, dtype=torch.uint8))
    interleaved = torch.zeros(10, 3, 512, dtype=torch.uint8)  # block by block (BLHNC)
    ((_, across),) = layer_groups([interleaved[:, i] for i in range(3)])
    assert across.shape == (3, 10, 512) and across.stride() == (512, 3 * 512, 1)


def test_layers_in_separate_allocations_or_uneven_strides_are_moved_apart():
    apart = [torch.zeros(10, 64, dtype=torch.uint8) for _ in range(3)]
    assert [first for first, _ in layer_groups(apart)] == [0, 1, 2]
    buffer = torch.zeros(12, 10, 64, dtype=torch.uint8)
    uneven = [buffer[0], buffer[1], buffer[2], buffer[5], buffer[8]]  # steps 1, 1, 3, 3
    assert [(first, len(group)) for first, group in layer_groups(uneven)] == [(0, 3), (3, 2)]


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


def vllm_cache(blocks: int, layers: int = LAYERS, heads: int = 2, head_bytes: int = 128) -> list[torch.Tensor]:
    """Layers as vLLM 0.32 hands them to FlashAttention: logical [B, H, N, C] bf16 views of one buffer, laid
    out LBNHC (a block's tokens outside its heads); a page is BLOCK_TOKENS * heads * head_bytes bytes."""
    raw = torch.zeros(layers, blocks, BLOCK_TOKENS, heads, head_bytes // 2, dtype=torch.bfloat16, device="cuda")
    return [layer.permute(0, 2, 1, 3) for layer in raw]


def mla_cache(blocks: int, dtype: torch.dtype = torch.bfloat16, token_bytes: int = 1152) -> list[torch.Tensor]:
    """Layers as vLLM's GPU MLA backends hold them: one latent vector a token (a 512-wide latent and 64 rotary
    dimensions in bf16: 1152 bytes; ``fp8_ds_mla`` packs 656), ``(blocks, block tokens, vector)``, each layer
    an allocation of its own."""
    width = token_bytes // torch.tensor([], dtype=dtype).element_size()
    return [torch.zeros(blocks, BLOCK_TOKENS, width, dtype=dtype, device="cuda") for _ in range(LAYERS)]


def fill_random(layer: torch.Tensor) -> None:
    if layer.is_floating_point():
        layer.copy_(torch.randn(layer.shape, device="cuda"))
    else:
        layer.copy_(torch.randint(0, 256, layer.shape, dtype=layer.dtype, device="cuda"))


def copies_over(pages: list[torch.Tensor], memory: memoryview, chunk_pages: int) -> CudaPageCopies:
    return CudaPageCopies(pages, (address_of(memory), len(memory)), chunk_pages)


@needs_cuda
def test_gathered_pages_are_those_the_queued_forward_wrote_not_those_the_next_step_writes(host_memory):
    layers = device_cache(blocks=64, page_bytes=1 << 20)  # 4 layers of 64 MiB
    blocks = list(range(8, 40)) + list(range(44, 60))  # two runs of blocks
    copies = copies_over(layers, host_memory, chunk_pages=len(blocks))
    try:
        written = [torch.randint(0, 256, layer.shape, dtype=torch.uint8, device="cuda") for layer in layers]
        for layer, values in zip(layers, written, strict=True):
            layer.copy_(values)  # queued on the compute stream, like the forward pass's writes
        out = host_tensor(host_memory, len(blocks))
        copies.gather(blocks, out)
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
    blocks = [3, 4, 5, 20, 21, 22, 23, 24, 25, 30]
    copies = copies_over(layers, host_memory, chunk_pages=len(blocks))
    try:
        src = host_tensor(host_memory, len(blocks))
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
        expected = src.clone()
        copies.scatter(src, blocks)
        copies.loaded()
        src.fill_(0)  # the slot goes back to the arena once the load is over
        others = [b for b in range(32) if b not in blocks]
        for layer, want in zip(layers, expected, strict=True):
            assert torch.equal(layer[blocks].cpu(), want)
            assert int(layer[others].count_nonzero()) == 0
    finally:
        copies.close()


@needs_cuda
@pytest.mark.parametrize(
    "cache",
    [vllm_cache, mla_cache, functools.partial(mla_cache, dtype=torch.uint8, token_bytes=656)],
    ids=["flash-attention", "mla", "fp8-ds-mla"],
)
def test_scattered_vllm_pages_round_trip_byte_for_byte_from_any_blocks(host_memory, cache):
    source, target = cache(blocks=96), cache(blocks=96)
    for layer in source:
        fill_random(layer)
    src_pages, dst_pages = [page_rows(layer) for layer in source], [page_rows(layer) for layer in target]
    page = src_pages[0].shape[1]
    chunk = 8
    sender, receiver = copies_over(src_pages, host_memory, chunk), copies_over(dst_pages, host_memory, chunk)
    try:
        scattered = random.Random(0).sample(range(96), 20)  # a long-lived engine's blocks, and more than a chunk
        out = torch.frombuffer(host_memory, dtype=torch.uint8)[: LAYERS * 20 * page].view(LAYERS, 20, page)
        sender.gather(scattered, out)
        sender.saved()()
        into = random.Random(1).sample(range(96), 19)
        receiver.scatter(out[:, 1:], into)  # from the second page on, as when vLLM holds the first
        receiver.loaded()
        for src, dst in zip(source, target, strict=True):
            assert torch.equal(dst[into], src[scattered[1:]])  # every element, in vLLM's logical view
        untouched = [b for b in range(96) if b not in into]
        assert all(int(layer[untouched].count_nonzero()) == 0 for layer in target)
    finally:
        sender.close()
        receiver.close()


@needs_cuda
def test_an_arena_pinned_already_is_used_as_it_is_and_cuda_goes_on(host_memory):
    address = address_of(host_memory)
    assert pin_host_memory(address, len(host_memory)) == address
    try:
        assert pin_host_memory(address, len(host_memory)) is None  # pinned already (by Mooncake, say): not ours
        # torch checks the thread's last CUDA error after launches: the failed registration must not surface there
        values = torch.tensor([1, 2, 3], pin_memory=True).to("cuda", non_blocking=True).add_(1)
        assert values.tolist() == [2, 3, 4]
    finally:
        unpin_host_memory(address)


@needs_cuda
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_engine_that_moves_kv_one_way_stages_pages_for_that_way_only(host_memory, role):
    layers = device_cache(blocks=8, page_bytes=1 << 20)
    directions = Directions.of_role(role)
    before = torch.cuda.memory_allocated()
    copies = CudaPageCopies(layers, (address_of(host_memory), len(host_memory)), 4, directions)
    try:
        assert torch.cuda.memory_allocated() - before == 2 * LAYERS * 4 << 20  # two lanes of one 4-page chunk
        pages, blocks = host_tensor(host_memory, 4), [1, 2, 3, 5]
        if directions.publishes:
            copies.gather(blocks, pages)
            copies.saved()()
            with pytest.raises(RuntimeError, match="kv_role"):
                copies.scatter(pages, blocks)
        else:
            copies.scatter(pages, blocks)
            copies.loaded()
            with pytest.raises(RuntimeError, match="kv_role"):
                copies.gather(blocks, pages)
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
        made.append(WorkerSide(client, vllm_cache(BLOCKS, head_bytes=PAGE_BYTES // BLOCK_TOKENS // 2), BLOCK_TOKENS))
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
