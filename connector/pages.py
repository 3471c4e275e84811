"""Copies between vLLM's paged KV tensors and a chunk's payload, whole pages at a time.

A page (one block of one layer) is copied as opaque bytes: the CPU attention backend stores K and V
per head in an instruction-set-specific order, so a token-by-token copy would be wrong there.
Copying a partly filled last page whole is safe: vLLM recomputes every position past the loaded
prefix before attention reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def payload_view(buffer: memoryview, layers: Sequence[torch.Tensor], num_pages: int) -> torch.Tensor:
    """The payload bytes as a (layers, pages, *page shape) tensor of the cache's dtype (no copy)."""
    first = layers[0]
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(first.dtype).view(len(layers), num_pages, *first.shape[1:])


def payload_bytes(layers: Sequence[torch.Tensor], num_pages: int) -> int:
    first = layers[0]
    return len(layers) * num_pages * first[0].numel() * first.element_size()


def gather(layers: Sequence[torch.Tensor], blocks: list[int], out: torch.Tensor) -> None:
    """Copy pages ``blocks`` of every layer into ``out`` (layers, len(blocks), ...)."""
    index = torch.tensor(blocks, dtype=torch.long, device=layers[0].device)
    for layer, dst in zip(layers, out, strict=True):
        if dst.device == layer.device:
            torch.index_select(layer, 0, index, out=dst)
        else:  # device cache -> host arena
            dst.copy_(layer.index_select(0, index))


def scatter(src: torch.Tensor, layers: Sequence[torch.Tensor], blocks: list[int]) -> None:
    """Copy the first ``len(blocks)`` pages of ``src`` into pages ``blocks`` of every layer."""
    index = torch.tensor(blocks, dtype=torch.long, device=layers[0].device)
    for layer, pages in zip(layers, src, strict=True):
        layer.index_copy_(0, index, pages[: len(blocks)].to(layer.device, non_blocking=False))
