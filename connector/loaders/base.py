"""What a loader is: one way chunks get into vLLM's pages, with the threads it needs, driven through a step by the
worker side (connector/worker_side.py), which gives each loader the step's chunks it takes."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from prefixcache.connector.metadata import LoadChunk

if TYPE_CHECKING:
    from prefixcache.cachestore.client.cache_client import CacheClient

log = logging.getLogger("prefixcache.connector")

#: A store into DRAM of chunks a load read from NVMe, to run once the forward pass is over, and the slots it holds.
Store = tuple[Callable[[], object], list[memoryview]]
#: Counts chunks that arrived intact in their pages (the worker side's counts and transfer statistics).
CountLoaded = Callable[[list[LoadChunk]], None]

Read = TypeVar("Read")


class Loader(Protocol[Read]):
    """A load path into vLLM's pages. The worker side calls it as vLLM's hooks come, for the load vLLM's forward
    pass reads (an asynchronous load runs the same reads off the forward pass: connector/loaders/asynchronous.py):

    - ``begin_load(chunks)``, before the forward pass may start (from vLLM's first hook of the step where the load
      may begin then, else from ``start_load_kv``): starts loading the chunks this path takes, on any thread; returns
      its read of them (None: it took none) and the chunks it leaves to the other paths.
    - ``start_load_kv(read, errors)``: the read is this step's. What the forward pass reads before it first waits is
      in its pages when this returns; the rest arrives, and is verified, behind the forward pass.
    - ``wait_for_layer_load(layer)``: an attention layer is about to read its KV: this waits for the step's reads of
      that layer.
    - ``finish(errors)``, before vLLM asks for load errors or the step's pages are published (``wait_for_save``):
      waits for the step's verdict; returns its store into DRAM of chunks it read from NVMe.
    - ``close()``: shuts down the threads it made.

    Blocks of chunks that fail go to ``errors``: vLLM recomputes them.
    """

    def begin_load(self, chunks: list[LoadChunk]) -> tuple[Read | None, list[LoadChunk]]: ...

    def start_load_kv(self, read: Read, errors: set[int]) -> None: ...

    def wait_for_layer_load(self, layer: int) -> None: ...

    def finish(self, errors: set[int]) -> Store | None: ...

    def close(self) -> None: ...


def drop(client: CacheClient, store: Store) -> None:
    """Give back the slots of a store into DRAM that will not run."""
    for slot in store[1]:
        client.release(slot)


class ArenaWarnings:
    """What the arena's size costs (loads in windows, chunks not published), logged once per kind."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def __call__(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            log.warning("%s; raise arena_mb (warned once)", message)
