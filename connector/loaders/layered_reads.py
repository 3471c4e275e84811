"""NVMe-only chunks read from this node's pack files straight into vLLM's pages, layer by layer.

Why: through arena slots, an NVMe-only hit read every chunk into a slot, verified it and copied it into its
pages before the forward pass began, so the disk's time and the forward pass's, of the same order for
a long prompt, added up. Each object holds its payload layer by layer
from a 4 KiB boundary (cachestore/chunks/codec.py), and the NVMe tier stores objects at 4 KiB
boundaries of its pack files, so one layer's pages of a chunk are one aligned range of its file: a single
O_DIRECT ``preadv`` puts them into their pages (and the scratch for pages the load does not take). The reads
go out layer by layer; vLLM's ``wait_for_layer_load``, which each attention layer calls before it reads its
KV, waits for its layer's reads only, so the forward pass computes layer i while layer i + 1 is read. A
verifier streams each chunk's MAC behind the reads (``BodyCheck``), and its verdict is in before
vLLM asks for load errors, as for DRAM hits read in place: KV that fails it is recomputed, its step's output
dropped.

vLLM writes a step's new keys and values into a layer's pages before that layer waits, so a chunk whose
last block receives them (``LoadChunk.ends_mid_block``) is never read this way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from prefixcache.cachestore.chunks.codec import BodyCheck, ChunkError
from prefixcache.cachestore.client import trace
from prefixcache.cachestore.tiers.nvme_io import PAGE, Extent, open_for_reading, page_aligned, read_pieces
from prefixcache.connector.metadata import LoadChunk

log = logging.getLogger("prefixcache.connector")


@dataclass
class LayeredChunk:
    """One chunk to read: its arena slot (header and tokens at ``head``, then scratch for the pages the load
    does not take), where each layer's part of its payload goes, in payload order, and where it lies on disk."""

    chunk: LoadChunk
    slot: memoryview
    head: memoryview
    layers: list[list[memoryview]]
    extent: Extent

    def aligned(self) -> bool:
        """Whether O_DIRECT can read it: every piece at a 4 KiB-aligned address, of a multiple of 4 KiB."""
        views = [self.head, *(piece for layer in self.layers for piece in layer)]
        return self.extent.offset % PAGE == 0 and all(page_aligned(view) and len(view) % PAGE == 0 for view in views)


class LayeredRead:
    """The reads of one load, in the order they go out: layer 0 of every chunk, each in one read with the
    chunk's header and tokens that lie just before it, then layer 1 of every chunk, and so on. ``parallel``
    tasks on ``readers`` take them from one queue in that order.

    Why one queue rather than a future per read: a long hit is hundreds of reads, and submitting each to the pool
    held up the worker's thread (one future, one lock and one thread wake-up per read, beside the
    readers already holding the GIL) before the forward pass could begin. Each layer counts down instead.

    Why each header rides with its layer 0 (they are contiguous on disk): the forward pass waits for layer 0
    alone (later layers are read while earlier ones compute), and headers read on their own first would hold
    its reads back, so layer 0 arrives sooner with each header in its read (docs/decisions.md, "NVMe-only
    chunks are read into the pages layer by layer")."""

    def __init__(self, chunks: Sequence[LayeredChunk], readers: Executor, parallel: int) -> None:
        self.chunks = list(chunks)
        self.started = time.perf_counter()
        self.waited: set[int] = set()  # layers vLLM waited for
        self._fds: dict[str, int] = {}
        fds = [self._open(c.extent.path) for c in self.chunks]
        # stage i: layer i, stage 0 with the header and tokens before it. Per stage, per chunk: (fd, views, offset).
        self._stages = [[(fd, [c.head, *c.layers[0]], c.extent.offset) for c, fd in zip(self.chunks, fds, strict=True)]]
        for layer in range(1, len(self.chunks[0].layers) if self.chunks else 0):
            self._stages.append(
                [
                    (
                        fd,
                        c.layers[layer],
                        c.extent.offset + len(c.head) + layer * sum(len(piece) for piece in c.layers[layer]),
                    )
                    for c, fd in zip(self.chunks, fds, strict=True)
                ]
            )
        self._read = [[False] * len(self.chunks) for _ in self._stages]  # whether each read got every byte
        self._left = [len(self.chunks)] * len(self._stages)
        self._landed = threading.Condition()
        self._queue = deque((stage, at) for stage in range(len(self._stages)) for at in range(len(self.chunks)))
        for _ in range(min(parallel, len(self._queue))):
            readers.submit(self._drain)

    def wait_layer(self, layer: int) -> None:
        """Block until every chunk's part of ``layer`` is in its pages (read, not verified yet)."""
        self._wait(layer)
        self.waited.add(layer)

    def check(self, body_check: Callable[[bytes, memoryview], BodyCheck]) -> list[BodyCheck | ChunkError]:
        """Per chunk, its ``BodyCheck`` (``body_check(key, head)``, ``CacheClient.body_check``) fed its whole payload
        as the layers arrive, or why it failed before; waits for every read, then closes the files."""
        checks: list[BodyCheck | ChunkError] = []
        self._wait(0)
        for c, read in zip(self.chunks, self._read[0], strict=True):
            try:
                if not read:
                    raise ChunkError("its header and layer 0 could not be read from disk")
                checks.append(body_check(c.chunk.key, c.head))
            except ChunkError as exc:
                checks.append(exc)
        for layer in range(len(self._stages)):
            self._wait(layer)
            for at, (c, read) in enumerate(zip(self.chunks, self._read[layer], strict=True)):
                check = checks[at]
                if not isinstance(check, BodyCheck):
                    continue  # failed already, and says why
                if not read:
                    checks[at] = ChunkError(f"layer {layer} could not be read from disk")
                else:
                    for piece in c.layers[layer]:
                        check.update(piece)
        self._close()
        return checks

    def settle(self) -> None:
        """Wait for every read (none may still write into slots given back or pages handed over), then close."""
        for stage in range(len(self._stages)):
            self._wait(stage)
        self._close()

    def _drain(self) -> None:
        """One reader: take reads off the queue, in order, until it is empty."""
        while True:
            try:
                stage, at = self._queue.popleft()
            except IndexError:
                return
            fd, views, offset = self._stages[stage][at]
            try:
                read = fd >= 0 and read_pieces(fd, views, offset)
            except Exception:  # noqa: BLE001 - a failed read is a miss, and the waits must still end
                log.exception("reading a chunk's layer from disk failed")
                read = False
            with self._landed:
                self._read[stage][at] = read
                self._left[stage] -= 1
                if self._left[stage] == 0:
                    if stage == 0:
                        trace.mark("first_layer_in")
                    self._landed.notify_all()

    def _wait(self, stage: int) -> None:
        with self._landed:
            self._landed.wait_for(lambda: self._left[stage] == 0)

    def _open(self, path: str) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = open_for_reading(path)
            except OSError:
                self._fds[path] = -1  # gone since it was located: every read of it fails, a miss
        return self._fds[path]

    def _close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            if fd >= 0:
                os.close(fd)
