"""vLLM's KV cache as the loaders see it: each layer's pages, the sizes of a chunk's object and payload, and, when
the cache lies in the client's shared memory, where each piece of a chunk read straight into its pages goes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from prefixcache.cachestore.chunks.arena import ArenaFullError, address_of
from prefixcache.cachestore.chunks.codec import payload_offset
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.tiers.dram import split_at
from prefixcache.cachestore.tiers.nvme_io import PAGE
from prefixcache.connector.metadata import LoadChunk
from prefixcache.connector.pages import block_runs, payload_bytes


@dataclass
class InPlace:
    """A chunk read straight into its pages: its arena slot (header and tokens, then scratch for the
    pages it does not load) and where each piece of its payload goes, in order."""

    chunk: LoadChunk
    slot: memoryview
    pieces: list[memoryview]
    # (held in the slot, its page) per layer, for the last block of a chunk whose last block vLLM writes this step
    held_pages: list[tuple[memoryview, memoryview]] = field(default_factory=list)

    @property
    def head(self) -> memoryview:
        return self.slot[: payload_offset(self.chunk.stored_tokens)]


class KvLayout:
    """The KV cache's layers as ``pages`` (each ``(blocks, page bytes)`` rows: connector/pages.py) of
    ``block_tokens`` tokens, and ``kv``: one view of them all when every layer's pages lie in the client's shared
    memory (the connector allocated them there, on the CPU backend), one after another; else None."""

    def __init__(self, client: CacheClient, pages: Sequence[torch.Tensor], block_tokens: int) -> None:
        self.client = client
        self.pages = list(pages)
        self.layers = len(self.pages)
        self.block_tokens = block_tokens
        self.page_bytes = self.pages[0].shape[1]
        self.layer_starts: list[int] = []  # where each layer's block 0 lies in self.kv
        self.kv = self._pages_in_shared_memory()

    def _pages_in_shared_memory(self) -> memoryview | None:
        page = self.page_bytes
        if any(rows.device.type != "cpu" or rows.stride(0) != page for rows in self.pages):
            return None
        low = min(rows.data_ptr() for rows in self.pages)
        high = max(rows.data_ptr() + rows.shape[0] * page for rows in self.pages)
        view = self.client.shared_view(low, high - low)
        if view is not None:
            self.layer_starts = [rows.data_ptr() - low for rows in self.pages]
        return view

    def aligned_for_disk(self) -> bool:
        """Whether every page lies in shared memory at a 4 KiB boundary, as O_DIRECT reads into it need."""
        base = address_of(self.kv) if self.kv is not None else None
        return (
            base is not None
            and self.page_bytes % PAGE == 0
            and all((base + start) % PAGE == 0 for start in self.layer_starts)
        )

    # -- sizes ---------------------------------------------------------------------------------------

    def pages_of(self, tokens: int) -> int:
        """Pages (blocks) that ``tokens`` tokens fill."""
        return -(-tokens // self.block_tokens)

    def object_bytes(self, stored_tokens: int) -> int:
        return payload_offset(stored_tokens) + payload_bytes(self.pages, self.pages_of(stored_tokens))

    def dram_cut(self, stored_tokens: int) -> int | None:
        """Where the DRAM copy of a chunk of ``stored_tokens`` tokens is cut (one payload row per layer)."""
        return split_at(
            payload_offset(stored_tokens), self.layers, payload_bytes(self.pages, self.pages_of(stored_tokens))
        )

    # -- chunks read in place ------------------------------------------------------------------------

    def in_place(
        self, chunks: list[LoadChunk], hold_blocks_vllm_writes: bool = False
    ) -> tuple[list[InPlace], list[LoadChunk]]:
        """An arena slot per chunk for its header, tokens and the pages it does not load; chunks the
        arena has no room for come second, to go through slots (where they will likely be recomputed).
        ``hold_blocks_vllm_writes``: a chunk whose last block vLLM writes this step (while the forward pass
        runs) holds that block's pages in its slot too (see ``DramInPlace``, connector/loaders/dram_in_place.py)."""
        placed: list[InPlace] = []
        elsewhere: list[LoadChunk] = []
        for chunk in chunks:
            hold_last = chunk.ends_mid_block and hold_blocks_vllm_writes
            scratch_pages = (self.pages_of(chunk.stored_tokens) - len(chunk.blocks) + hold_last) * self.layers
            try:
                slot = self.client.slot(payload_offset(chunk.stored_tokens) + scratch_pages * self.page_bytes)
            except ArenaFullError:
                elsewhere.append(chunk)
                continue
            placed.append(self._pieces(chunk, slot, hold_last))
        return placed, elsewhere

    def _pieces(self, chunk: LoadChunk, slot: memoryview, hold_last: bool) -> InPlace:
        """Where each part of the chunk's payload goes, in payload order (layer by layer, page by page):
        runs of the chunk's blocks, and the scratch after its header in ``slot`` for pages it does not
        load (vLLM's own prefix cache holds them, or they lie past the request's blocks) and, with
        ``hold_last``, for its last block's pages until they are verified."""
        pages, page = self.pages_of(chunk.stored_tokens), self.page_bytes
        before, after = chunk.first_page, pages - chunk.first_page - len(chunk.blocks)
        scratch = slot[payload_offset(chunk.stored_tokens) :]
        direct = chunk.blocks[:-1] if hold_last else chunk.blocks
        runs = [(block, n) for _, block, n in block_runs(direct)]  # the same for every layer
        item = InPlace(chunk, slot, [])
        for start in self.layer_starts:
            assert self.kv is not None  # layer_starts are set with it (_pages_in_shared_memory)
            if before:
                item.pieces.append(scratch[: before * page])
                scratch = scratch[before * page :]
            item.pieces.extend(self.kv[start + block * page : start + (block + n) * page] for block, n in runs)
            if hold_last:
                held, scratch = scratch[:page], scratch[page:]
                last = start + chunk.blocks[-1] * page
                item.pieces.append(held)
                item.held_pages.append((held, self.kv[last : last + page]))
            if after:
                item.pieces.append(scratch[: after * page])
                scratch = scratch[after * page :]
        return item

    def release(self, items: list[InPlace]) -> list[LoadChunk]:
        """Give back the slots of ``items``; returns their chunks."""
        for item in items:
            self.client.release(item.slot)
        return [item.chunk for item in items]
