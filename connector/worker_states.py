"""Which worker side the connector's hooks reach: detached (connector/detached_worker.py) until the worker's client
attaches, the real one (connector/worker_side.py) from then on, and detached again while vLLM's sleep mode has the KV
cache unmapped.

vLLM 0.33's GPU worker calls ``unregister_kv_caches`` in ``sleep()`` and ``discard()``, before it unmaps the device
memory of the KV cache, and ``restore_kv_caches`` in ``wake_up()``, once that memory is mapped again at the same
addresses (its contents lost). The real worker side holds views of the pages, device staging buffers, a pinned arena
and threads that copy pages in and out: ``unregister`` finishes what is under way and drops all of it, keeping only
the client and what vLLM has still to collect; meanwhile every load is reported failed, whole, so vLLM computes those
blocks (a miss, never KV read from unmapped memory), and nothing is published. ``restore`` makes a new worker side
over the same tensors at the next step's first hook, as when the client first attaches. vLLM 0.32 calls neither.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prefixcache.connector.detached_worker import DetachedWorker
from prefixcache.connector.transfer_stats import TransferCounts

if TYPE_CHECKING:
    from prefixcache.cachestore.client.cache_client import CacheClient
    from prefixcache.connector.worker_side import WorkerSide


class WorkerStates:
    def __init__(
        self,
        client: Callable[[], CacheClient | None],
        make: Callable[[CacheClient, TransferCounts], WorkerSide],
    ) -> None:
        """``client``: the worker's client, or None while it is not attached; ``make(client, transfers)``: a worker
        side over vLLM's KV cache that adds to ``transfers``."""
        self._client = client
        self._make = make
        self.current: WorkerSide | DetachedWorker = DetachedWorker()
        self.asleep = False  # the KV cache is unregistered (vLLM's sleep mode)

    @property
    def attached(self) -> WorkerSide | None:
        return None if isinstance(self.current, DetachedWorker) else self.current

    def adopt(self) -> None:
        """Between steps (the detached side holds nothing still to report), awake, with the client attached: make
        the real worker side. Called at each step's first hooks, on vLLM's thread, which owns the pages' device."""
        if self.asleep or not isinstance(self.current, DetachedWorker) or not self.current.idle:
            return
        if (client := self._client()) is not None:
            self.current = self._make(client, self.current.transfers)

    def unregister(self) -> None:
        """vLLM's ``unregister_kv_caches``: stop using the KV cache until ``restore``; idempotent."""
        self.asleep = True
        if (worker := self.attached) is None:
            return
        worker.close(keep_client=True)
        released = worker.finished_saves()
        finished = worker.finished_async_loads()  # their failed blocks join load_errors
        self.current = DetachedWorker(worker.transfers, set(worker.load_errors), finished, released)

    def restore(self) -> None:
        """vLLM's ``restore_kv_caches``: the KV cache is mapped again; the real worker side comes back now, or with the
        next step if the detached side has something left to report (``adopt``). Idempotent."""
        self.asleep = False
        self.adopt()

    def close(self) -> None:
        """The real worker side and its client; a detached one holds nothing (the connector closes the client)."""
        if (worker := self.attached) is not None:
            worker.close()
