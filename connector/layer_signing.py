"""A step's publishes copied out and signed layer by layer, behind the forward pass, where page copies are over when
they return (a CPU cache: connector/page_copies.py's ``LayerGather``).

vLLM hands each attention layer's KV to the connector (``save_kv_layer``) as soon as the layer has written it. The
pages of the chunks the step completes are copied into their arena slots then, one layer at a time, on vLLM's
thread (the same copies a publish after the forward pass makes), and the signer, a thread of the connector's own,
streams them into each chunk's MAC (``ChunkSigning``) in the payload's layer order while the later layers compute.
When the forward pass is over, only the layers no hook handed over are left to copy and sign (all of them where the
attention calls no hook), so the put and the registration start with the signatures ready: signing, the largest
part of publish-to-visible on the CPU backend, leaves it (benchmarks/hit_budget.py measures the parts).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from prefixcache.cachestore.chunks.codec import ChunkMeta, ChunkSigning
from prefixcache.connector.io_threads import behind_the_engine
from prefixcache.connector.metadata import SaveChunk
from prefixcache.connector.page_copies import LayerGather

log = logging.getLogger("prefixcache.connector")


@dataclass(frozen=True)
class StagedChunk:
    """A chunk to publish, in its arena slot: ``payload`` views the slot's payload as (layers, pages, page bytes)."""

    save: SaveChunk
    slot: memoryview
    payload: torch.Tensor
    signing: ChunkSigning

    @property
    def meta(self) -> ChunkMeta:
        return self.signing.meta

    def layer_bytes(self, layer: int) -> memoryview:
        """The slot's bytes of ``layer``'s pages, in the payload's order."""
        size = self.meta.payload_bytes // self.payload.shape[0]
        start = self.meta.payload_offset + layer * size
        return self.slot[start : start + size]


class Signer:
    """The thread that signs staged chunks, running its jobs in the order they come (``sign``, then ``then``).

    Its queue has no bound of its own: every job it holds refers to slots the arena lent, and a step whose chunks
    find no slot publishes nothing (the publisher counts them), so the arena bounds the work waiting here."""

    def __init__(self, io_thread_setup: Callable[[], None]) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._loop, args=(io_thread_setup,), name="prefixcache-signer", daemon=True
        )
        self._thread.start()

    def sign(self, chunks: Sequence[StagedChunk], layers: range) -> None:
        """Hash ``layers`` of each of ``chunks`` into its MAC, after the layers handed over before."""
        self._jobs.put(lambda: _sign(chunks, layers))

    def then(self, job: Callable[[], None]) -> None:
        """Run ``job`` once every signing handed over before is done."""
        self._jobs.put(job)

    def close(self) -> None:
        """Stop once the jobs queued are over."""
        self._jobs.put(None)
        self._thread.join(timeout=30)

    def _loop(self, io_thread_setup: Callable[[], None]) -> None:
        io_thread_setup()
        behind_the_engine()
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:  # noqa: BLE001 - a publish is best effort; the forward path never sees it
                log.exception("signing a step's chunks failed")


def _sign(chunks: Sequence[StagedChunk], layers: range) -> None:
    for layer in layers:
        for chunk in chunks:
            chunk.signing.update(chunk.layer_bytes(layer))


class LayeredSaves:
    """The steps' publishes copied out and signed layer by layer: the step under way, and the signer."""

    def __init__(
        self,
        copies: LayerGather,
        stage: Callable[[SaveChunk], StagedChunk | None],
        release: Callable[[memoryview], None],
        io_thread_setup: Callable[[], None],
    ) -> None:
        """``stage``: a chunk in its slot, its signature begun (None: no slot for it); ``release`` gives a slot
        back; ``io_thread_setup`` runs first in the signer's thread."""
        self._copies = copies
        self._stage = stage
        self._release = release
        self._signer = Signer(io_thread_setup)
        self._step: _Step | None = None

    def layer_written(self, saves: Sequence[SaveChunk], layer: int) -> None:
        """vLLM's ``save_kv_layer``: ``layer`` has written its pages of the step whose chunks to publish are
        ``saves`` (the step's chunks are staged at its first layer)."""
        self._step_of(saves).layer_written(layer)

    def finish(self, saves: Sequence[SaveChunk], then: Callable[[list[StagedChunk]], None]) -> None:
        """After the forward pass: copy out and hand over the layers no hook did; ``then`` gets the step's chunks
        on the signer, once they are signed (and owns their slots)."""
        step, self._step = self._step_of(saves), None
        staged = step.finish()
        if staged:
            self._signer.then(lambda: then(staged))

    def close(self) -> None:
        """Give back the slots of a step left unfinished, then stop the signer once its jobs are over."""
        if self._step is not None:
            self._give_back(self._step.staged)
            self._step = None
        self._signer.close()

    def _step_of(self, saves: Sequence[SaveChunk]) -> _Step:
        if self._step is not None and self._step.saves is not saves:  # never with vLLM: one metadata per step
            self._give_back(self._step.staged)
            self._step = None
        if self._step is None:
            staged = [chunk for chunk in map(self._stage, saves) if chunk is not None]
            self._step = _Step(saves, staged, self._copies, self._signer)
        return self._step

    def _give_back(self, staged: list[StagedChunk]) -> None:
        """Release the slots of chunks that will not be published, once the signer is done with them."""

        def release() -> None:
            for chunk in staged:
                self._release(chunk.slot)

        self._signer.then(release)


class _Step:
    """One step's chunks to publish, staged in their slots, their layers copied in (on vLLM's thread) and handed to
    the signer in layer order as the forward pass writes them."""

    def __init__(
        self, saves: Sequence[SaveChunk], staged: list[StagedChunk], copies: LayerGather, signer: Signer
    ) -> None:
        """``saves``: the step's saves, all of them (``staged``: those that found a slot)."""
        self.saves = saves
        self.staged = staged
        self._copies = copies
        self._signer = signer
        layers = staged[0].payload.shape[0] if staged else 0
        self._copied = [False] * layers
        self._handed = 0  # layers 0.._handed - 1 are with the signer

    def layer_written(self, layer: int) -> None:
        """Copy ``layer``'s pages out and hand every layer copied in order so far to the signer. A layer copied
        already is left as it is."""
        if not self.staged or self._copied[layer]:
            return
        for chunk in self.staged:
            self._copies.gather_layer(layer, chunk.save.blocks, chunk.payload[layer])
        self._copied[layer] = True
        ready = self._handed
        while ready < len(self._copied) and self._copied[ready]:
            ready += 1
        if ready > self._handed:
            self._signer.sign(self.staged, range(self._handed, ready))
            self._handed = ready

    def finish(self) -> list[StagedChunk]:
        """Copy out and hand over the layers no hook did; the chunks (signed once the signer's jobs so far are
        done)."""
        for layer in range(self._handed, len(self._copied)):
            self.layer_written(layer)
        return self.staged
