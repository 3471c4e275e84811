"""The connector's worker side: scatter fetched chunks into vLLM's pages, gather new chunks out of them.

Loads run before the forward pass (vLLM schedules them as synchronous loads); a chunk that cannot be
fetched or fails verification reports its blocks as load errors and vLLM recomputes from there.
Publishing copies the new chunks' pages into arena slots after the forward pass, then a background
thread does the Mooncake put and the index registration, so the forward never waits on either. The
same thread stores chunks a load read straight from NVMe into DRAM, from the slots they were read
into, once the forward pass is over.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from cachestore.arena import ArenaFullError
from cachestore.client import CacheClient
from cachestore.codec import ChunkMeta, payload_offset
from cachestore.nvme import read_size
from cachestore.runs import runs_of_about
from connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from connector.pages import gather, payload_bytes, payload_view, scatter
from indexer.namespace import tenant_id

log = logging.getLogger("prefixcache.connector")
_BACKGROUND_QUEUE = 64
#: Bytes fetched per Mooncake call while loading: small enough that reading the next group overlaps
#: placing this one, large enough that per-call overhead stays small.
LOAD_GROUP_BYTES = 8 << 20


@dataclass
class _Fetched:
    """One group's verified payloads (None: recompute), and the objects among them read from NVMe."""

    payloads: list[memoryview | None]
    from_disk: dict[bytes, memoryview] = field(default_factory=dict)


class WorkerSide:
    def __init__(self, client: CacheClient, layers: Sequence[torch.Tensor], block_tokens: int,
                 io_thread_setup: Callable[[], None] | None = None) -> None:  # fmt: skip
        """``io_thread_setup`` runs first in each thread this side starts (see connector/io_threads.py)."""
        self.client = client
        self._io_thread_setup = io_thread_setup or (lambda: None)
        self.layers = list(layers)
        self.block_tokens = block_tokens
        self.load_errors: set[int] = set()
        self.loaded_chunks = 0
        self.published_chunks = 0
        # Jobs that move held slots to the store (publishes, stores after disk reads), and those slots.
        self._background: queue.Queue[tuple[Callable[[], object], list[memoryview]] | None] = queue.Queue(
            _BACKGROUND_QUEUE
        )
        self._background_thread = threading.Thread(
            target=self._background_loop, name="prefixcache-background", daemon=True
        )
        self._background_thread.start()
        # Stores into DRAM of what this step's load read from NVMe, started after the forward pass.
        self._after_forward: list[tuple[Callable[[], object], list[memoryview]]] = []
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-fetch",
                                           initializer=self._io_thread_setup)  # fmt: skip

    # -- loads ---------------------------------------------------------------------------------------

    def load(self, meta: PrefixCacheMetadata) -> None:
        """Fetch this step's chunks in groups, placing one group while the next is read.

        The segment owner (another process) copies a group into the arena while this thread places
        the previous one, so the load costs about one pass over the bytes, not two. Every chunk's slot
        is taken up front and each fetch names the chunks still to come with their slots: chunks that
        must come back from this node's NVMe are read into place ahead of their turn, and those on
        other nodes are asked for in one request. Slots holding chunks read from NVMe are kept, and
        stored into DRAM after the forward pass.
        """
        chunks = [chunk for chunks in meta.loads.values() for chunk in chunks]
        if not chunks:
            return
        slots = self._slots(chunks)
        for chunk in chunks[len(slots) :]:
            self.load_errors.update(chunk.blocks)
        upcoming = [(chunk.key, slot) for chunk, slot in zip(chunks, slots, strict=False)]
        groups = runs_of_about(upcoming, lambda pair: len(pair[1]), LOAD_GROUP_BYTES)
        ends = list(itertools.accumulate(len(group) for group in groups))
        read_from_disk: dict[bytes, memoryview] = {}
        pending = self._fetcher.submit(self._fetch, groups[0], upcoming[ends[0] :]) if groups else None
        try:
            for i, group in enumerate(groups):
                fetched = pending.result()  # type: ignore[union-attr] # one is in flight per group left
                pending = None
                if i + 1 < len(groups):
                    pending = self._fetcher.submit(self._fetch, groups[i + 1], upcoming[ends[i + 1] :])
                read_from_disk.update(fetched.from_disk)
                self._place(chunks[ends[i] - len(group) : ends[i]], fetched.payloads)
        finally:
            if pending is not None:
                pending.exception()  # the fetch in flight must finish before its slots are released
            self.client.settle_reads()
            held = [slot for (key, slot) in upcoming if key in read_from_disk]
            for key, slot in upcoming:
                if key not in read_from_disk:
                    self.client.release(slot)
        if held:
            self._after_forward.append((functools.partial(self.client.store_disk_reads, list(read_from_disk.items())),
                                        held))  # fmt: skip

    def _slots(self, chunks: list[LoadChunk]) -> list[memoryview]:
        """An arena slot for each chunk, in order, while the arena has room (the rest are recomputed)."""
        slots: list[memoryview] = []
        try:
            for chunk in chunks:
                slots.append(self.client.slot(read_size(self._object_bytes(chunk.stored_tokens))))
        except ArenaFullError:
            log.warning("arena full: recomputing instead of loading %d chunks", len(chunks) - len(slots))
        return slots

    def _fetch(self, group: list[tuple[bytes, memoryview]], upcoming: list[tuple[bytes, memoryview]]) -> _Fetched:
        """Fetch one group into its slots; runs on the fetch thread."""
        fetched = _Fetched(payloads=[None] * len(group))
        try:
            fetched.payloads = self.client.fetch([key for key, _ in group], [slot for _, slot in group],
                                                 upcoming=upcoming)  # fmt: skip
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks failed; recomputing them", len(group))
        fetched.from_disk = dict(self.client.take_disk_reads())
        return fetched

    def _place(self, chunks: list[LoadChunk], payloads: list[memoryview | None]) -> None:
        for chunk, payload in zip(chunks, payloads, strict=True):
            pages = self._pages(chunk.stored_tokens)
            if payload is None or len(payload) != payload_bytes(self.layers, pages):
                self.load_errors.update(chunk.blocks)
                continue
            src = payload_view(payload, self.layers, pages)[:, chunk.first_page :]
            scatter(src, self.layers, chunk.blocks)
            self.loaded_chunks += 1

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # -- publishes -----------------------------------------------------------------------------------

    def save(self, meta: PrefixCacheMetadata) -> None:
        """After the forward pass: copy the pages of this step's completed chunks out and publish them in
        the background, where the chunks this step's load read from NVMe are stored into DRAM too."""
        for job, slots in self._after_forward:
            self._in_background(job, slots)
        self._after_forward = []
        by_tenant: dict[str | None, list[tuple[ChunkMeta, memoryview]]] = {}
        for chunk in meta.saves:
            staged = self._stage(chunk)
            if staged is not None:
                by_tenant.setdefault(chunk.tenant_salt, []).append(staged)
        for salt, batch in by_tenant.items():
            self._in_background(functools.partial(self._publish, batch, salt), [slot for _, slot in batch])

    def _stage(self, chunk: SaveChunk) -> tuple[ChunkMeta, memoryview] | None:
        pages = len(chunk.blocks)
        meta = ChunkMeta(
            namespace=self.client.spec.digest, root=self.client.spec.root(chunk.tenant_salt), parent=chunk.parent,
            tokens=chunk.tokens, dtype=str(self.layers[0].dtype).removeprefix("torch."),
            shape=(len(self.layers), pages, *self.layers[0].shape[1:]),
            tenant=int(tenant_id(chunk.tenant_salt) or "0", 16),
        )  # fmt: skip
        try:
            slot = self.client.stage(meta)
        except ArenaFullError:
            return None
        gather(
            self.layers, chunk.blocks, payload_view(slot[meta.payload_offset : meta.encoded_size], self.layers, pages)
        )
        return meta, slot

    def _publish(self, batch: list[tuple[ChunkMeta, memoryview]], salt: str | None) -> None:
        self.published_chunks += sum(self.client.publish(batch, tenant_salt=salt))

    # -- background ----------------------------------------------------------------------------------

    def _in_background(self, job: Callable[[], object], slots: list[memoryview]) -> None:
        """Run ``job`` on the background thread, then release ``slots``; if it has fallen behind, drop the job."""
        try:
            self._background.put_nowait((job, slots))
        except queue.Full:  # these chunks are simply not cached (or not brought back to DRAM)
            for slot in slots:
                self.client.release(slot)

    def _background_loop(self) -> None:
        self._io_thread_setup()
        while (item := self._background.get()) is not None:
            job, slots = item
            try:
                job()
            except Exception:  # noqa: BLE001 - best effort; the forward path never sees it
                log.exception("background store of %d chunks failed", len(slots))
            finally:
                for slot in slots:
                    self.client.release(slot)

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)
        for _, slots in self._after_forward:
            for slot in slots:
                self.client.release(slot)
        self._background.put(None)
        self._background_thread.join(timeout=30)
        self.client.close()

    # -- sizes ---------------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _object_bytes(self, stored_tokens: int) -> int:
        return payload_offset(stored_tokens) + payload_bytes(self.layers, self._pages(stored_tokens))
