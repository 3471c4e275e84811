"""The connector's worker side while the store is not attached (connector/attachment.py), or while vLLM's sleep mode
has the KV cache unmapped (connector/worker_states.py).

It loads and publishes nothing. The scheduler side attaches on its own, so it may plan loads before this
worker has a client: each such load is reported failed, whole (its blocks as load errors, an asynchronous
one over in the same step), and vLLM computes those blocks instead of reading pages nobody wrote; the blocks of a
finished request whose output the scheduler side planned to publish are given back at once, unpublished.
Everything is reported in the step that planned it, so that between steps this side holds nothing and the
connector can swap in the real worker side once the store is attached.
"""

from __future__ import annotations

from prefixcache.connector.metadata import PrefixCacheMetadata
from prefixcache.connector.transfer_stats import TransferCounts


class DetachedWorker:
    saves_layers = False  # nothing is published

    def __init__(
        self,
        transfers: TransferCounts | None = None,
        errors: set[int] | None = None,
        finished: set[str] | None = None,
        released: set[str] | None = None,
    ) -> None:
        """What a worker side it takes over from left to report, if any: its counts, its load errors, its requests
        whose asynchronous loads are over and its finished requests whose pages are copied out."""
        self.transfers = transfers or TransferCounts()
        self._errors: set[int] = set(errors or ())
        self._finished: set[str] = set(finished or ())
        self._released: set[str] = set(released or ())  # finished requests whose blocks vLLM may free

    @property
    def idle(self) -> bool:
        """Nothing planned is still to report: the worker side may take over from here."""
        return not self._errors and not self._finished and not self._released

    def begin_step(self, meta: PrefixCacheMetadata) -> None:
        """Nothing starts early: nothing loads."""

    def start_load(self, meta: PrefixCacheMetadata) -> None:
        """Fail every load of the step. Every shard loads the same blocks, so the first shard's plans name them."""
        for request, chunks in (meta.loads[0] if meta.loads else {}).items():
            self._errors.update(block for chunk in chunks for block in chunk.blocks)
            if request in meta.load_async:
                self._finished.add(request)

    def wait_for_layer(self, layer: int) -> None:
        """No load is in flight."""

    def save_layer(self, meta: PrefixCacheMetadata, layer: int) -> None:
        """Nothing is published."""

    def save(self, meta: PrefixCacheMetadata) -> None:
        """Nothing is published: the finished requests' blocks may go."""
        self._released.update(meta.finished)

    def finished_saves(self) -> set[str]:
        released, self._released = self._released, set()
        return released

    def finished_async_loads(self) -> set[str]:
        finished, self._finished = self._finished, set()
        return finished

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        self.transfers.add(load_failed_blocks=len(errors))
        return errors

    def close(self) -> None:
        """Holds nothing."""
