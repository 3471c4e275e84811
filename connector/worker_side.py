"""The connector's worker side: scatter fetched chunks into vLLM's pages, gather new chunks out of them.

Loads run before the forward pass (vLLM schedules them as synchronous loads); a chunk that cannot be
fetched or fails verification reports its blocks as load errors and vLLM recomputes from there.
Publishing copies the new chunks' pages into arena slots after the forward pass, then a background
thread does the Mooncake put and the index registration, so the forward never waits on either. The
same thread stores chunks a load read straight from NVMe into DRAM, from the slots they were read
into, once the load is done.
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
    """One group's arena slots, verified payloads (None: recompute), and the objects read from NVMe."""

    slots: list[memoryview]
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
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-fetch",
                                           initializer=self._io_thread_setup)  # fmt: skip

    # -- loads ---------------------------------------------------------------------------------------

    def load(self, meta: PrefixCacheMetadata) -> None:
        """Fetch this step's chunks in groups, placing one group while the next is read.

        The segment owner (another process) copies a group into the arena while this thread verifies
        and places the previous one, so the load costs about one pass over the bytes, not two. Each
        fetch names the chunks still to come, so chunks that must come back from NVMe are located or
        asked for in one request as soon as the first of them is missed. Slots holding chunks read
        straight from NVMe are kept after placing, and stored into DRAM once the load is done.
        """
        groups = self._groups([chunk for chunks in meta.loads.values() for chunk in chunks])
        if not groups:
            return
        keys = [chunk.key for group in groups for chunk in group]
        ends = list(itertools.accumulate(len(group) for group in groups))
        read_from_disk: list[tuple[bytes, memoryview]] = []
        held: list[memoryview] = []
        pending = self._fetcher.submit(self._fetch, groups[0], keys[ends[0] :])
        for i, group in enumerate(groups):
            fetched = pending.result()
            if i + 1 < len(groups):
                pending = self._fetcher.submit(self._fetch, groups[i + 1], keys[ends[i + 1] :])
            try:
                self._place(group, fetched.payloads)
            finally:
                for chunk, slot in zip(group, fetched.slots, strict=False):
                    if chunk.key in fetched.from_disk:
                        read_from_disk.append((chunk.key, fetched.from_disk[chunk.key]))
                        held.append(slot)
                    else:
                        self.client.release(slot)
        if held:
            self._in_background(functools.partial(self.client.store_disk_reads, read_from_disk), held)

    def _groups(self, chunks: list[LoadChunk]) -> list[list[LoadChunk]]:
        return runs_of_about(chunks, lambda chunk: self._object_bytes(chunk.stored_tokens), LOAD_GROUP_BYTES)

    def _fetch(self, chunks: list[LoadChunk], upcoming: list[bytes]) -> _Fetched:
        """Fetch one group into new arena slots; runs on the fetch thread."""
        fetched = _Fetched(slots=[], payloads=[None] * len(chunks))
        try:
            for chunk in chunks:
                fetched.slots.append(self.client.slot(read_size(self._object_bytes(chunk.stored_tokens))))
            fetched.payloads = self.client.fetch([c.key for c in chunks], fetched.slots, upcoming=upcoming)
        except ArenaFullError:
            log.warning("arena full: recomputing instead of loading %d chunks", len(chunks))
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks failed; recomputing them", len(chunks))
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
        """Copy the pages of this step's completed chunks out now; publish them in the background."""
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
        self._background.put(None)
        self._background_thread.join(timeout=30)
        self.client.close()

    # -- sizes ---------------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _object_bytes(self, stored_tokens: int) -> int:
        return payload_offset(stored_tokens) + payload_bytes(self.layers, self._pages(stored_tokens))
