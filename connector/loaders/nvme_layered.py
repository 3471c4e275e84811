"""Chunks only this node's NVMe holds, read from their pack files straight into vLLM's pages, layer by layer, each
attention layer waiting for its own (connector/loaders/layered_reads.py says why and how), and verified behind the
reads. Only where every page lies in the client's shared memory at a 4 KiB boundary, as O_DIRECT needs, and until a
step shows vLLM does not wait for its layers: that step's chunks are recomputed, and NVMe hits are read whole
(through slots) from then on. What arrived intact is stored into DRAM from the pages once the forward pass is over.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.node_requests import ExtentsAsked
from prefixcache.connector.loaders.base import CountLoaded, Store
from prefixcache.connector.loaders.layered_reads import LayeredChunk, LayeredRead
from prefixcache.connector.loaders.layout import KvLayout
from prefixcache.connector.metadata import LoadChunk

log = logging.getLogger("prefixcache.connector")
#: O_DIRECT reads in flight for a load read from NVMe layer by layer (reads of a layer's pages of one chunk,
#: small for small models): a disk moves reads this small much faster with several in flight than one.
_LAYER_READERS = 8


class NvmeLayered:
    def __init__(
        self, layout: KvLayout, count: CountLoaded, io_thread_setup: Callable[[], None], verifier: Executor
    ) -> None:
        """``count``: counts the chunks that arrived intact; ``io_thread_setup`` runs first in each reader thread
        (connector/io_threads.py); ``verifier``: the thread a step's chunks are verified on, behind the DRAM hits
        read in place (``DramInPlace.verifier``)."""
        self._layout = layout
        self._client = layout.client
        self._count = count
        self._verifier = verifier
        self._reads_layered = layout.aligned_for_disk()
        self._readers = ThreadPoolExecutor(
            max_workers=_LAYER_READERS, thread_name_prefix="prefixcache-disk", initializer=io_thread_setup
        )
        self._now: LayeredRead | None = None  # this step's read, which vLLM waits for by layer
        self._verification: Future[Store | None] | None = None

    # -- Loader --------------------------------------------------------------------------------------

    def begin_load(
        self, chunks: list[LoadChunk], asked: Sequence[ExtentsAsked] = ()
    ) -> tuple[LayeredRead | None, list[LoadChunk]]:
        """Start reading NVMe-only chunks from this node's pack files straight into their pages, layer by layer;
        returns that read and the chunks left to load through slots: those whose last block vLLM writes this step,
        those on no disk of this node, of another size than this geometry's, or beyond the arena's room for their
        headers. ``asked``: requests the scheduler side sent for where they lie (``CacheClient.disk_extents``)."""
        if not self._reads_layered or not chunks:
            return None, chunks
        eligible = [chunk for chunk in chunks if not chunk.ends_mid_block]
        left = [chunk for chunk in chunks if chunk.ends_mid_block]
        items: list[LayeredChunk] = []
        trace.mark("locate")
        extents = self._client.disk_extents([chunk.key for chunk in eligible], asked) if eligible else []
        trace.mark("located")
        for chunk, extent in zip(eligible, extents, strict=True):
            if extent is None or extent.length != self._layout.object_bytes(chunk.stored_tokens):
                left.append(chunk)
                continue
            placed, _ = self._layout.in_place([chunk])
            if not placed:
                left.append(chunk)
                continue
            item = placed[0]
            per_layer = len(item.pieces) // self._layout.layers
            layers = [item.pieces[i : i + per_layer] for i in range(0, len(item.pieces), per_layer)]
            candidate = LayeredChunk(chunk, item.slot, item.head, layers, extent)
            if candidate.aligned():
                items.append(candidate)
            else:
                left += self._layout.release([item])
        return (LayeredRead(items, self._readers, _LAYER_READERS) if items else None), left

    def start_load_kv(self, read: LayeredRead, errors: set[int]) -> None:
        """The step's read, which vLLM waits for layer by layer: verified on the verifier thread behind the reads."""
        self._now = read
        self._verification = self._verifier.submit(self.verify, read, errors)

    def wait_for_layer_load(self, layer: int) -> None:
        """Wait for the step's reads of that layer (their verification goes on behind them)."""
        if self._now is not None:
            self._now.wait_layer(layer)

    def finish(self, errors: set[int]) -> Store | None:
        """Wait for the step's verification; returns the store of its intact chunks into DRAM, from their pages."""
        job, self._verification = self._verification, None
        store = job.result() if job is not None else None
        read, self._now = self._now, None
        if read is not None and len(read.waited) < self._layout.layers:
            self._distrust(read, errors)
        return store

    def close(self) -> None:
        self._readers.shutdown(wait=True)

    # -- verification --------------------------------------------------------------------------------

    def verify(self, read: LayeredRead, errors: set[int]) -> Store | None:
        """Verify the chunks ``read`` puts into their pages, behind their reads, layer by layer. Returns the job that
        stores them into DRAM from their pages, with the slots it holds. Never raises: a chunk that fails goes to
        ``errors``."""
        try:
            checks = read.check(self._client.body_check)
            intact = self._client.verify_disk_reads([c.chunk.key for c in read.chunks], checks, read.started)
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("verifying %d chunks read from NVMe failed; recomputing them", len(read.chunks))
            read.settle()
            intact = [False] * len(read.chunks)
        good = [c for c, ok in zip(read.chunks, intact, strict=True) if ok]
        for c, ok in zip(read.chunks, intact, strict=True):
            if not ok:
                errors.update(c.chunk.blocks)
                self._client.release(c.slot)
        self._count([c.chunk for c in good])
        if not good:
            return None
        # After the forward pass, from the pages: vLLM wrote none of them this step (no chunk whose last block
        # it writes is read this way); should it reuse one before the put is over, that copy fails its check.
        store = functools.partial(
            self._client.store_scattered,
            [c.chunk.key for c in good],
            [[c.head, *itertools.chain.from_iterable(c.layers)] for c in good],
        )
        return store, [c.slot for c in good]

    def _distrust(self, read: LayeredRead, errors: set[int]) -> None:
        """A step read chunks layer by layer, but vLLM did not wait for every layer: an attention layer may have
        read its pages before they were in. Its chunks are recomputed, and loads are never read this way again."""
        errors.update(block for c in read.chunks for block in c.chunk.blocks)
        if self._reads_layered:
            self._reads_layered = False
            log.warning(
                "vLLM waited for %d of %d layers of a load read from NVMe layer by layer: recomputing it, "
                "and reading NVMe hits whole from now on",
                len(read.waited),
                self._layout.layers,
            )

    def abandon(self, read: LayeredRead) -> None:
        """Give back the slots of a read that will not be finished, once no read writes into them."""
        read.settle()
        for c in read.chunks:
            self._client.release(c.slot)
