"""The connector's worker side: scatter fetched chunks into vLLM's pages, gather new chunks out of them.

Synchronous loads run before the forward pass; asynchronous ones on a thread of their own while vLLM
runs other requests' steps, each reported in ``finished_recving`` once over (connector/load_policy.py
says which is which). Loads run one at a time. When vLLM's KV cache lies in the client's shared
memory (connector/shared_kv.py), the segment owner writes DRAM hits straight into the pages, from
vLLM's first hook of the step where that is safe, and they are verified where they landed (while the
forward pass runs, for a synchronous load); the verdict is in before vLLM asks for load errors.
Chunks that only this node's NVMe holds are read from their segment files into the pages there, layer by
layer, each attention layer waiting for its own (connector/loaders/layered_reads.py), and verified behind the reads.
Other chunks are fetched into arena slots, verified and copied in. A chunk that cannot be fetched or
fails verification reports its blocks as load errors: vLLM recomputes them and discards that step's
output for the request, and the request's new pages of that step are not published.
Publishing copies the new chunks' pages into arena slots after the forward pass (on a GPU, on a
stream of its own: connector/page_copies.py), then a background thread does the Mooncake put and the
index registration, so the forward never waits on either. The same thread stores chunks a load read
straight from NVMe into DRAM, from the slots they were read into, once the forward pass is over.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

import torch
from prefixcache.cachestore.chunks.arena import ArenaFullError, address_of
from prefixcache.cachestore.chunks.codec import ChunkMeta, payload_offset
from prefixcache.cachestore.chunks.runs import runs_of_about
from prefixcache.cachestore.client.cache_client import CacheClient, Fetched
from prefixcache.cachestore.tiers.dram import first_part_rows, split_at
from prefixcache.cachestore.tiers.nvme_io import PAGE, read_size
from prefixcache.connector.loaders.layered_reads import LayeredChunk, LayeredRead
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata, SaveChunk
from prefixcache.connector.page_copies import BOTH_WAYS, page_copies_for
from prefixcache.connector.pages import block_runs, page_rows, payload_bytes, payload_view
from prefixcache.connector.settings import Directions
from prefixcache.connector.transfer_stats import TransferCounts
from prefixcache.indexer.namespace import tenant_id

log = logging.getLogger("prefixcache.connector")
_BACKGROUND_QUEUE = 64
#: O_DIRECT reads in flight for a load read from NVMe layer by layer (reads of a layer's pages of one chunk,
#: 256 KiB for the test model): 4-8 in flight moved 1.0-1.7 GB/s on this VM's disk, one 0.6.
_LAYER_READERS = 8
#: A store into DRAM of chunks a load read from NVMe, to run once the forward pass is over, and the slots it holds.
_Store = tuple[Callable[[], object], list[memoryview]]


@dataclass
class _Fetched:
    """One group's payloads, verified or being verified (``fetch_checking_later``; None: recompute), and the
    objects among them read from NVMe."""

    payloads: list[Fetched]
    from_disk: dict[bytes, memoryview] = field(default_factory=dict)


@dataclass
class _InPlace:
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


@dataclass
class _ReadInPlace:
    """What a step's in-place read left: chunks that arrived in their pages (to verify), chunks to load
    through slots with the slots they got (their NVMe reads already started), and when the read started
    (the fetch is timed from then)."""

    placed: list[_InPlace]
    elsewhere: list[LoadChunk]
    slots: list[memoryview]
    started: float
    layered: LayeredRead | None = None  # NVMe-only chunks on their way into their pages, layer by layer
    verified: int = 0  # chunks in their pages and verified already (those whose last block vLLM writes this step)
    # of ``placed``, those whose later layers are still being copied (``_copy_later_layers``), and that copy
    later: list[_InPlace] = field(default_factory=list)
    later_copy: Future[list[bool]] | None = None


class WorkerSide:
    def __init__(
        self,
        client: CacheClient,
        layers: Sequence[torch.Tensor],
        block_tokens: int,
        directions: Directions = BOTH_WAYS,
        io_thread_setup: Callable[[], None] | None = None,
        check_threads: int | Literal["auto"] = "auto",
    ) -> None:
        """``directions``: which ways the engine's role moves KV; ``io_thread_setup`` runs first in each thread
        this side starts (see connector/io_threads.py); ``check_threads`` verify chunks loaded through slots (0: the
        fetch thread does; ``"auto"``: as many as the cache's page copies ask for, connector/page_copies.py)."""
        self.client = client
        self.shard = client.spec.shard  # which shard of the pages this worker holds, and whose keys it uses
        self.publishes = directions.publishes  # a rank whose KV another rank publishes skips the saves
        self._io_thread_setup = io_thread_setup or (lambda: None)
        self.layers = list(layers)
        self.block_tokens = block_tokens
        self.load_errors: set[int] = set()
        self.loaded_chunks = 0
        self.loaded_in_place = 0  # of loaded_chunks, those the segment owner wrote straight into their pages
        self.loaded_early = 0  # chunks read in place from begin_load, before start_load (verified or not)
        self.loaded_layer_by_layer = 0  # of loaded_chunks, those read from NVMe straight into their pages
        self.loaded_async = 0  # requests whose asynchronous loads are over (intact or not)
        self._counting = threading.Lock()  # loads are counted from several threads
        self.published_chunks = 0
        self.transfers = TransferCounts()  # since vLLM last collected them (get_kv_connector_stats)
        # Jobs that move held slots to the store (publishes, stores after disk reads), and those slots.
        self._background: queue.Queue[tuple[Callable[[], object], list[memoryview], Callable[[], None]] | None] = (
            queue.Queue(_BACKGROUND_QUEUE)
        )
        self._background_thread = threading.Thread(
            target=self._background_loop, name="prefixcache-background", daemon=True
        )
        self._background_thread.start()
        # Stores into DRAM of what this step's load read from NVMe, started after the forward pass.
        self._after_forward: list[_Store] = []
        self._fetcher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-fetch", initializer=self._io_thread_setup
        )
        # This step's loads (by request) until they are finished, then the requests whose loads failed.
        self._loads: dict[str, list[LoadChunk]] = {}
        self._failed_requests: set[str] = set()
        self._verifier = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-verify", initializer=self._io_thread_setup
        )
        self._verification: Future[None] | None = None
        # begin_load's reads: a thread on the worker's own core (it only waits for the segment owner; on the
        # reserved core it waited up to 1 ms behind vLLM's busy-polling engine core to be scheduled)
        self._early_reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-early")
        self._begun: tuple[PrefixCacheMetadata, Future[_ReadInPlace]] | None = None  # begin_load's read
        # Asynchronous loads, in the order vLLM scheduled them: their requests, and the blocks that failed.
        self._async_loader = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-async-load", initializer=self._io_thread_setup
        )
        self._async_loads: list[tuple[set[str], Future[set[int]]]] = []
        self._async_begun: PrefixCacheMetadata | None = None  # the step whose asynchronous loads begin_load started
        self._warned: set[str] = set()  # what the arena's size costs is logged once per kind
        self.pages = [page_rows(layer) for layer in self.layers]  # each layer as (blocks, page bytes)
        self._copies = page_copies_for(
            self.pages, client.arena_memory, self._pages(client.spec.chunk_tokens), directions
        )
        self._page_bytes = self.pages[0].shape[1]
        if check_threads == "auto":
            check_threads = self._copies.check_threads
        self._checks = (
            ThreadPoolExecutor(
                max_workers=check_threads, thread_name_prefix="prefixcache-check", initializer=self._io_thread_setup
            )
            if check_threads
            else None
        )
        self._layer_starts: list[int] = []  # where each layer's block 0 lies in self._kv
        self._kv = self._pages_in_shared_memory()
        # NVMe-only chunks go straight into their pages, layer by layer (connector/loaders/layered_reads.py), where the
        # pages lie in shared memory at 4 KiB boundaries, until a step shows vLLM does not wait for its layers
        self._reads_layered = self._pages_aligned_for_disk()
        self._layer_readers = ThreadPoolExecutor(
            max_workers=_LAYER_READERS, thread_name_prefix="prefixcache-disk", initializer=self._io_thread_setup
        )
        self._layered_now: LayeredRead | None = None  # this step's synchronous one, which vLLM waits for by layer
        # DRAM hits: the layers of each chunk's first DRAM part, in before the forward pass; the rest are copied
        # while it computes those, until a step shows vLLM does not wait for its layers
        self._first_layers = first_part_rows(len(self.layers))
        self._later_layers_behind = self._first_layers > 0
        self._later_now: _ReadInPlace | None = None  # this step's synchronous read, if it copies later layers
        self._later_waited = False

    def _pages_in_shared_memory(self) -> memoryview | None:
        """The KV cache as one view, when every layer's pages lie in the client's shared memory (the
        connector allocated it there, on the CPU backend), one after another; else None."""
        page = self._page_bytes
        if any(rows.device.type != "cpu" or rows.stride(0) != page for rows in self.pages):
            return None
        low = min(rows.data_ptr() for rows in self.pages)
        high = max(rows.data_ptr() + rows.shape[0] * page for rows in self.pages)
        view = self.client.shared_view(low, high - low)
        if view is not None:
            self._layer_starts = [rows.data_ptr() - low for rows in self.pages]
        return view

    def _pages_aligned_for_disk(self) -> bool:
        """Whether every page lies in shared memory at a 4 KiB boundary, as O_DIRECT reads into it need."""
        base = address_of(self._kv) if self._kv is not None else None
        return (
            base is not None
            and self._page_bytes % PAGE == 0
            and all((base + start) % PAGE == 0 for start in self._layer_starts)
        )

    # -- loads ---------------------------------------------------------------------------------------

    def begin_step(self, meta: PrefixCacheMetadata) -> None:
        """vLLM's first hook of every step (``handle_preemptions``): on a GPU, the step's kernels wait for the
        publishes still copying pages out (connector/page_copies.py); then ``begin_load``."""
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
        if not meta.load_early or self._kv is None:
            return
        chunks = self._chunks_of(meta)
        if not chunks:
            if later := meta.loads_of(self.shard, asynchronous=True):
                self._load_in_background(later)
                self._async_begun = meta
            return
        if self._async_load_in_flight():
            return
        self.finish_load()  # the previous step's verification reads pages too; it is over by now
        self._begun = (meta, self._early_reader.submit(self._read_in_place, chunks))

    def start_load(self, meta: PrefixCacheMetadata) -> None:
        """Load this step's chunks into their pages before the forward pass (vLLM calls this first).

        When the KV cache is in shared memory, the segment owner writes DRAM hits straight into the
        pages in one call (started by ``begin_load`` where it could be), and a thread of this side's own
        verifies them where they landed while the forward pass runs (``finish_load`` collects the
        verdict). Chunks DRAM does not hold, and every chunk when the cache is elsewhere, go through
        arena slots, verified before they are placed. The step's asynchronous loads then queue behind
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
            self._load_now(chunks, begun[1].result() if begun is not None else None)
        if async_begun is not meta and (later := meta.loads_of(self.shard, asynchronous=True)):
            self._load_in_background(later)

    def _load_in_background(self, loads: dict[str, list[LoadChunk]]) -> None:
        """Queue one step's asynchronous loads behind those in flight."""
        chunks = [chunk for request in loads.values() for chunk in request]
        self._async_loads.append((set(loads), self._async_loader.submit(self._load_async, chunks)))

    def _load_now(self, chunks: list[LoadChunk], begun: _ReadInPlace | None) -> None:
        """This step's synchronous loads; ``begun``: what ``begin_load`` read of them already."""
        if self._async_load_in_flight():
            # The scheduler side makes every load asynchronous while one is in flight, so vLLM never gets here.
            log.warning("a synchronous load waits for the asynchronous loads in flight")
            for _, job in self._async_loads:
                job.exception()
        if begun is not None:
            self.loaded_early += len(begun.placed) + begun.verified
        stores, placed = self._load(chunks, self.load_errors, begun)
        if stores is not None:  # stored into DRAM once the forward pass is over
            self._after_forward.append(stores)
        if placed is not None:
            self._layered_now = placed.layered
            self._later_now = placed if placed.later_copy is not None else None
            self._later_waited = False
            self._verification = self._verifier.submit(self._verify_read, placed, self.load_errors)

    def _load_async(self, chunks: list[LoadChunk]) -> set[int]:
        """One step's asynchronous loads, on their own thread: placed and verified before they are reported
        over, so the chunks read from NVMe are stored into DRAM at once. Returns the blocks that failed."""
        errors: set[int] = set()
        try:
            stores, placed = self._load(chunks, errors, asynchronous=True)
            from_pages = self._verify_read(placed, errors) if placed is not None else None
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks asynchronously failed; recomputing them", len(chunks))
            return {block for chunk in chunks for block in chunk.blocks}
        for store in (stores, from_pages):
            if store is not None:
                self._in_background(*store)
        return errors

    def _async_load_in_flight(self) -> bool:
        return any(not job.done() for _, job in self._async_loads)

    def finished_async_loads(self) -> set[str]:
        """Requests whose asynchronous loads are over, intact or not; their failed blocks are in
        ``load_errors`` from now, so vLLM recomputes them (it asks for those in the same pass)."""
        over: set[str] = set()
        while self._async_loads and self._async_loads[0][1].done():
            requests, job = self._async_loads.pop(0)
            self.load_errors.update(job.result())
            over |= requests
        self.loaded_async += len(over)
        return over

    def _load(
        self, chunks: list[LoadChunk], errors: set[int], begun: _ReadInPlace | None = None, asynchronous: bool = False
    ) -> tuple[_Store | None, _ReadInPlace | None]:
        """Load ``chunks``, all but verifying those read in place (``begun``: what of them is read already;
        ``asynchronous``: no forward pass reads or writes their blocks before they are verified).
        Blocks of chunks that fail go to ``errors``. Returns the job that stores the chunks read from NVMe
        into DRAM (see ``_load_through_slots``), and the in-place read whose chunks are still to verify."""
        if self._kv is None:
            return self._load_through_slots(chunks, errors), None
        read = begun or self._read_in_place(chunks, behind_forward=not asynchronous)
        stores = self._load_through_slots(read.elsewhere, errors, read.slots) if read.elsewhere else None
        return stores, read if read.placed or read.layered else None

    def _chunks_of(self, meta: PrefixCacheMetadata) -> list[LoadChunk]:
        """This shard's synchronous loads of the step."""
        return [chunk for chunks in meta.loads_of(self.shard).values() for chunk in chunks]

    def _read_in_place(self, chunks: list[LoadChunk], behind_forward: bool = True) -> _ReadInPlace:
        """Start reading the chunks only this node's NVMe holds straight into their pages, layer by layer, then
        have the segment owner copy every chunk DRAM holds straight into its pages, in one call (but the last
        block of each whose last block vLLM writes this step: ``_place_held_pages``), then start bringing the
        others back from NVMe into slots of their own (one plan for every NVMe read).
        ``behind_forward``: the step's forward pass runs while the chunks read in place are verified."""
        started = time.perf_counter()
        layered, elsewhere = self._read_layered([chunk for chunk in chunks if not chunk.in_dram])
        placed, in_dram_elsewhere = self._in_place(
            [chunk for chunk in chunks if chunk.in_dram], hold_blocks_vllm_writes=behind_forward
        )
        elsewhere = in_dram_elsewhere + elsewhere
        verified = 0
        later: list[_InPlace] = []
        if placed:
            arrived = self._copy_first_layers(placed, behind_forward)
            elsewhere += self._released([item for item, ok in zip(placed, arrived, strict=True) if not ok])
            placed = [item for item, ok in zip(placed, arrived, strict=True) if ok]
            held = [item for item in placed if item.held_pages]
            failed = self._place_held_pages(held, started)
            verified = len(held) - len(failed)
            elsewhere += failed
            placed = [item for item in placed if not item.held_pages]
            if behind_forward and self._later_layers_behind:  # then every chunk's copy is cut
                later = placed
        slots = self._slots(elsewhere)
        # chunks DRAM holds but the arena had no room for are fetched from DRAM: only the others are read ahead
        if ahead := [
            (chunk.key, slot)
            for chunk, slot in zip(elsewhere, slots or [], strict=False)
            if chunk not in in_dram_elsewhere
        ]:
            self.client.read_ahead(ahead)
        read = _ReadInPlace(placed, elsewhere, slots, started, layered, verified, later)
        if later:  # on this thread when begin_load started the read, so it follows at once
            read.later_copy = self._early_reader.submit(self._copy_later_layers, later)
        return read

    def _cut(self, item: _InPlace) -> tuple[list[memoryview], list[memoryview]]:
        """Where a chunk read in place goes, as the pieces of its two DRAM parts (cachestore/tiers/dram.py): its
        header and tokens and its first layers' pages, then its later layers' (none: a copy not cut)."""
        if not self._first_layers:
            return [item.head, *item.pieces], []
        at = len(item.pieces) // len(self.layers) * self._first_layers
        return [item.head, *item.pieces[:at]], item.pieces[at:]

    def _copy_first_layers(self, items: list[_InPlace], behind_forward: bool) -> list[bool]:
        """Have the segment owner copy each chunk's first DRAM part into place, in one call, and its second
        too where that must be in before the forward pass: for chunks whose last block vLLM writes this
        step, for every chunk of a load nothing computes behind (``behind_forward`` False), and once vLLM
        has not waited for a layer. Returns which chunks arrived (of those copied whole: both parts)."""
        keys: list[bytes] = []
        parts: list[list[memoryview]] = []
        second: list[bool] = []
        at: list[tuple[int, int | None]] = []  # per chunk: where its parts are in the call
        for item in items:
            first, rest = self._cut(item)
            whole = bool(rest) and (bool(item.held_pages) or not behind_forward or not self._later_layers_behind)
            at.append((len(keys), len(keys) + 1 if whole else None))
            keys += [item.chunk.key] * (1 + whole)
            parts += [first, rest] if whole else [first]
            second += [False, True] if whole else [False]
        try:
            got = self.client.fetch_scattered(keys, parts, second)
        except Exception:  # noqa: BLE001 - a failed call: these chunks load through slots instead
            log.exception("reading %d chunks into their pages failed", len(items))
            return [False] * len(items)
        return [got[i] and (j is None or got[j]) for i, j in at]

    def _copy_later_layers(self, items: list[_InPlace]) -> list[bool]:
        """The second half of ``_copy_first_layers``: each chunk's second DRAM part into place, in one call, while
        the forward pass computes the first layers. Returns which arrived; never raises (the others are load
        errors, as damaged chunks are: their KV would be another's)."""
        try:
            return self.client.fetch_scattered(
                [item.chunk.key for item in items], [self._cut(item)[1] for item in items], [True] * len(items)
            )
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("reading the later layers of %d chunks into their pages failed", len(items))
            return [False] * len(items)

    def _place_held_pages(self, items: list[_InPlace], started: float) -> list[LoadChunk]:
        """Verify, before the forward pass, the chunks whose last block vLLM writes this step, then copy that
        block's pages from their slots into place; returns the chunks that failed (their DRAM copies are
        deleted: they are read from NVMe instead, in the same load).

        vLLM writes the step's first computed token into that block during the forward pass. Verified there
        behind it, an intact chunk failed its check whenever that token's last bits differed from the stored
        one's (seen in a multimodal e2e run, where the recompute then stopped vLLM on an encoder cache miss).
        So that block's pages land in the chunk's slot, where nothing writes, and the rest in their pages as
        usual: the copy before the forward pass is one block per layer, not the whole chunk (through a slot,
        a 4 MiB chunk's own fetch and placing cost the step ~3 ms)."""
        if not items:
            return []
        try:
            intact = self._intact_in_place(items, started)
            for item in itertools.compress(items, intact):
                for held, page in item.held_pages:
                    page[:] = held
        finally:
            self._released(items)  # once the held pages are copied out
        return [item.chunk for item, ok in zip(items, intact, strict=True) if not ok]

    def _read_layered(self, chunks: list[LoadChunk]) -> tuple[LayeredRead | None, list[LoadChunk]]:
        """Start reading NVMe-only chunks from this node's segment files straight into their pages, layer by layer
        (connector/loaders/layered_reads.py); returns that read and the chunks left to load through slots: those whose
        last block vLLM writes this step, those on no disk of this node, of another size than this geometry's, or
        beyond the arena's room for their headers."""
        if not self._reads_layered or not chunks:
            return None, chunks
        eligible = [chunk for chunk in chunks if not chunk.ends_mid_block]
        left = [chunk for chunk in chunks if chunk.ends_mid_block]
        items: list[LayeredChunk] = []
        extents = self.client.disk_extents([chunk.key for chunk in eligible]) if eligible else []
        for chunk, extent in zip(eligible, extents, strict=True):
            if extent is None or extent.length != self._object_bytes(chunk.stored_tokens):
                left.append(chunk)
                continue
            placed, _ = self._in_place([chunk])
            if not placed:
                left.append(chunk)
                continue
            item = placed[0]
            per_layer = len(item.pieces) // len(self.layers)
            layers = [item.pieces[i : i + per_layer] for i in range(0, len(item.pieces), per_layer)]
            candidate = LayeredChunk(chunk, item.slot, item.head, layers, extent)
            if candidate.aligned():
                items.append(candidate)
            else:
                left += self._released([item])
        return (LayeredRead(items, self._layer_readers, _LAYER_READERS) if items else None), left

    def wait_for_layer(self, layer: int) -> None:
        """vLLM's ``wait_for_layer_load``: an attention layer is about to read its KV; wait for this step's
        reads of that layer from NVMe (their verification goes on behind them)."""
        if self._layered_now is not None:
            self._layered_now.wait_layer(layer)
        if self._later_now is not None and layer >= self._first_layers and not self._later_waited:
            self._later_waited = True
            self._later_now.later_copy.exception()  # type: ignore[union-attr]

    def finish_load(self) -> None:
        """Wait for the verification of this step's loads: after this, ``load_errors`` holds every block that
        did not arrive intact. vLLM then recomputes those blocks and drops this step's output for their
        requests, so KV that failed verification never reaches an answer, and their new pages are not
        published (``save``)."""
        job, self._verification = self._verification, None
        if job is not None and (stores := job.result()) is not None:
            self._after_forward.append(stores)
        layered, self._layered_now = self._layered_now, None
        if layered is not None and len(layered.waited) < len(self.layers):
            self._distrust(layered)
        later, self._later_now = self._later_now, None
        if later is not None and not self._later_waited:
            self._distrust_later_copy(later)
        errors = self.load_errors
        self._failed_requests.update(
            request
            for request, chunks in self._loads.items()
            if any(errors.intersection(chunk.blocks) for chunk in chunks)
        )
        self._loads = {}

    def _in_place(
        self, chunks: list[LoadChunk], hold_blocks_vllm_writes: bool = False
    ) -> tuple[list[_InPlace], list[LoadChunk]]:
        """An arena slot per chunk for its header, tokens and the pages it does not load; chunks the
        arena has no room for come second, to go through slots (where they will likely be recomputed).
        ``hold_blocks_vllm_writes``: a chunk whose last block vLLM writes this step (while the forward pass
        runs) holds that block's pages in its slot too (see ``_place_held_pages``)."""
        placed: list[_InPlace] = []
        elsewhere: list[LoadChunk] = []
        for chunk in chunks:
            hold_last = chunk.ends_mid_block and hold_blocks_vllm_writes
            scratch_pages = (self._pages(chunk.stored_tokens) - len(chunk.blocks) + hold_last) * len(self.layers)
            try:
                slot = self.client.slot(payload_offset(chunk.stored_tokens) + scratch_pages * self._page_bytes)
            except ArenaFullError:
                elsewhere.append(chunk)
                continue
            placed.append(self._pieces(chunk, slot, hold_last))
        return placed, elsewhere

    def _pieces(self, chunk: LoadChunk, slot: memoryview, hold_last: bool) -> _InPlace:
        """Where each part of the chunk's payload goes, in payload order (layer by layer, page by page):
        runs of the chunk's blocks, and the scratch after its header in ``slot`` for pages it does not
        load (vLLM's own prefix cache holds them, or they lie past the request's blocks) and, with
        ``hold_last``, for its last block's pages until they are verified."""
        pages, page = self._pages(chunk.stored_tokens), self._page_bytes
        before, after = chunk.first_page, pages - chunk.first_page - len(chunk.blocks)
        scratch = slot[payload_offset(chunk.stored_tokens) :]
        direct = chunk.blocks[:-1] if hold_last else chunk.blocks
        runs = [(block, n) for _, block, n in block_runs(direct)]  # the same for every layer
        item = _InPlace(chunk, slot, [])
        for start in self._layer_starts:
            if before:
                item.pieces.append(scratch[: before * page])
                scratch = scratch[before * page :]
            item.pieces.extend(
                self._kv[start + block * page : start + (block + n) * page]  # type: ignore[index]
                for block, n in runs
            )
            if hold_last:
                held, scratch = scratch[:page], scratch[page:]
                last = start + chunk.blocks[-1] * page
                item.pieces.append(held)
                item.held_pages.append((held, self._kv[last : last + page]))  # type: ignore[index]
            if after:
                item.pieces.append(scratch[: after * page])
                scratch = scratch[after * page :]
        return item

    def _verify(self, items: list[_InPlace], started: float, errors: set[int]) -> None:
        """The verifier thread: check chunks where they landed while the forward pass reads them (on 2
        cores, 4097-token hits took 29.0 ms verifying first and 25.3 ms this way, against 21.3 and 19.0 ms
        for vLLM's own prefix cache). Never raises: a chunk that fails goes to ``errors``."""
        try:
            intact = self._intact_in_place(items, started)
        finally:
            self._released(items)
        for item, ok in zip(items, intact, strict=True):
            if not ok:
                errors.update(item.chunk.blocks)

    def _intact_in_place(self, items: list[_InPlace], started: float) -> list[bool]:
        """Whether each chunk read in place is intact where it landed (its damaged DRAM copy is deleted); counts
        the intact ones as loaded. Never raises: if verifying fails, every chunk counts as failed (recomputed)."""
        try:
            intact = self.client.verify_scattered(
                [item.chunk.key for item in items],
                [item.head for item in items],
                [item.pieces for item in items],
                started,
            )
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("verifying %d chunks failed; recomputing them", len(items))
            intact = [False] * len(items)
        self._count_loaded([item.chunk for item, ok in zip(items, intact, strict=True) if ok], in_place=True)
        return intact

    def _verify_read(self, read: _ReadInPlace, errors: set[int]) -> _Store | None:
        """Verify what a read put straight into the pages: the DRAM hits, then (behind their reads, layer by
        layer) the chunks read from NVMe. Returns the job that stores the latter into DRAM from their pages,
        with the slots it holds. Never raises: a chunk that fails goes to ``errors``."""
        placed = read.placed
        if read.later_copy is not None:  # a chunk whose later layers did not arrive is a miss, never verified
            missed = [item for item, ok in zip(read.later, read.later_copy.result(), strict=True) if not ok]
            for item in missed:
                errors.update(item.chunk.blocks)
                self.client.discard(item.chunk.key)
            self._released(missed)
            gone = {id(item) for item in missed}
            placed = [item for item in placed if id(item) not in gone]
        if placed:
            self._verify(placed, read.started, errors)
        return self._verify_layered(read.layered, errors) if read.layered is not None else None

    def _verify_layered(self, read: LayeredRead, errors: set[int]) -> _Store | None:
        try:
            checks = read.check(self.client.body_check)
            intact = self.client.verify_disk_reads([c.chunk.key for c in read.chunks], checks, read.started)
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("verifying %d chunks read from NVMe failed; recomputing them", len(read.chunks))
            read.settle()
            intact = [False] * len(read.chunks)
        good = [c for c, ok in zip(read.chunks, intact, strict=True) if ok]
        for c, ok in zip(read.chunks, intact, strict=True):
            if not ok:
                errors.update(c.chunk.blocks)
                self.client.release(c.slot)
        self._count_loaded([c.chunk for c in good])
        with self._counting:
            self.loaded_layer_by_layer += len(good)
        if not good:
            return None
        # After the forward pass, from the pages: vLLM wrote none of them this step (no chunk whose last block
        # it writes is read this way); should it reuse one before the put is over, that copy fails its check.
        store = functools.partial(
            self.client.store_scattered,
            [c.chunk.key for c in good],
            [[c.head, *itertools.chain.from_iterable(c.layers)] for c in good],
        )
        return store, [c.slot for c in good]

    def _distrust_later_copy(self, read: _ReadInPlace) -> None:
        """A step copied DRAM hits' later layers behind the forward pass, but vLLM did not wait for those layers:
        attention may have read their pages before they were in. The chunks are recomputed, and from now on
        every chunk's copy is in before the forward pass."""
        self.load_errors.update(block for item in read.later for block in item.chunk.blocks)
        if self._later_layers_behind:
            self._later_layers_behind = False
            log.warning(
                "vLLM did not wait for the layers of a DRAM hit copied behind the forward pass: recomputing "
                "it, and copying every layer before the forward pass from now on"
            )

    def _distrust(self, read: LayeredRead) -> None:
        """A step read chunks layer by layer, but vLLM did not wait for every layer: an attention layer may have
        read its pages before they were in. Its chunks are recomputed, and loads are never read this way again."""
        self.load_errors.update(block for c in read.chunks for block in c.chunk.blocks)
        if self._reads_layered:
            self._reads_layered = False
            log.warning(
                "vLLM waited for %d of %d layers of a load read from NVMe layer by layer: recomputing it, "
                "and reading NVMe hits whole from now on",
                len(read.waited),
                len(self.layers),
            )

    def _count_loaded(self, chunks: list[LoadChunk], in_place: bool = False) -> None:
        """Count chunks that arrived intact in their pages."""
        with self._counting:
            self.loaded_chunks += len(chunks)
            if in_place:
                self.loaded_in_place += len(chunks)
        pages = sum(len(chunk.blocks) for chunk in chunks)
        self.transfers.add(loaded_chunks=len(chunks), loaded_bytes=payload_bytes(self.pages, pages))

    def _abandon(self, read: _ReadInPlace) -> None:
        """Give back every slot of a read that will not be finished, once no disk read writes into them."""
        self.client.settle_reads()
        if read.later_copy is not None:
            read.later_copy.exception()
        self._released(read.placed)
        if read.layered is not None:
            read.layered.settle()
            for c in read.layered.chunks:
                self.client.release(c.slot)
        for slot in read.slots:
            self.client.release(slot)

    def _released(self, items: list[_InPlace]) -> list[LoadChunk]:
        """Give back the slots of ``items``; returns their chunks."""
        for item in items:
            self.client.release(item.slot)
        return [item.chunk for item in items]

    def _load_through_slots(
        self, chunks: list[LoadChunk], errors: set[int], slots: list[memoryview] | None = None
    ) -> _Store | None:
        """Fetch chunks into arena slots and place them, in windows of as many chunks as the arena has room
        for: a hit larger than the arena still loads whole (a GPU hit of an 8B model's 8k-token prompt is
        1 GiB), in the slots each window gives back. Blocks of chunks that fail go to ``errors``.

        ``slots``: those ``_slots`` already gave the first chunks. Returns the job that stores the chunks the
        last window read from NVMe into DRAM, with the slots it holds, for the caller to run once the load
        is over. Earlier windows' NVMe reads are not stored back: the next window needs their slots.
        """
        stores = None
        while chunks:
            if not slots:
                if stores is not None:
                    self._drop(stores)
                    stores = None
                slots = self._slots(chunks)
            if not slots:
                log.warning("arena full: recomputing instead of loading %d chunks", len(chunks))
                for chunk in chunks:
                    errors.update(chunk.blocks)
                break
            if len(slots) < len(chunks):
                self._warn_once(
                    "a load did not fit in the arena's free room and loads in windows; what earlier "
                    "windows read from NVMe is not put back into DRAM"
                )
            window, chunks = chunks[: len(slots)], chunks[len(slots) :]
            stores = self._load_window(window, slots, errors)
            slots = None
        return stores

    def _load_window(self, chunks: list[LoadChunk], slots: list[memoryview], errors: set[int]) -> _Store | None:
        """Load chunks that all have slots, in groups, placing one group while the next is read. On a GPU
        worker the check threads verify a group's chunks while the segment owner (another process) copies
        the next group into the arena; elsewhere the fetch thread verifies each group after the owner's copy.
        Each fetch names the chunks still to come with their slots: chunks that must come back from this node's
        NVMe are read into place ahead of their turn, and those on other nodes are asked for in one request.
        A chunk whose DRAM copy fails its check is fetched again once the rest are placed, from NVMe.
        Returns the job that stores the chunks read from NVMe into DRAM, with the slots it holds.
        """
        upcoming = list(zip((chunk.key for chunk in chunks), slots, strict=True))
        cuts = {chunk.key: self._dram_cut(chunk.stored_tokens) for chunk in chunks}
        groups = runs_of_about(upcoming, lambda pair: len(pair[1]), self._copies.load_group_bytes)
        ends = list(itertools.accumulate(len(group) for group in groups))
        read_from_disk: dict[bytes, memoryview] = {}
        checking: list[Future[memoryview | None]] = []  # every check started, for the slots' release
        damaged: list[int] = []  # positions of chunks whose DRAM copies failed their checks
        pending = self._fetcher.submit(self._fetch, groups[0], upcoming[ends[0] :], cuts)
        try:
            for i, group in enumerate(groups):
                fetched = pending.result()  # type: ignore[union-attr] # one is in flight per group left
                pending = None
                if i + 1 < len(groups):
                    pending = self._fetcher.submit(self._fetch, groups[i + 1], upcoming[ends[i + 1] :], cuts)
                read_from_disk.update(fetched.from_disk)
                checking += [got for got in fetched.payloads if isinstance(got, Future)]
                placing: list[tuple[LoadChunk, memoryview | None]] = []
                for at, got in enumerate(fetched.payloads, start=ends[i] - len(group)):
                    payload = self._checked(got)
                    if isinstance(got, Future) and payload is None:
                        damaged.append(at)
                    else:
                        placing.append((chunks[at], payload))
                self._place(placing, errors)
            if damaged:
                again = self._fetch([upcoming[at] for at in damaged], [], cuts, check_later=False)
                read_from_disk.update(again.from_disk)
                self._place(
                    [(chunks[at], self._checked(got)) for at, got in zip(damaged, again.payloads, strict=True)], errors
                )
        finally:
            if pending is not None and pending.exception() is None:  # the fetch in flight must finish first
                checking += [got for got in pending.result().payloads if isinstance(got, Future)]
            wait(checking)  # and so must the checks reading the slots
            self.client.settle_reads()
            self._copies.loaded()  # and so must the copies out of them (into a GPU's pages)
            held = [slot for (key, slot) in upcoming if key in read_from_disk]
            for key, slot in upcoming:
                if key not in read_from_disk:
                    self.client.release(slot)
        if not held:
            return None
        return functools.partial(self.client.store_disk_reads, list(read_from_disk.items())), held

    @staticmethod
    def _checked(payload: Fetched) -> memoryview | None:
        """A payload, once its check is over (None: recompute)."""
        if not isinstance(payload, Future):
            return payload
        try:
            return payload.result()
        except Exception:  # noqa: BLE001 - a failed check is a miss; the request must not fail
            log.exception("checking a loaded chunk failed; recomputing it")
            return None

    def _drop(self, stores: _Store) -> None:
        """Give back the slots of a store into DRAM that will not run."""
        for slot in stores[1]:
            self.client.release(slot)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s; raise arena_mb (warned once)", message)

    def _slots(self, chunks: list[LoadChunk]) -> list[memoryview]:
        """An arena slot for each of the first chunks, in order, while the arena has room."""
        slots: list[memoryview] = []
        try:
            for chunk in chunks:
                slots.append(self.client.slot(read_size(self._object_bytes(chunk.stored_tokens))))
        except ArenaFullError:
            pass  # the rest load in a later window (_load_through_slots)
        return slots

    def _fetch(
        self,
        group: list[tuple[bytes, memoryview]],
        upcoming: list[tuple[bytes, memoryview]],
        cuts: dict[bytes, int | None],
        check_later: bool = True,
    ) -> _Fetched:
        """Fetch one group into its slots, each chunk's two DRAM parts in one call (``cuts``: where each is cut),
        its DRAM copies checked on the check threads (``check_later``, where this side has them) or before
        this returns; runs on the fetch thread."""
        fetched = _Fetched(payloads=[None] * len(group))
        keys, slots = [key for key, _ in group], [slot for _, slot in group]
        at = [cuts[key] for key in keys]
        try:
            if check_later and self._checks is not None:
                fetched.payloads = self.client.fetch_checking_later(
                    keys, slots, upcoming=upcoming, checks=self._checks, cuts=at
                )
            else:
                fetched.payloads = list(self.client.fetch(keys, slots, upcoming=upcoming, cuts=at))
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks failed; recomputing them", len(group))
        fetched.from_disk = dict(self.client.take_disk_reads())
        return fetched

    def _place(self, placing: list[tuple[LoadChunk, memoryview | None]], errors: set[int]) -> None:
        """Copy each chunk's payload into its blocks; a chunk without one (None, or of another size) goes to
        ``errors``."""
        for chunk, payload in placing:
            pages = self._pages(chunk.stored_tokens)
            if payload is None or len(payload) != payload_bytes(self.pages, pages):
                errors.update(chunk.blocks)
                continue
            src = payload_view(payload, self.pages, pages)[:, chunk.first_page :]
            self._copies.scatter(src, chunk.blocks)
            self._count_loaded([chunk])

    def take_load_errors(self) -> set[int]:
        self.finish_load()
        errors, self.load_errors = self.load_errors, set()
        self.transfers.add(load_failed_blocks=len(errors))
        return errors

    # -- publishes -----------------------------------------------------------------------------------

    def save(self, meta: PrefixCacheMetadata) -> None:
        """After the forward pass: copy the pages of this step's completed chunks out and publish them in
        the background, where the chunks this step's load read from NVMe are stored into DRAM too.

        A request whose load failed this step computed its new pages over KV that did not arrive
        intact: vLLM recomputes them, and they are not published. A worker that does not publish
        (``directions``) stores only those NVMe reads."""
        self.finish_load()
        for job, slots in self._after_forward:
            self._in_background(job, slots)
        self._after_forward = []
        if not self.publishes:
            return
        by_tenant: dict[str | None, list[tuple[ChunkMeta, memoryview]]] = {}
        for chunk in meta.saves:
            if chunk.request in self._failed_requests:
                continue
            staged = self._stage(chunk)
            if staged is not None:
                by_tenant.setdefault(chunk.tenant_salt, []).append(staged)
        if not by_tenant:
            return
        copied = self._copies.saved()  # a GPU's pages are still on their way into the slots
        for salt, batch in by_tenant.items():
            dropped = functools.partial(self.transfers.add, unpublished_chunks=len(batch))
            self._in_background(functools.partial(self._publish, batch, salt), [s for _, s in batch], copied, dropped)

    def _stage(self, chunk: SaveChunk) -> tuple[ChunkMeta, memoryview] | None:
        pages = len(chunk.blocks)
        meta = ChunkMeta(
            namespace=self.client.spec.digest,
            root=self.client.spec.root(chunk.tenant_salt, chunk.variant),
            parent=chunk.parents[self.shard],
            tokens=chunk.tokens,
            dtype=str(self.layers[0].dtype).removeprefix("torch."),
            shape=(len(self.layers), pages, *self.layers[0].shape[1:]),
            tenant=int(tenant_id(chunk.tenant_salt) or "0", 16),
        )
        try:
            slot = self.client.stage(meta)
        except ArenaFullError:
            self._warn_once("the arena was full: chunks computed in a step were not published")
            self.transfers.add(unpublished_chunks=1)
            return None
        self._copies.gather(
            chunk.blocks, payload_view(slot[meta.payload_offset : meta.encoded_size], self.pages, pages)
        )
        return meta, slot

    def _publish(self, batch: list[tuple[ChunkMeta, memoryview]], salt: str | None) -> None:
        stored = [False] * len(batch)
        try:
            stored = self.client.publish(batch, tenant_salt=salt)
        finally:
            published = [meta for (meta, _), ok in zip(batch, stored, strict=True) if ok]
            self.transfers.add(
                published_chunks=len(published),
                unpublished_chunks=len(batch) - len(published),
                published_bytes=sum(meta.payload_bytes for meta in published),
            )
            self.published_chunks += len(published)

    # -- background ----------------------------------------------------------------------------------

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

    def _background_loop(self) -> None:
        self._io_thread_setup()
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

    def close(self) -> None:
        if self._begun is not None:
            self._abandon(self._begun[1].result())
        self.finish_load()
        self._async_loader.shutdown(wait=True)
        self._verifier.shutdown(wait=True)
        self._early_reader.shutdown(wait=True)
        self._layer_readers.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        if self._checks is not None:
            self._checks.shutdown(wait=True)
        for stores in self._after_forward:
            self._drop(stores)
        self._background.put(None)
        self._background_thread.join(timeout=30)
        self._copies.close()
        self.client.close()

    # -- sizes ---------------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def _object_bytes(self, stored_tokens: int) -> int:
        return payload_offset(stored_tokens) + payload_bytes(self.pages, self._pages(stored_tokens))

    def _dram_cut(self, stored_tokens: int) -> int | None:
        """Where the DRAM copy of a chunk of ``stored_tokens`` tokens is cut (one payload row per layer)."""
        return split_at(
            payload_offset(stored_tokens), len(self.layers), payload_bytes(self.pages, self._pages(stored_tokens))
        )
