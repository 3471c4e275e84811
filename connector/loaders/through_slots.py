"""Chunks fetched into arena slots, verified there and copied into vLLM's pages (on a GPU, on a stream of its own:
connector/page_copies.py) before the forward pass: every chunk when the KV cache lies outside the client's shared
memory, and the chunks the reads in place leave elsewhere. A load larger than the arena's room loads whole, in
windows of as many chunks as it has room for. What a load read from NVMe is stored back into DRAM from its slots
once the load is over (once the forward pass is, for a load it reads).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Literal

from prefixcache.cachestore.chunks.arena import ArenaFullError
from prefixcache.cachestore.chunks.runs import runs_of_about
from prefixcache.cachestore.client.slot_loads import Fetched, FetchedPayload, SlotLoad
from prefixcache.cachestore.tiers.nvme_io import read_size
from prefixcache.connector.loaders.base import ArenaWarnings, CountLoaded, Store, drop
from prefixcache.connector.loaders.layout import KvLayout
from prefixcache.connector.metadata import LoadChunk
from prefixcache.connector.page_copies import PageCopies
from prefixcache.connector.pages import payload_bytes, payload_view

log = logging.getLogger("prefixcache.connector")


@dataclass
class SlotsRead:
    """Chunks to load through slots, the slots the first of them have already, and the load that holds the NVMe
    reads started into those slots."""

    chunks: list[LoadChunk]
    slots: list[memoryview]
    reads: SlotLoad


@dataclass
class _FetchedGroup:
    """One group's payloads, verified or being verified (``SlotLoad.fetch_checking_later``; None: recompute), and the
    objects among them read from NVMe."""

    payloads: list[FetchedPayload]
    from_disk: dict[bytes, memoryview] = field(default_factory=dict)


class ThroughSlots:
    def __init__(
        self,
        layout: KvLayout,
        copies: PageCopies,
        count: CountLoaded,
        warn: ArenaWarnings,
        io_thread_setup: Callable[[], None],
        check_threads: int | Literal["auto"] = "auto",
    ) -> None:
        """``copies``: how pages are placed; ``count``: counts the chunks that arrived intact; ``warn``: says what
        the arena's size costs; ``io_thread_setup`` runs first in each thread (connector/io_threads.py);
        ``check_threads`` verify the chunks while the next are fetched (0: the fetch thread does; ``"auto"``: as
        many as ``copies`` ask for)."""
        self._layout = layout
        self._client = layout.client
        self._copies = copies
        self._count = count
        self._warn = warn
        self._fetcher = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-fetch", initializer=io_thread_setup
        )
        if check_threads == "auto":
            check_threads = copies.check_threads
        self._checks = (
            ThreadPoolExecutor(
                max_workers=check_threads, thread_name_prefix="prefixcache-check", initializer=io_thread_setup
            )
            if check_threads
            else None
        )
        self._store: Store | None = None  # this step's store into DRAM of what it read from NVMe

    # -- Loader --------------------------------------------------------------------------------------

    def begin_load(
        self, chunks: list[LoadChunk], read_ahead: Collection[LoadChunk] = ()
    ) -> tuple[SlotsRead, list[LoadChunk]]:
        """An arena slot for each of the first chunks, in order, while the arena has room, and for those of them in
        ``read_ahead`` (chunks DRAM does not hold), their reads from NVMe started at once; the fetch asks for the
        others. Takes every chunk: those without slots load in a later window."""
        slots = self._slots(chunks)
        ahead = {id(chunk) for chunk in read_ahead}
        reads = self._client.load()
        if pairs := [(chunk.key, slot) for chunk, slot in zip(chunks, slots, strict=False) if id(chunk) in ahead]:
            reads.read_ahead(pairs)
        return SlotsRead(chunks, slots, reads), []

    def start_load_kv(self, read: SlotsRead, errors: set[int]) -> None:
        """Load the step's chunks into their pages before the forward pass."""
        self._store = self.load(read, errors)

    def wait_for_layer_load(self, layer: int) -> None:
        """Every layer is in before the forward pass."""

    def finish(self, errors: set[int]) -> Store | None:
        """The store into DRAM of what the step's load read from NVMe."""
        store, self._store = self._store, None
        return store

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)
        if self._checks is not None:
            self._checks.shutdown(wait=True)

    # -- loads ---------------------------------------------------------------------------------------

    def load(self, read: SlotsRead, errors: set[int]) -> Store | None:
        """Fetch chunks into arena slots and place them, in windows of as many chunks as the arena has room
        for: a hit larger than the arena still loads whole (a GPU hit of an 8B model's 8k-token prompt is
        1 GiB), in the slots each window gives back. Blocks of chunks that fail go to ``errors``.

        Returns the job that stores the chunks the last window read from NVMe into DRAM, with the slots it holds,
        for the caller to run once the load is over. Earlier windows' NVMe reads are not stored back: the next
        window needs their slots.
        """
        chunks, slots = read.chunks, read.slots
        stores = None
        while chunks:
            if not slots:
                if stores is not None:
                    drop(self._client, stores)
                    stores = None
                slots = self._slots(chunks)
            if not slots:
                log.warning("arena full: recomputing instead of loading %d chunks", len(chunks))
                for chunk in chunks:
                    errors.update(chunk.blocks)
                break
            if len(slots) < len(chunks):
                self._warn(
                    "a load did not fit in the arena's free room and loads in windows; what earlier "
                    "windows read from NVMe is not put back into DRAM"
                )
            window, chunks = chunks[: len(slots)], chunks[len(slots) :]
            stores = self._load_window(read.reads, window, slots, errors)
            slots = []
        return stores

    def abandon(self, read: SlotsRead) -> None:
        """Give back the slots of a read that will not be loaded, once no NVMe read started ahead writes into them."""
        read.reads.close()
        for slot in read.slots:
            self._client.release(slot)

    def _load_window(
        self, reads: SlotLoad, chunks: list[LoadChunk], slots: list[memoryview], errors: set[int]
    ) -> Store | None:
        """Load chunks that all have slots, in groups, placing one group while the next is read. On a GPU
        worker the check threads verify a group's chunks while the segment owner (another process) copies
        the next group into the arena; elsewhere the fetch thread verifies each group after the owner's copy.
        Each fetch names the chunks still to come with their slots: chunks that must come back from this node's
        NVMe are read into place ahead of their turn, and those on other nodes are asked for in one request.
        A chunk whose DRAM copy fails its check is fetched again once the rest are placed, from NVMe.
        Returns the job that stores the chunks read from NVMe into DRAM, with the slots it holds. ``reads`` holds
        the window's reads from NVMe started ahead: closed before its slots are given back.
        """
        upcoming = list(zip((chunk.key for chunk in chunks), slots, strict=True))
        cuts = {chunk.key: self._layout.dram_cut(chunk.stored_tokens) for chunk in chunks}
        remote = {chunk.key for chunk in chunks if chunk.remote}
        groups = runs_of_about(upcoming, lambda pair: len(pair[1]), self._copies.load_group_bytes)
        ends = list(itertools.accumulate(len(group) for group in groups))
        read_from_disk: dict[bytes, memoryview] = {}
        checking: list[Future[memoryview | None]] = []  # every check started, for the slots' release
        damaged: list[int] = []  # positions of chunks whose DRAM copies failed their checks
        pending: Future[_FetchedGroup] | None = self._fetcher.submit(
            self._fetch, reads, groups[0], upcoming[ends[0] :], cuts, remote
        )
        try:
            for i, group in enumerate(groups):
                assert pending is not None  # one is in flight per group left
                fetched = pending.result()
                pending = None
                if i + 1 < len(groups):
                    pending = self._fetcher.submit(
                        self._fetch, reads, groups[i + 1], upcoming[ends[i + 1] :], cuts, remote
                    )
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
                again = self._fetch(reads, [upcoming[at] for at in damaged], [], cuts, remote, check_later=False)
                read_from_disk.update(again.from_disk)
                self._place(
                    [(chunks[at], self._checked(got)) for at, got in zip(damaged, again.payloads, strict=True)], errors
                )
        finally:
            if pending is not None and pending.exception() is None:  # the fetch in flight must finish first
                checking += [got for got in pending.result().payloads if isinstance(got, Future)]
            wait(checking)  # and so must the checks reading the slots
            reads.close()
            self._copies.loaded()  # and so must the copies out of them (into a GPU's pages)
            held = [slot for (key, slot) in upcoming if key in read_from_disk]
            for key, slot in upcoming:
                if key not in read_from_disk:
                    self._client.release(slot)
        if not held:
            return None
        return functools.partial(self._client.store_disk_reads, list(read_from_disk.items())), held

    @staticmethod
    def _checked(payload: FetchedPayload) -> memoryview | None:
        """A payload, once its check is over (None: recompute)."""
        if not isinstance(payload, Future):
            return payload
        try:
            return payload.result()
        except Exception:  # noqa: BLE001 - a failed check is a miss; the request must not fail
            log.exception("checking a loaded chunk failed; recomputing it")
            return None

    def _slots(self, chunks: list[LoadChunk]) -> list[memoryview]:
        """An arena slot for each of the first chunks, in order, while the arena has room."""
        slots: list[memoryview] = []
        try:
            for chunk in chunks:
                slots.append(self._client.slot(read_size(self._layout.object_bytes(chunk.stored_tokens))))
        except ArenaFullError:
            pass  # the rest load in a later window (load)
        return slots

    def _fetch(
        self,
        reads: SlotLoad,
        group: list[tuple[bytes, memoryview]],
        upcoming: list[tuple[bytes, memoryview]],
        cuts: dict[bytes, int | None],
        remote: set[bytes],
        check_later: bool = True,
    ) -> _FetchedGroup:
        """Fetch one group into its slots, each chunk's two DRAM parts in one call (``cuts``: where each is cut),
        its DRAM copies checked on the check threads (``check_later``, where this loader has them) or before
        this returns, with a deadline where one of them lies in another node's DRAM (``remote``); runs on the fetch
        thread, as part of ``reads``."""
        fetched = _FetchedGroup(payloads=[None] * len(group))
        keys, slots = [key for key, _ in group], [slot for _, slot in group]
        at = [cuts[key] for key in keys]
        across = any(key in remote for key in keys)
        try:
            got: Fetched[FetchedPayload] | Fetched[memoryview | None]
            if check_later and self._checks is not None:
                got = reads.fetch_checking_later(
                    keys, slots, upcoming=upcoming, checks=self._checks, cuts=at, across_network=across
                )
            else:
                got = reads.fetch(keys, slots, upcoming=upcoming, cuts=at, across_network=across)
            fetched.payloads, fetched.from_disk = list(got.payloads), dict(got.from_disk)
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks failed; recomputing them", len(group))
        return fetched

    def _place(self, placing: list[tuple[LoadChunk, memoryview | None]], errors: set[int]) -> None:
        """Copy each chunk's payload into its blocks; a chunk without one (None, or of another size) goes to
        ``errors``."""
        pages = self._layout.pages
        for chunk, payload in placing:
            n = self._layout.pages_of(chunk.stored_tokens)
            if payload is None or len(payload) != payload_bytes(pages, n):
                errors.update(chunk.blocks)
                continue
            src = payload_view(payload, pages, n)[:, chunk.first_page :]
            self._copies.scatter(src, chunk.blocks)
            self._count([chunk])
