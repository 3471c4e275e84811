"""The connector's publishes: after the forward pass, the pages of each step's completed chunks are copied into arena
slots (on a GPU, on a stream of its own: connector/page_copies.py), then a background thread does the Mooncake put
and the index registration, so the forward never waits on either. The same thread runs the loads' stores into DRAM
of chunks they read straight from NVMe (connector/loaders/), from the slots or pages they were read into, once the
forward pass is over. A job the thread has fallen too far behind for is dropped: those chunks are simply not cached.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Collection, Sequence

import torch

from prefixcache.cachestore.chunks.arena import ArenaFullError
from prefixcache.cachestore.chunks.codec import ChunkMeta
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.io_threads import behind_the_engine
from prefixcache.connector.loaders.base import ArenaWarnings, Store
from prefixcache.connector.metadata import SaveChunk
from prefixcache.connector.page_copies import PageCopies
from prefixcache.connector.pages import payload_view
from prefixcache.connector.transfer_stats import TransferCounts
from prefixcache.indexer.namespace import tenant_id

log = logging.getLogger("prefixcache.connector")
_BACKGROUND_QUEUE = 64


class Publisher:
    def __init__(
        self,
        client: CacheClient,
        layers: Sequence[torch.Tensor],
        pages: Sequence[torch.Tensor],
        copies: PageCopies,
        transfers: TransferCounts,
        warn: ArenaWarnings,
        publishes: bool,
        io_thread_setup: Callable[[], None],
    ) -> None:
        """``layers``: vLLM's KV cache, and ``pages`` its layers' ``page_rows`` (connector/pages.py); ``copies``:
        how pages are gathered; ``transfers``: where publishes are counted; ``warn``: says what the arena's size
        costs; ``publishes``: whether this rank publishes (one whose KV another rank publishes only runs the
        loads' stores); ``io_thread_setup`` runs first in the background thread (connector/io_threads.py)."""
        self.client = client
        self.shard = client.spec.shard
        self.publishes = publishes
        self.published_chunks = 0
        self._layers = layers
        self._pages = pages
        self._copies = copies
        self._transfers = transfers
        self._warn = warn
        # Jobs that move held slots to the store (publishes, stores after disk reads), and those slots.
        self._background: queue.Queue[tuple[Callable[[], object], list[memoryview], Callable[[], None]] | None] = (
            queue.Queue(_BACKGROUND_QUEUE)
        )
        self._thread = threading.Thread(
            target=self._background_loop, args=(io_thread_setup,), name="prefixcache-background", daemon=True
        )
        self._thread.start()

    def store(self, store: Store) -> None:
        """Run a load's store into DRAM in the background, then give back the slots it holds."""
        self._in_background(*store)

    def publish(self, saves: Sequence[SaveChunk], failed_requests: Collection[str]) -> None:
        """Copy the pages of ``saves`` out and publish them in the background, one batch per tenant, but those of
        ``failed_requests``: their loads failed this step, so they computed their new pages over KV that did not
        arrive intact (vLLM recomputes them)."""
        if not self.publishes:
            return
        by_tenant: dict[str | None, list[tuple[ChunkMeta, memoryview]]] = {}
        for chunk in saves:
            if chunk.request in failed_requests:
                continue
            staged = self._stage(chunk)
            if staged is not None:
                by_tenant.setdefault(chunk.tenant_salt, []).append(staged)
        if not by_tenant:
            return
        copied = self._copies.saved()  # a GPU's pages are still on their way into the slots
        for salt, batch in by_tenant.items():
            dropped = functools.partial(self._transfers.add, unpublished_chunks=len(batch))
            self._in_background(functools.partial(self._publish, batch, salt), [s for _, s in batch], copied, dropped)

    def close(self) -> None:
        """Stop the background thread once the jobs queued are over."""
        self._background.put(None)
        self._thread.join(timeout=30)

    def _stage(self, chunk: SaveChunk) -> tuple[ChunkMeta, memoryview] | None:
        pages = len(chunk.blocks)
        meta = ChunkMeta(
            namespace=self.client.spec.digest,
            root=self.client.spec.root(chunk.tenant_salt, chunk.variant),
            parent=chunk.parents[self.shard],
            tokens=chunk.tokens,
            dtype=str(self._layers[0].dtype).removeprefix("torch."),
            shape=(len(self._layers), pages, *self._layers[0].shape[1:]),
            tenant=int(tenant_id(chunk.tenant_salt) or "0", 16),
        )
        try:
            slot = self.client.stage(meta)
        except ArenaFullError:
            self._warn("the arena was full: chunks computed in a step were not published")
            self._transfers.add(unpublished_chunks=1)
            return None
        self._copies.gather(
            chunk.blocks, payload_view(slot[meta.payload_offset : meta.encoded_size], self._pages, pages)
        )
        return meta, slot

    def _publish(self, batch: list[tuple[ChunkMeta, memoryview]], salt: str | None) -> None:
        stored = [False] * len(batch)
        try:
            stored = self.client.publish(batch, tenant_salt=salt)
        finally:
            published = [meta for (meta, _), ok in zip(batch, stored, strict=True) if ok]
            self._transfers.add(
                published_chunks=len(published),
                unpublished_chunks=len(batch) - len(published),
                published_bytes=sum(meta.payload_bytes for meta in published),
            )
            self.published_chunks += len(published)

    def _in_background(
        self,
        job: Callable[[], object],
        slots: list[memoryview],
        copied: Callable[[], None] = lambda: None,
        dropped: Callable[[], None] = lambda: None,
    ) -> None:
        """Run ``job`` on the background thread, then release ``slots``; if it has fallen behind, drop the job
        (and call ``dropped``). ``copied`` waits for copies into the slots still in flight: nothing reads or
        reuses them before."""
        try:
            self._background.put_nowait((job, slots, copied))
        except queue.Full:  # these chunks are simply not cached (or not brought back to DRAM)
            dropped()
            copied()
            for slot in slots:
                self.client.release(slot)

    def _background_loop(self, io_thread_setup: Callable[[], None]) -> None:
        io_thread_setup()
        behind_the_engine()
        while (item := self._background.get()) is not None:
            job, slots, copied = item
            try:
                copied()
                job()
            except Exception:  # noqa: BLE001 - best effort; the forward path never sees it
                log.exception("background store of %d chunks failed", len(slots))
            finally:
                for slot in slots:
                    self.client.release(slot)
