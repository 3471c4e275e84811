"""Copies between vLLM's paged KV tensors and a chunk's payload, whole pages at a time.

A page (one block of one layer) is copied as opaque bytes: the CPU attention backend stores K and V
per head in an instruction-set-specific order, so a token-by-token copy would be wrong there.
Copying a partly filled last page whole is safe: vLLM recomputes every position past the loaded
prefix before attention reads it.

Pages move in runs of consecutive block ids, one ``copy_`` per run and layer: a fresh request's
blocks are mostly consecutive, and a plain slice copy runs at memcpy speed where ``index_copy_`` /
``index_select`` ran several times slower on this machine's bf16 pages.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def payload_view(buffer: memoryview, layers: Sequence[torch.Tensor], num_pages: int) -> torch.Tensor:
    """The payload bytes as a (layers, pages, *page shape) tensor of the cache's dtype (no copy)."""
    first = layers[0]
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(first.dtype).view(len(layers), num_pages, *first.shape[1:])


def payload_bytes(layers: Sequence[torch.Tensor], num_pages: int) -> int:
    first = layers[0]
    return len(layers) * num_pages * first[0].numel() * first.element_size()


def block_runs(blocks: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """``(position in blocks, first block id, length)`` for each run of consecutive block ids."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i


def gather(
    layers: Sequence[torch.Tensor], blocks: Sequence[int], out: torch.Tensor, non_blocking: bool = False
) -> None:
    """Copy pages ``blocks`` of every layer into ``out`` (layers, len(blocks), ...); device pages land on the
    host (``non_blocking``: queued on the current stream, see connector/page_copies.py)."""
    for at, block, n in block_runs(blocks):
        for layer, dst in zip(layers, out, strict=True):
            dst[at : at + n].copy_(layer[block : block + n], non_blocking=non_blocking)


def scatter(
    src: torch.Tensor, layers: Sequence[torch.Tensor], blocks: Sequence[int], non_blocking: bool = False
) -> None:
    """Copy the first ``len(blocks)`` pages of ``src`` into pages ``blocks`` of every layer."""
    for at, block, n in block_runs(blocks):
        for layer, pages in zip(layers, src, strict=True):
            layer[block : block + n].copy_(pages[at : at + n], non_blocking=non_blocking)
