"""Page copies between vLLM-shaped KV tensors and chunk payloads (pure tensor logic, no engine)."""

from __future__ import annotations

import pytest
import torch

from prefixcache.connector.pages import block_runs, gather, page_rows, payload_bytes, payload_view, scatter


def _layers(n_layers: int = 3, blocks: int = 12) -> list[torch.Tensor]:
    return [torch.randn(blocks, 2, 4, 16, 8).to(torch.bfloat16) for _ in range(n_layers)]


def _rows(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [page_rows(layer) for layer in layers]


def test_block_runs_split_at_every_gap():
    assert list(block_runs([4, 5, 6, 9, 2, 3, 7])) == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 7, 1)]
    assert list(block_runs([5])) == [(0, 5, 1)]
    assert list(block_runs([])) == []


def test_page_rows_are_the_bytes_of_each_page_as_they_lie_in_memory():
    # vLLM 0.32 views a layer as logical [B, H, N, C]; FlashAttention's LBNHC lays a block out as [N, H, C]
    physical = torch.randn(6, 16, 4, 8).to(torch.bfloat16)  # [B, N, H, C]
    layer = physical.permute(0, 2, 1, 3)  # what register_kv_caches receives: [B, H, N, C], not contiguous
    rows = page_rows(layer)
    assert rows.shape == (6, 16 * 4 * 8 * 2) and rows.dtype == torch.uint8
    assert torch.equal(rows[3], physical[3].contiguous().view(torch.uint8).flatten())  # memory order, not logical
    rows[2].zero_()  # a view: writing rows writes the layer's page
    assert int(layer[2].count_nonzero()) == 0 and int(layer[1].count_nonzero()) > 0


def test_page_rows_of_layers_interleaved_block_by_block():
    # a cross-layer layout (BLHNC): block b of every layer, then block b + 1
    both = torch.randn(5, 2, 4, 16, 8).to(torch.bfloat16)  # [B, L, H, N, C]
    rows = page_rows(both[:, 1])
    assert rows.stride(0) == 2 * 4 * 16 * 8 * 2
    assert torch.equal(rows[4], both[4, 1].contiguous().view(torch.uint8).flatten())


def test_a_layout_that_splits_pages_is_refused_with_the_way_out():
    heads_outside = torch.zeros(4, 6, 16, 8).permute(1, 0, 2, 3)  # LHBNC: [H, B, N, C] in memory
    with pytest.raises(ValueError, match="VLLM_KV_CACHE_LAYOUT"):
        page_rows(heads_outside)


def test_gather_then_scatter_moves_exactly_the_named_pages():
    source, target = _layers(), _layers()
    untouched = [layer.clone() for layer in target]
    blocks_a, blocks_b = [7, 8, 2, 10], [0, 1, 5, 11]
    buffer = bytearray(payload_bytes(_rows(source), len(blocks_a)))
    payload = payload_view(memoryview(buffer), _rows(source), len(blocks_a))
    gather(_rows(source), blocks_a, payload)
    scatter(payload, _rows(target), blocks_b)
    for src, dst, before in zip(source, target, untouched, strict=True):
        for a, b in zip(blocks_a, blocks_b, strict=True):
            assert torch.equal(dst[b].view(torch.uint8), src[a].view(torch.uint8))
        others = [i for i in range(len(dst)) if i not in blocks_b]
        assert torch.equal(dst[others], before[others])  # no other page changed


def test_scatter_places_a_partial_chunk_from_a_later_page():
    source, target = _layers(), _layers()
    buffer = bytearray(payload_bytes(_rows(source), 3))
    payload = payload_view(memoryview(buffer), _rows(source), 3)
    gather(_rows(source), [3, 4, 5], payload)
    scatter(payload[:, 1:], _rows(target), [9, 10])  # the local cache already holds the chunk's first page
    for src, dst in zip(source, target, strict=True):
        assert torch.equal(dst[9:11], src[4:6])
