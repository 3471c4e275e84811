"""How pages move between vLLM's KV cache and arena slots: at once on the CPU, on streams of their own on a GPU.

On the CPU a copy is over when it returns. On a GPU the connector's hooks run while the step's kernels
are only queued, so each copy must come after the kernels that wrote its pages and before any that
overwrite them, and the host must not read or reuse a slot while a copy still moves it.
``CudaPageCopies`` orders them with two CUDA streams and pins the arena (``cudaHostRegister``), so
copies run at DMA speed and never block the thread that queues them:

- **Publishes** (``gather``): the save stream waits for the compute stream (the forward pass that wrote
  the pages) and copies the pages into slots; ``saved`` returns what the publishing thread waits on
  before it reads them, so vLLM's own thread never waits for a device-to-host copy. A finished request's
  blocks go to the next request at once, so the next step's kernels must not overwrite pages still being
  copied: ``before_step``, at vLLM's first hook of every step, makes the compute stream wait for the
  copies. Not earlier: this step's sampling, queued after the publish, need not wait for it.
- **Loads** (``scatter``): the load stream waits for the save stream (a block whose old pages are still
  being published may be loaded into) and, on the thread that runs the model, for the compute stream;
  ``loaded`` blocks until every page is in, before the slots go back to the arena and before the load
  counts as over.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from connector.pages import gather, scatter

log = logging.getLogger("prefixcache.connector")
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


class PageCopies(Protocol):
    """Copies between the KV cache's pages and host tensors over arena slots (see connector/pages.py)."""

    def gather(self, layers: Sequence[torch.Tensor], blocks: Sequence[int], out: torch.Tensor) -> None:
        """Start copying pages ``blocks`` of every layer into ``out``."""

    def saved(self) -> Callable[[], None]:
        """What to call before reading the ``out`` of the gathers so far: it waits for their copies."""

    def before_step(self) -> None:
        """At vLLM's first hook of a step: the step's kernels wait for the gathers still reading pages."""

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
        """Start copying the first ``len(blocks)`` pages of ``src`` into pages ``blocks`` of every layer."""

    def loaded(self) -> None:
        """Wait until every scatter so far is over: its sources may be reused, its pages read."""

    def close(self) -> None: ...


def page_copies_for(layers: Sequence[torch.Tensor], host_memory: tuple[int, int]) -> PageCopies:
    """The copies for this KV cache; ``host_memory`` (address, size) is the arena every slot lies in."""
    device = layers[0].device
    if device.type == "cuda":
        return CudaPageCopies(device, host_memory)
    if device.type != "cpu":
        raise ValueError(f"KV cache on {device.type}: the connector copies pages of CPU and CUDA caches only")
    return HostPageCopies()


def _nothing() -> None:
    pass


class HostPageCopies:
    """A CPU cache: a copy is over when it returns."""

    def gather(self, layers: Sequence[torch.Tensor], blocks: Sequence[int], out: torch.Tensor) -> None:
        gather(layers, blocks, out)

    def saved(self) -> Callable[[], None]:
        return _nothing

    def before_step(self) -> None:
        pass

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
        scatter(src, layers, blocks)

    def loaded(self) -> None:
        pass

    def close(self) -> None:
        pass


class CudaPageCopies:
    """A cache on a CUDA device: copies on a save stream and a load stream, into and out of a pinned arena.

    Made on the thread that runs the model (vLLM's ``register_kv_caches``): that thread's current stream
    is the compute stream. Loads on other threads (asynchronous ones) go into blocks no running request
    uses, so they wait for our own publishes only."""

    def __init__(self, device: torch.device, host_memory: tuple[int, int]) -> None:
        self.device = device
        self._model_thread = threading.get_ident()
        self._save_stream = torch.cuda.Stream(device)
        self._load_stream = torch.cuda.Stream(device)
        self._pinned = pin_host_memory(*host_memory)
        self._gathering = False  # gathers queued since the last step began

    def gather(self, layers: Sequence[torch.Tensor], blocks: Sequence[int], out: torch.Tensor) -> None:
        self._save_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._save_stream):
            gather(layers, blocks, out, non_blocking=True)
        self._gathering = True

    def saved(self) -> Callable[[], None]:
        copied = torch.cuda.Event(blocking=True)  # the publishing thread sleeps while it waits, it does not spin
        copied.record(self._save_stream)
        return copied.synchronize

    def before_step(self) -> None:
        if self._gathering:
            torch.cuda.current_stream(self.device).wait_stream(self._save_stream)
            self._gathering = False

    def scatter(self, src: torch.Tensor, layers: Sequence[torch.Tensor], blocks: Sequence[int]) -> None:
        self._load_stream.wait_stream(self._save_stream)
        if threading.get_ident() == self._model_thread:
            self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._load_stream):
            scatter(src, layers, blocks, non_blocking=True)

    def loaded(self) -> None:
        self._load_stream.synchronize()

    def close(self) -> None:
        self._save_stream.synchronize()
        self._load_stream.synchronize()
        if self._pinned is not None:
            unpin_host_memory(self._pinned)
            self._pinned = None


def pin_host_memory(address: int, size: int) -> int | None:
    """Page-lock [address, address + size) for CUDA copies; returns the address to unpin, or None where
    CUDA refused (copies then still work, staged through the driver at pageable-memory speed)."""
    error = int(torch.cuda.cudart().cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE))
    if error != 0:
        log.warning("prefixcache: cannot pin the %d MiB arena for CUDA copies (cudaError %d); copies run at "
                    "pageable-memory speed", size >> 20, error)  # fmt: skip
        return None
    return address


def unpin_host_memory(address: int) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(address))
    if error != 0:
        log.warning("prefixcache: unpinning the arena failed (cudaError %d)", error)
