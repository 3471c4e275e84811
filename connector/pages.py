"""Copies between vLLM's paged KV tensors and a chunk's payload, whole pages at a time, as raw bytes.

A page (one block of one layer) is copied as opaque bytes, in the order it lies in memory: the CPU
attention backend stores K and V per head in an instruction-set-specific order, and vLLM 0.32 views
every layer as a logical ``[B, H, N, C]`` tensor whose physical order its ``KVCacheLayout`` picks
(``LBNHC`` for FlashAttention), so a copy in logical order would be wrong on the CPU and would
transpose every page on a GPU. The namespace's layout names the backend and vLLM's layout, so only
caches that lay pages out alike share them.
Copying a partly filled last page whole is safe: vLLM recomputes every position past the loaded
prefix before attention reads it.

Pages move in runs of consecutive block ids, one ``copy_`` per run and layer: a fresh request's
blocks are mostly consecutive, and a plain slice copy runs at memcpy speed where ``index_copy_`` /
``index_select`` ran several times slower on this machine's bf16 pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def page_rows(layer: torch.Tensor) -> torch.Tensor:
    """``layer`` as ``(blocks, page bytes)`` uint8 rows over its own memory (no copy).

    Refuses a layout that splits a block's page into several runs of memory (vLLM's ``LHBNC``, where
    heads lie outside blocks): whole-page copies cannot move it."""
    page = layer[0]
    order = sorted(range(page.dim()), key=page.stride, reverse=True)
    if not page.permute(order).is_contiguous():
        raise ValueError(
            f"a KV page of shape {tuple(page.shape)} with strides {page.stride()} is not one run of memory: the "
            "connector moves whole pages; set VLLM_KV_CACHE_LAYOUT to a layout whose blocks are compact (LBNHC)"
        )
    size = layer.element_size()
    return torch.as_strided(
        layer.view(torch.uint8),
        (layer.shape[0], page.numel() * size),
        (layer.stride(0) * size, 1),
        layer.storage_offset() * size,
    )


def payload_view(buffer: memoryview, pages: Sequence[torch.Tensor], num_pages: int) -> torch.Tensor:
    """The payload bytes as (layers, pages, page bytes), ``pages`` being the layers' ``page_rows`` (no copy)."""
    return torch.frombuffer(buffer, dtype=torch.uint8).view(len(pages), num_pages, pages[0].shape[1])


def payload_bytes(pages: Sequence[torch.Tensor], num_pages: int) -> int:
    return len(pages) * num_pages * pages[0].shape[1]


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(position in blocks, first block id, length)`` for each run of consecutive block ids."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i


def gather(pages: Sequence[torch.Tensor], blocks: Sequence[int], out: torch.Tensor, non_blocking: bool = False) -> None:
    """Copy pages ``blocks`` of every layer's ``page_rows`` into ``out`` (layers, len(blocks), page bytes);
    ``non_blocking``: device pages are queued on the current stream (benchmarks/cuda_copies.py)."""
    for at, block, n in block_runs(blocks):
        for layer, dst in zip(pages, out, strict=True):
            dst[at : at + n].copy_(layer[block : block + n], non_blocking=non_blocking)


def scatter(
    src: torch.Tensor, pages: Sequence[torch.Tensor], blocks: Sequence[int], non_blocking: bool = False
) -> None:
    """Copy the first ``len(blocks)`` pages of ``src`` into pages ``blocks`` of every layer's ``page_rows``."""
    for at, block, n in block_runs(blocks):
        for layer, rows in zip(pages, src, strict=True):
            layer[block : block + n].copy_(rows[at : at + n], non_blocking=non_blocking)
