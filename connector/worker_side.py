"""The connector's worker side: which of a step's chunks go to which loader, the step's load errors, what loaded, and
publishing.

Four loaders (connector/loaders/) bring chunks into vLLM's pages. When vLLM's KV cache lies in the client's shared
memory (connector/shared_kv.py), the segment owner writes DRAM hits straight into the pages, from vLLM's first hook
of the step where that is safe, verified where they landed while the forward pass runs (``DramInPlace``), and chunks
that only this node's NVMe holds are read from their pack files into the pages, layer by layer, each attention
layer waiting for its own, verified behind the reads (``NvmeLayered``). Every other chunk, and every chunk when the
cache lies elsewhere, is fetched into an arena slot, verified there and copied in before the forward pass
(``ThroughSlots``). Asynchronous loads go the same ways, whole, on a thread of their own while vLLM runs other
requests' steps, each reported in ``finished_recving`` once over (``Asynchronous``; connector/load_policy.py says
which loads are). Loads run one at a time. A chunk that cannot be fetched or fails verification reports its blocks
as load errors, and the verdict is in before vLLM asks for them: vLLM recomputes those blocks and discards that
step's output for the request, and the request's new pages of that step are not published.
Publishing (connector/publisher.py) copies the new chunks' pages out after the forward pass, then a background
thread stores them; the same thread stores into DRAM the chunks a load read from NVMe, once the forward pass is over
and its tokens have had time to go out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

import torch

from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.cachestore.client.node_requests import ExtentsAsked
from prefixcache.connector.loaders.asynchronous import Asynchronous
from prefixcache.connector.loaders.base import ArenaWarnings, Loader, Store, drop
from prefixcache.connector.loaders.dram_in_place import DramInPlace, DramRead
from prefixcache.connector.loaders.layered_reads import LayeredRead
from prefixcache.connector.loaders.layout import KvLayout
from prefixcache.connector.loaders.nvme_layered import NvmeLayered
from prefixcache.connector.loaders.through_slots import SlotsRead, ThroughSlots
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata
from prefixcache.connector.page_copies import BOTH_WAYS, page_copies_for
from prefixcache.connector.pages import page_rows, payload_bytes
from prefixcache.connector.publisher import STORE_DELAY_S, Publisher
from prefixcache.connector.settings import Directions
from prefixcache.connector.transfer_stats import TransferCounts

log = logging.getLogger("prefixcache.connector")


@dataclass
class _InPlaceRead:
    """A step's read straight into the pages: the DRAM hits copied in place, the NVMe-only chunks on their way in
    layer by layer, and the chunks left to load through slots, with the slots they got (their NVMe reads started)."""

    dram: DramRead
    layered: LayeredRead | None
    elsewhere: SlotsRead


class WorkerSide:
    def __init__(
        self,
        client: CacheClient,
        layers: Sequence[torch.Tensor],
        block_tokens: int,
        directions: Directions = BOTH_WAYS,
        io_thread_setup: Callable[[], None] | None = None,
        check_threads: int | Literal["auto"] = "auto",
        transfers: TransferCounts | None = None,
    ) -> None:
        """``directions``: which ways the engine's role moves KV; ``io_thread_setup`` runs first in each thread
        this side starts (see connector/io_threads.py); ``check_threads`` verify chunks loaded through slots (0: the
        fetch thread does; ``"auto"``: as many as the cache's page copies ask for, connector/page_copies.py);
        ``transfers``: the counts to add to, those of the side this one takes over from (vLLM has not collected
        them yet)."""
        setup = io_thread_setup or (lambda: None)
        self.client = client
        self.shard = client.spec.shard  # which shard of the pages this worker holds, and whose keys it uses
        self.layers = list(layers)
        self.block_tokens = block_tokens
        self._layout = KvLayout(client, [page_rows(layer) for layer in self.layers], block_tokens)
        self.pages = self._layout.pages  # each layer as (blocks, page bytes)
        self.load_errors: set[int] = set()
        self.loaded_chunks = 0
        self.loaded_in_place = 0  # of loaded_chunks, those the segment owner wrote straight into their pages
        self.loaded_early = 0  # chunks read in place from begin_load, before start_load (verified or not)
        self.loaded_layer_by_layer = 0  # of loaded_chunks, those read from NVMe straight into their pages
        self.loaded_async = 0  # requests whose asynchronous loads are over (intact or not)
        self._counting = threading.Lock()  # loads are counted from several threads
        self.transfers = transfers or TransferCounts()  # since vLLM last collected them (get_kv_connector_stats)
        client.on_remote_read = functools.partial(self.transfers.add_read, "remote_dram")
        self._copies = page_copies_for(
            self.pages, client.arena_memory, self._layout.pages_of(client.spec.chunk_tokens), directions
        )
        warn = ArenaWarnings()
        self._publisher = Publisher(
            client, self.layers, self.pages, self._copies, self.transfers, warn, directions.publishes, setup
        )
        self._dram = DramInPlace(self._layout, functools.partial(self._count_loaded, in_place=True), setup)
        self._nvme = NvmeLayered(
            self._layout, functools.partial(self._count_loaded, layer_by_layer=True), setup, self._dram.verifier
        )
        self._slots = ThroughSlots(self._layout, self._copies, self._count_loaded, warn, setup, check_threads)
        self._async = Asynchronous(self._load_whole, self._publisher.store, setup)
        # the loaders of a step the forward pass reads, in the order their verdicts are collected
        self._loaders: tuple[Loader[Any], ...] = (self._slots, self._dram, self._nvme)
        # This step's loads (by request) until they are finished, then the requests whose loads failed.
        self._loads: dict[str, list[LoadChunk]] = {}
        self._failed_requests: set[str] = set()
        self._begun: tuple[PrefixCacheMetadata, Future[_InPlaceRead]] | None = None  # begin_load's read
        self._async_begun: PrefixCacheMetadata | None = None  # the step whose asynchronous loads begin_load started
        # Stores into DRAM of what this step's load read from NVMe, started after the forward pass.
        self._after_forward: list[Store] = []
        # Finished requests whose generated tokens' pages are copied out (or being copied, on a GPU's save streams,
        # which the next step's kernels wait for): vLLM may free their blocks.
        self._saved_finished: set[str] = set()

    @property
    def in_shared_memory(self) -> bool:
        """Whether vLLM's KV cache lies in the client's shared memory, where chunks are read straight into its pages."""
        return self._layout.kv is not None

    @property
    def published_chunks(self) -> int:
        return self._publisher.published_chunks

    # -- loads ---------------------------------------------------------------------------------------

    def begin_step(self, meta: PrefixCacheMetadata) -> None:
        """vLLM's first hook of every step (``handle_preemptions``): on a GPU, the step's kernels wait for the
        publishes still copying pages out (connector/page_copies.py); then ``begin_load``."""
        trace.mark("step_begin")
        self._copies.before_step()
        self.begin_load(meta)

    def begin_load(self, meta: PrefixCacheMetadata) -> None:
        """Start this step's in-place reads at vLLM's first hook of the step (``handle_preemptions``).

        vLLM then spends about a millisecond preparing the step (inputs, block tables) before it calls
        ``start_load_kv``; the segment owner copies meanwhile. Only when the scheduler side saw that vLLM
        writes none of the loaded blocks itself first (``meta.load_early``), and only into a cache in shared
        memory, which exists on the CPU backend alone, where vLLM runs no step while it schedules the next.

        A step whose loads are all asynchronous starts them here too: vLLM calls ``start_load_kv`` after the
        forward pass of such a step, and a load begun a forward pass earlier is often over a step earlier.
        """
        if not meta.load_early or not self.in_shared_memory:
            return
        chunks = self._chunks_of(meta)
        if not chunks:
            if later := meta.loads_of(self.shard, asynchronous=True):
                self._async.begin_load(later)
                self._async_begun = meta
            return
        if self._async.in_flight():
            return
        self.finish_load()  # the previous step's verification reads pages too; it is over by now
        self._begun = (meta, self._dram.run_early(self._read_in_place, chunks, asked=meta.extents_asked))

    def start_load(self, meta: PrefixCacheMetadata) -> None:
        """Load this step's chunks into their pages before the forward pass (vLLM calls this first).

        When the KV cache is in shared memory, the chunks are read straight into their pages (started by
        ``begin_load`` where they could be), and verified where they landed while the forward pass runs
        (``finish_load`` collects the verdict); the chunks left, and every chunk when the cache is elsewhere, go
        through arena slots, verified before they are placed. The step's asynchronous loads then queue behind
        those in flight, unless ``begin_load`` queued them already.
        """
        begun, self._begun = self._begun, None
        async_begun, self._async_begun = self._async_begun, None
        if begun is not None and begun[0] is not meta:  # never happens with vLLM: one metadata per step
            self._abandon(begun[1].result())
            begun = None
        self.finish_load()  # the previous step's, should vLLM not have asked for its outcome
        self._loads, self._failed_requests = meta.loads_of(self.shard), set()
        if chunks := self._chunks_of(meta):
            trace.mark("start_load", early=begun is not None)
            self._load_now(chunks, begun[1].result() if begun is not None else None, meta.extents_asked)
            trace.mark("start_load_end")
        if async_begun is not meta and (later := meta.loads_of(self.shard, asynchronous=True)):
            self._async.begin_load(later)

    def _load_now(self, chunks: list[LoadChunk], begun: _InPlaceRead | None, asked: Sequence[ExtentsAsked]) -> None:
        """This step's synchronous loads; ``begun``: what ``begin_load`` read of them already; ``asked``: where
        this node's NVMe holds them, asked by the scheduler side (``PrefixCacheMetadata.extents_asked``)."""
        if self._async.in_flight():
            # The scheduler side makes every load asynchronous while one is in flight, so vLLM never gets here.
            log.warning("a synchronous load waits for the asynchronous loads in flight")
            self._async.wait()
        errors = self.load_errors
        if not self.in_shared_memory:
            self._slots.start_load_kv(self._slots.begin_load(chunks)[0], errors)
            return
        if begun is not None:
            self.loaded_early += len(begun.dram.placed) + begun.dram.verified
        read = begun or self._read_in_place(chunks, asked=asked)
        self._slots.start_load_kv(read.elsewhere, errors)
        self._dram.start_load_kv(read.dram, errors)  # verified behind the forward pass, then the layered read
        if read.layered is not None:
            self._nvme.start_load_kv(read.layered, errors)

    def _load_whole(self, chunks: list[LoadChunk], errors: set[int]) -> list[Store]:
        """Load ``chunks`` with no forward pass reading or writing their blocks before they are verified, placed and
        verified when this returns (an asynchronous load, on its own thread). Blocks of chunks that fail go to
        ``errors``. Returns the stores into DRAM of the chunks read from NVMe, to run at once."""
        if not self.in_shared_memory:
            stores = [self._slots.load(self._slots.begin_load(chunks)[0], errors)]
        else:
            read = self._read_in_place(chunks, behind_forward=False)
            stores = [self._slots.load(read.elsewhere, errors)]
            self._dram.verify(read.dram, errors)
            if read.layered is not None:
                stores.append(self._nvme.verify(read.layered, errors))
        return [store for store in stores if store is not None]

    def _chunks_of(self, meta: PrefixCacheMetadata) -> list[LoadChunk]:
        """This shard's synchronous loads of the step."""
        return [chunk for chunks in meta.loads_of(self.shard).values() for chunk in chunks]

    def _read_in_place(
        self, chunks: list[LoadChunk], behind_forward: bool = True, asked: Sequence[ExtentsAsked] = ()
    ) -> _InPlaceRead:
        """Start reading the chunks only this node's NVMe holds straight into their pages, layer by layer, then
        have the segment owner copy every chunk DRAM holds straight into its pages, then start bringing the
        others back from NVMe into slots of their own (one plan for every NVMe read); chunks DRAM holds but the
        arena had no room for are fetched from DRAM, so only the others are read ahead.
        ``behind_forward``: the step's forward pass runs while the chunks read in place are verified; ``asked``:
        where this node's NVMe holds chunks, asked by the scheduler side (the answers wait in Redis)."""
        started = time.perf_counter()
        trace.mark("read_start", chunks=len(chunks))
        layered, nvme_left = self._nvme.begin_load([chunk for chunk in chunks if not chunk.in_dram], asked)
        dram, dram_left = self._dram.begin_load(
            [chunk for chunk in chunks if chunk.in_dram and not chunk.remote],
            started=started,
            behind_forward=behind_forward,
        )
        from_disk = nvme_left + dram_left
        remote = [chunk for chunk in chunks if chunk.in_dram and chunk.remote]
        elsewhere, _ = self._slots.begin_load(dram.no_room + remote + from_disk, read_ahead=from_disk)
        trace.mark("read_end", in_place=len(dram.placed), elsewhere=len(dram.no_room + remote + from_disk))
        return _InPlaceRead(dram, layered, elsewhere)

    def wait_for_layer(self, layer: int) -> None:
        """vLLM's ``wait_for_layer_load``: an attention layer is about to read its KV; wait for this step's
        reads of that layer from NVMe, and for the later layers of its DRAM hits (their verification goes on
        behind them). Chunks loaded through slots are in already."""
        if layer == 0:
            trace.mark("forward_start")
        self._nvme.wait_for_layer_load(layer)
        self._dram.wait_for_layer_load(layer)

    def finish_load(self) -> None:
        """Wait for the verification of this step's loads: after this, ``load_errors`` holds every block that
        did not arrive intact. vLLM then recomputes those blocks and drops this step's output for their
        requests, so KV that failed verification never reaches an answer, and their new pages are not
        published (``save``)."""
        errors = self.load_errors
        if self._loads:
            trace.mark("finish_load")
        for loader in self._loaders:
            if (store := loader.finish(errors)) is not None:
                self._after_forward.append(store)
        if self._loads:
            trace.mark("finish_load_end")
        self._failed_requests.update(
            request
            for request, chunks in self._loads.items()
            if any(errors.intersection(chunk.blocks) for chunk in chunks)
        )
        self._loads = {}

    def finished_async_loads(self) -> set[str]:
        """Requests whose asynchronous loads are over, intact or not; their failed blocks are in
        ``load_errors`` from now, so vLLM recomputes them (it asks for those in the same pass)."""
        over = self._async.get_finished(self.load_errors)
        trace.mark_all("async_load_over", over)
        self.loaded_async += len(over)
        return over

    def take_load_errors(self) -> set[int]:
        self.finish_load()
        errors, self.load_errors = self.load_errors, set()
        self.transfers.add(load_failed_blocks=len(errors))
        return errors

    def _count_loaded(self, chunks: list[LoadChunk], in_place: bool = False, layer_by_layer: bool = False) -> None:
        """Count chunks that arrived intact in their pages (``in_place``: the segment owner wrote them there;
        ``layer_by_layer``: read from NVMe straight into them)."""
        with self._counting:
            self.loaded_chunks += len(chunks)
            if in_place:
                self.loaded_in_place += len(chunks)
            if layer_by_layer:
                self.loaded_layer_by_layer += len(chunks)
        pages = sum(len(chunk.blocks) for chunk in chunks)
        self.transfers.add(loaded_chunks=len(chunks), loaded_bytes=payload_bytes(self.pages, pages))

    def _abandon(self, read: _InPlaceRead) -> None:
        """Give back every slot of a read that will not be finished, once no read writes into them."""
        self._dram.abandon(read.dram)
        if read.layered is not None:
            self._nvme.abandon(read.layered)
        self._slots.abandon(read.elsewhere)

    # -- publishes -----------------------------------------------------------------------------------

    @property
    def saves_layers(self) -> bool:
        """Whether ``save_layer`` copies anything out (a CPU cache, a rank that publishes): vLLM calls it once per
        layer of every step, so on a GPU the connector's hook returns at once."""
        return self._publisher.saves_layers

    def save_layer(self, meta: PrefixCacheMetadata, layer: int) -> None:
        """vLLM's ``save_kv_layer``: ``layer`` has written its pages of the step (connector/publisher.py)."""
        self._publisher.save_layer(meta.saves, layer)

    def save(self, meta: PrefixCacheMetadata) -> None:
        """After the forward pass: copy the pages of this step's completed chunks out and publish them in
        the background, where the chunks this step's load read from NVMe are stored into DRAM too.

        A request whose load failed this step computed its new pages over KV that did not arrive
        intact: vLLM recomputes them, and they are not published. A worker that does not publish
        (``directions``) stores only those NVMe reads. The finished requests among the saves are reported
        (``finished_saves``) once their pages are copied out, whether this worker publishes or not."""
        trace.mark("forward_end", saves=len(meta.saves))
        self.finish_load()
        for store in self._after_forward:
            self._publisher.store(store, delay_s=STORE_DELAY_S)
        self._after_forward = []
        self._publisher.publish(meta.saves, self._failed_requests)
        self._saved_finished.update(meta.finished)
        trace.mark("save_end")

    def finished_saves(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now (``save``)."""
        saved, self._saved_finished = self._saved_finished, set()
        return saved

    def close(self, keep_client: bool = False) -> None:
        """Finish every load and publish under way and let go of the KV cache: when this returns, nothing of this
        side reads or writes vLLM's pages, and no thread of its runs. What is left to report (``finished_saves``,
        ``finished_async_loads``, ``load_errors``) is still there. ``keep_client``: the client stays open, for the
        side that takes over (connector/worker_states.py)."""
        if self._begun is not None:
            self._abandon(self._begun[1].result())
        self.finish_load()
        for loader in (self._async, self._dram, self._nvme, self._slots):
            loader.close()
        for store in self._after_forward:
            drop(self.client, store)
        self._after_forward = []
        self._publisher.close()
        self._copies.close()
        if not keep_client:
            self.client.close()
