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

Each kind also says how a load through slots is best cut up for it (``load_group_bytes``) and how many
threads should check its chunks (``check_threads``): placing costs a memcpy on the host's cores on the CPU,
a DMA on a GPU.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from prefixcache.connector.pages import gather, scatter
from prefixcache.connector.settings import Directions

log = logging.getLogger("prefixcache.connector")
_CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class PageCopies(Protocol):
    """Copies between the KV cache's pages (its layers' ``page_rows``, connector/pages.py) and host tensors
    over arena slots, shaped (layers, pages, page bytes)."""

    #: Bytes fetched per Mooncake call while loading through slots: small enough that reading the next group
    #: overlaps checking and placing this one, large enough that per-call overhead stays small.
    load_group_bytes: int
    #: Threads that verify chunks loaded through slots while the next are copied (``check_threads: "auto"``;
    #: 0: the fetch thread checks each group after the segment owner's copy).
    check_threads: int

    def gather(self, blocks: Sequence[int], out: torch.Tensor) -> None:
        """Start copying pages ``blocks`` of every layer into ``out``."""

    def saved(self) -> Callable[[], None]:
        """What to call before reading the ``out`` of the gathers so far: it waits for their copies."""

    def before_step(self) -> None:
        """At vLLM's first hook of a step: the step's kernels wait for the gathers still reading pages."""

    def scatter(self, src: torch.Tensor, blocks: Sequence[int]) -> None:
        """Start copying the first ``len(blocks)`` pages of ``src`` into pages ``blocks`` of every layer."""

    def loaded(self) -> None:
        """Wait until every scatter so far is over: its sources may be reused, its pages read."""

    def close(self) -> None: ...


@runtime_checkable
class LayerGather(Protocol):
    """Copies over when they return (a CPU cache's): a publish copies each layer's pages out as soon as the forward
    pass has written them and signs them behind the later layers (connector/layer_signing.py). A GPU's copies
    are queued on a stream and cross PCIe once per chunk, every layer at once, after the forward pass."""

    def gather_layer(self, layer: int, blocks: Sequence[int], out: torch.Tensor) -> None:
        """Copy pages ``blocks`` of ``layer`` into ``out`` (len(blocks), page bytes), now."""


BOTH_WAYS = Directions(loads=True, publishes=True)


def page_copies_for(
    pages: Sequence[torch.Tensor], host_memory: tuple[int, int], chunk_pages: int, directions: Directions = BOTH_WAYS
) -> PageCopies:
    """The copies for this KV cache; ``host_memory`` (address, size) is the arena every slot lies in, a copy
    moves at most ``chunk_pages`` pages of each layer (one chunk), and only the ``directions`` the engine's
    role takes are made ready (on a GPU each direction holds device memory)."""
    device = pages[0].device
    if device.type == "cuda":
        return CudaPageCopies(pages, host_memory, chunk_pages, directions)
    if device.type != "cpu":
        raise ValueError(f"KV cache on {device.type}: the connector copies pages of CPU and CUDA caches only")
    return HostPageCopies(pages)


def _nothing() -> None:
    pass


class HostPageCopies:
    """A CPU cache: a copy is over when it returns.

    Placing is a memcpy on the cores the reads and checks use too, so groups stay small and the fetch thread
    checks: its spare cores also run the segment owner's copy, and where cores are few, more check threads
    make loads through slots slower, not faster (``benchmarks/windows.py`` measures it)."""

    load_group_bytes = 8 << 20
    check_threads = 0

    def __init__(self, pages: Sequence[torch.Tensor]) -> None:
        self._pages = list(pages)

    def gather(self, blocks: Sequence[int], out: torch.Tensor) -> None:
        gather(self._pages, blocks, out)

    def gather_layer(self, layer: int, blocks: Sequence[int], out: torch.Tensor) -> None:
        gather(self._pages[layer : layer + 1], blocks, out.unsqueeze(0))

    def saved(self) -> Callable[[], None]:
        return _nothing

    def before_step(self) -> None:
        pass

    def scatter(self, src: torch.Tensor, blocks: Sequence[int]) -> None:
        scatter(src, self._pages, blocks)

    def loaded(self) -> None:
        pass

    def close(self) -> None:
        pass


class CudaPageCopies:
    """A cache on a CUDA device: copies on streams of their own, into and out of a pinned arena.

    A chunk's pages cross PCIe in one copy, through a staging buffer on the device: one kernel moves them
    between the staging buffer and their blocks, wherever those lie, for every layer at once where the
    layers lie a constant stride apart in one allocation (as vLLM allocates them). Copying each run of
    consecutive blocks straight across costs a copy per run and layer instead, and a long-lived engine's
    blocks are scattered (benchmarks/cuda_copies.py measures both). Each direction has two lanes, a
    stream and a staging buffer each, and chunks alternate between them, so one chunk's kernel runs while
    the next one crosses PCIe. A direction the engine's role does not take (a ``kv_producer`` never loads)
    gets no lanes, and its staging memory stays with vLLM.

    Made on the thread that runs the model (vLLM's ``register_kv_caches``): that thread's current stream
    is the compute stream. Loads on other threads (asynchronous ones) go into blocks no running request
    uses, so they wait for our own publishes only.

    Placing is a DMA here, so fewer, larger Mooncake calls win: larger groups load a hit of many chunks sooner
    (``benchmarks/windows.py`` measures it). One thread checks chunks in not much less time than Mooncake takes to
    copy them, so several check threads keep the checks off the load's path."""

    load_group_bytes = 32 << 20
    check_threads = 4

    def __init__(
        self,
        pages: Sequence[torch.Tensor],
        host_memory: tuple[int, int],
        chunk_pages: int,
        directions: Directions = BOTH_WAYS,
    ) -> None:
        self.device = pages[0].device
        word = _widest_word(pages)
        self._groups = layer_groups([layer.view(word) for layer in pages])  # kernels move words, not bytes
        self._shape = (len(pages), pages[0].shape[1])  # layers, page bytes
        self._word = word
        self._chunk_pages = chunk_pages
        self._model_thread = threading.get_ident()
        layers, page = self._shape
        staging = layers * chunk_pages * page
        self._save_lanes = [_Lane(self.device, staging) for _ in range(2 if directions.publishes else 0)]
        self._load_lanes = [_Lane(self.device, staging) for _ in range(2 if directions.loads else 0)]
        lanes = len(self._save_lanes) + len(self._load_lanes)
        log.info(
            "prefixcache: %d MiB of device memory stage pages (%d layer groups)",
            lanes * staging >> 20,
            len(self._groups),
        )
        self._pinned = pin_host_memory(*host_memory)
        self._gathering = False  # gathers queued since the last step began

    def gather(self, blocks: Sequence[int], out: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        for at, part, lane in self._parts(blocks, self._save_lanes):
            lane.stream.wait_stream(compute)
            with torch.cuda.stream(lane.stream):
                staged = self._staged(lane, len(part))
                index = self._index(part)
                for first, group in self._groups:
                    torch.index_select(group, 1, index, out=staged[first : first + len(group)])
                out[:, at : at + len(part)].copy_(staged.view(torch.uint8), non_blocking=True)
        self._gathering = True

    def saved(self) -> Callable[[], None]:
        events = []
        for lane in self._save_lanes:
            copied = torch.cuda.Event(blocking=True)  # the publishing thread sleeps while it waits, it does not spin
            copied.record(lane.stream)
            events.append(copied)

        def wait() -> None:
            for event in events:
                event.synchronize()

        return wait

    def before_step(self) -> None:
        if self._gathering:
            for lane in self._save_lanes:
                torch.cuda.current_stream(self.device).wait_stream(lane.stream)
            self._gathering = False

    def scatter(self, src: torch.Tensor, blocks: Sequence[int]) -> None:
        on_model_thread = threading.get_ident() == self._model_thread
        for at, part, lane in self._parts(blocks, self._load_lanes):
            for publishing in self._save_lanes:  # a block whose old pages are still being published
                lane.stream.wait_stream(publishing.stream)
            if on_model_thread:
                lane.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(lane.stream):
                staged = self._staged(lane, len(part))
                pieces = src[:, at : at + len(part)]
                if pieces.is_contiguous():
                    staged.view(torch.uint8).copy_(pieces, non_blocking=True)
                else:  # a chunk loaded from a later page: each layer's pages are one run
                    for layer_staged, layer_pieces in zip(staged.view(torch.uint8), pieces, strict=True):
                        layer_staged.copy_(layer_pieces, non_blocking=True)
                index = self._index(part)
                for first, group in self._groups:
                    group.index_copy_(1, index, staged[first : first + len(group)])

    def loaded(self) -> None:
        for lane in self._load_lanes:
            lane.stream.synchronize()

    def close(self) -> None:
        """Wait for every copy, then let go of the staging buffers and of the views of vLLM's pages at once: under
        vLLM's sleep mode the device memory behind them is unmapped right after (connector/worker_states.py)."""
        for lane in self._save_lanes + self._load_lanes:
            lane.stream.synchronize()
        self._save_lanes, self._load_lanes, self._groups = [], [], []
        if self._pinned is not None:
            unpin_host_memory(self._pinned)
            self._pinned = None

    def _parts(self, blocks: Sequence[int], lanes: list[_Lane]) -> Iterator[tuple[int, Sequence[int], _Lane]]:
        """Each chunk-sized part of ``blocks`` (where it starts, its blocks) with the lane it takes: the
        direction's two lanes in turn, across calls too."""
        if not lanes:
            raise RuntimeError("pages copied in a direction this engine's kv_role does not take: it has no lanes")
        for at in range(0, len(blocks), self._chunk_pages):
            yield at, blocks[at : at + self._chunk_pages], lanes[0]
            lanes.reverse()

    def _staged(self, lane: _Lane, num_pages: int) -> torch.Tensor:
        """The start of the lane's buffer as (layers, num_pages, page words), contiguous: one copy crosses PCIe."""
        layers, page = self._shape
        return lane.staging[: layers * num_pages * page].view(self._word).view(layers, num_pages, -1)

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        """``blocks`` on the device, copied on the current stream from pinned memory (the host does not wait)."""
        return torch.tensor(blocks, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)


class _Lane:
    """A stream and the staging buffer only it uses: stream order keeps one chunk's copies off another's."""

    def __init__(self, device: torch.device, staging_bytes: int) -> None:
        self.stream = torch.cuda.Stream(device)
        self.staging = torch.empty(staging_bytes, dtype=torch.uint8, device=device)


def layer_groups(rows: Sequence[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """``(first layer, (layers, blocks, page items) view)`` for each run of layers whose pages lie a constant
    stride apart in one allocation, in layer order; one layer alone where they do not."""
    groups: list[tuple[int, torch.Tensor]] = []
    first = 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and _extends(rows, first, i):
            continue
        head = rows[first]
        step = (rows[first + 1].data_ptr() - head.data_ptr()) // head.element_size() if i - first > 1 else 0
        groups.append(
            (first, torch.as_strided(head, (i - first, *head.shape), (step, *head.stride()), head.storage_offset()))
        )
        first = i
    return groups


def _extends(rows: Sequence[torch.Tensor], first: int, i: int) -> bool:
    """Whether layer ``i`` continues the group that starts at layer ``first``."""
    head, layer = rows[first], rows[i]
    if (
        layer.untyped_storage().data_ptr() != head.untyped_storage().data_ptr()
        or layer.shape != head.shape
        or layer.stride() != head.stride()
    ):
        return False
    step = rows[first + 1].data_ptr() - head.data_ptr() if i > first + 1 else layer.data_ptr() - head.data_ptr()
    return step > 0 and step % head.element_size() == 0 and layer.data_ptr() - rows[i - 1].data_ptr() == step


def _widest_word(pages: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest integer type whose items tile every layer's pages: size, row stride and start."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if all(p.shape[1] % size == 0 and p.stride(0) % size == 0 and p.storage_offset() % size == 0 for p in pages):
            return word
    return torch.uint8


def pin_host_memory(address: int, size: int) -> int | None:
    """Page-lock [address, address + size) for CUDA copies; returns the address to unpin, or None where it is
    not ours to unpin: pinned already (by the transfer engine, say), or refused by CUDA (copies then still
    work, staged through the driver at pageable-memory speed)."""
    error = int(torch.cuda.cudart().cudaHostRegister(address, size, _CUDA_HOST_REGISTER_PORTABLE))
    if error == 0:
        return address
    _forget_cuda_error()
    if error == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        log.info("prefixcache: the %d MiB arena is pinned already", size >> 20)
    else:
        log.warning(
            "prefixcache: cannot pin the %d MiB arena for CUDA copies (cudaError %d); copies run at "
            "pageable-memory speed",
            size >> 20,
            error,
        )
    return None


def unpin_host_memory(address: int) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(address))
    if error != 0:
        _forget_cuda_error()
        log.warning("prefixcache: unpinning the arena failed (cudaError %d)", error)


def _forget_cuda_error() -> None:
    """Reset the thread's last CUDA error after a failure handled here.

    torch passes cudaHostRegister's error back without resetting it, and its next kernel-launch check
    would raise it from whatever ran next in vLLM. Only cudaGetLastError resets it, which torch does not
    expose: call it in each CUDA runtime library the process has loaded (each keeps its own)."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "/libcudart.so" in line}
    for library in sorted(libraries):
        ctypes.CDLL(library).cudaGetLastError()
