"""Page copies between vLLM-shaped KV tensors and chunk payloads (pure tensor logic, no engine)."""

from __future__ import annotations

import torch

from connector.pages import block_runs, gather, payload_bytes, payload_view, scatter


def _layers(n_layers: int = 3, blocks: int = 12) -> list[torch.Tensor]:
    return [torch.randn(blocks, 2, 4, 16, 8).to(torch.bfloat16) for _ in range(n_layers)]


def test_block_runs_split_at_every_gap():
    assert list(block_runs([4, 5, 6, 9, 2, 3, 7])) == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 7, 1)]
    assert list(block_runs([5])) == [(0, 5, 1)]
    assert list(block_runs([])) == []


def test_gather_then_scatter_moves_exactly_the_named_pages():
    source, target = _layers(), _layers()
    untouched = [layer.clone() for layer in target]
    blocks_a, blocks_b = [7, 8, 2, 10], [0, 1, 5, 11]
    buffer = bytearray(payload_bytes(source, len(blocks_a)))
    payload = payload_view(memoryview(buffer), source, len(blocks_a))
    gather(source, blocks_a, payload)
    scatter(payload, target, blocks_b)
    for src, dst, before in zip(source, target, untouched, strict=True):
        for a, b in zip(blocks_a, blocks_b, strict=True):
            assert torch.equal(dst[b].view(torch.uint8), src[a].view(torch.uint8))
        others = [i for i in range(len(dst)) if i not in blocks_b]
        assert torch.equal(dst[others], before[others])  # no other page changed


def test_scatter_places_a_partial_chunk_from_a_later_page():
    source, target = _layers(), _layers()
    buffer = bytearray(payload_bytes(source, 3))
    payload = payload_view(memoryview(buffer), source, 3)
    gather(source, [3, 4, 5], payload)
    scatter(payload[:, 1:], target, [9, 10])  # the local cache already holds the chunk's first page
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[9:11], src[4:6])
