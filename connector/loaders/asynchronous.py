"""Asynchronous loads (connector/load_policy.py says which loads are), on a thread of their own while vLLM runs other
requests' steps: each step's loads go through the same loaders as a synchronous one (``load``: the worker side's
routing, connector/worker_side.py), but whole, placed and verified before they are reported over, and then the
chunks read from NVMe are stored into DRAM at once. Loads run one at a time, in the order vLLM scheduled them; vLLM
learns which requests' loads are over from ``get_finished``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from prefixcache.connector.loaders.base import Store
from prefixcache.connector.metadata import LoadChunk

log = logging.getLogger("prefixcache.connector")


class Asynchronous:
    """The loader of whole requests off the forward pass. It loads through the others, so it takes requests rather
    than chunks and has no layer to wait for: ``begin_load`` queues a step's loads, from whichever of vLLM's hooks
    comes first for them; ``get_finished`` reports those over."""

    def __init__(
        self,
        load: Callable[[list[LoadChunk], set[int]], list[Store]],
        store: Callable[[Store], None],
        io_thread_setup: Callable[[], None],
    ) -> None:
        """``load(chunks, errors)``: loads chunks whole, nothing computing behind them, putting the blocks that fail
        into ``errors``; returns the stores into DRAM of what it read from NVMe, which ``store`` runs (in the
        background); ``io_thread_setup`` runs first in this loader's thread (connector/io_threads.py)."""
        self._load = load
        self._store = store
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-async-load", initializer=io_thread_setup
        )
        # Asynchronous loads, in the order vLLM scheduled them: their requests, and the blocks that failed.
        self._loads: list[tuple[set[str], Future[set[int]]]] = []

    def begin_load(self, loads: dict[str, list[LoadChunk]]) -> None:
        """Queue one step's asynchronous loads (by request) behind those in flight."""
        chunks = [chunk for request in loads.values() for chunk in request]
        self._loads.append((set(loads), self._thread.submit(self._run, chunks)))

    def in_flight(self) -> bool:
        return any(not job.done() for _, job in self._loads)

    def wait(self) -> None:
        """Wait for every load queued."""
        for _, job in self._loads:
            job.exception()

    def get_finished(self, errors: set[int]) -> set[str]:
        """Requests whose asynchronous loads are over, intact or not, each reported once; their failed blocks go to
        ``errors``."""
        over: set[str] = set()
        while self._loads and self._loads[0][1].done():
            requests, job = self._loads.pop(0)
            errors.update(job.result())
            over |= requests
        return over

    def close(self) -> None:
        self._thread.shutdown(wait=True)

    def _run(self, chunks: list[LoadChunk]) -> set[int]:
        """One step's asynchronous loads, on this loader's thread. Returns the blocks that failed."""
        errors: set[int] = set()
        try:
            stores = self._load(chunks, errors)
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("loading %d chunks asynchronously failed; recomputing them", len(chunks))
            return {block for chunk in chunks for block in chunk.blocks}
        for store in stores:
            self._store(store)
        return errors
