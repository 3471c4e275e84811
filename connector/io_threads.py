"""Which cores the connector's own threads run on, so that they never take a core from the forward pass.

vLLM's CPU backend binds a worker's compute (OpenMP) threads, its main thread included, to cores of
their own and leaves the cores it reserves (``VLLM_CPU_NUM_OF_RESERVED_CPU``) to the engine's other
processes. Threads the connector starts inherit that binding: a load's MAC verification and
Mooncake calls, its disk reads and the background publishes would all queue behind the forward pass
on the compute cores while the reserved ones wait on I/O. By default (``io_cpus="auto"``) they run on
the cores no rank computes on instead, on the worker's own NUMA node: under tensor parallelism vLLM
binds each rank to a node of its own (or to the lists in ``VLLM_CPU_OMP_THREADS_BIND``), and a spare
core is one no rank of the engine was given. Elsewhere (a GPU worker is not bound to compute
cores) ``auto`` leaves them where they start, as ``"inherit"`` always does; a list of CPU ids pins them
there.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt

from prefixcache.cachestore.host.cpus import cpu_list

log = logging.getLogger("prefixcache.connector")

IoCpus = Literal["auto", "inherit"] | Annotated[list[NonNegativeInt], Field(min_length=1)]


def io_cpus(
    setting: IoCpus,
    *,
    on_cpu_backend: bool,
    compute: Collection[int],
    online: Collection[int],
    other_ranks: Collection[int] = (),
    numa_nodes: Sequence[Collection[int]] = (),
) -> frozenset[int] | None:
    """The CPUs for the connector's threads, or None to leave them bound as the worker is.

    ``compute`` is the worker's own binding when the connector starts, ``online`` every CPU of the host,
    ``other_ranks`` the cores vLLM bound the engine's other ranks to (``ranks_bound_by_vllm``) and
    ``numa_nodes`` the CPUs of each NUMA node (``numa_node_cpus``; none known: one node).
    """
    if setting == "inherit":
        return None
    if setting == "auto":
        neighbours = frozenset(online)
        own_nodes = [frozenset(node) for node in numa_nodes if not frozenset(node).isdisjoint(compute)]
        if own_nodes:
            neighbours &= frozenset().union(*own_nodes)
        spare = neighbours - frozenset(compute) - frozenset(other_ranks)
        return spare if on_cpu_backend and spare else None
    return frozenset(setting)


def ranks_bound_by_vllm(omp_threads_bind: str | None) -> frozenset[int]:
    """Every core named in ``VLLM_CPU_OMP_THREADS_BIND`` ("0-3|4-7": one list per rank); none when vLLM
    binds automatically (each rank on its own NUMA node) or not at all."""
    if not omp_threads_bind or omp_threads_bind in ("auto", "nobind"):
        return frozenset()
    return frozenset().union(*(cpu_list(ranks) for ranks in omp_threads_bind.split("|")))


def numa_node_cpus(sysfs: Path = Path("/sys/devices/system/node")) -> list[frozenset[int]]:
    """The CPUs of each NUMA node of this host (empty where sysfs does not say)."""
    return [cpu_list(path.read_text()) for path in sorted(sysfs.glob("node[0-9]*/cpulist"))]


#: The nice value the connector's background thread takes at least (``behind_the_engine``).
BACKGROUND_NICE = 10


def behind_the_engine() -> None:
    """Lower the calling thread's priority to ``BACKGROUND_NICE`` (Linux's nice is per thread): work no request
    waits for (publishing, storing NVMe reads into DRAM) then yields a shared core to the engine's own processes,
    such as the engine core sampling and sending out the first token of the hit those reads served. Refused (a
    host that forbids it), the thread keeps its priority: slower to yield, never wrong."""
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, max(BACKGROUND_NICE, os.getpriority(os.PRIO_PROCESS, thread)))
    except OSError as exc:
        log.warning("cannot lower the priority of the connector's background thread (%s)", exc)


def pinning(cpus: frozenset[int] | None) -> Callable[[], None]:
    """A thread initializer that binds the calling thread to ``cpus`` (nothing when None).

    A binding the host refuses (CPUs outside this container's set, say) is logged once per thread and
    the thread runs where it started: slower, never wrong.
    """

    def pin() -> None:
        if cpus is None:
            return
        try:
            os.sched_setaffinity(0, cpus)
        except OSError as exc:
            log.warning(
                "cannot bind a connector thread to CPUs %s (%s); it stays on %s",
                sorted(cpus),
                exc,
                sorted(os.sched_getaffinity(0)),
            )

    return pin
