"""Which cores the connector's own threads run on, so that they never take a core from the forward pass.

vLLM's CPU backend binds a worker's compute (OpenMP) threads, its main thread included, to cores of
their own and leaves the cores it reserves (``VLLM_CPU_NUM_OF_RESERVED_CPU``) to the engine's other
processes. Threads the connector starts inherit that binding: a load's checksum verification and
Mooncake calls, its disk reads and the background publishes would all queue behind the forward pass
on the compute cores while the reserved ones wait on I/O. By default (``io_cpus="auto"``) they run on
the cores the worker does not compute on instead. Elsewhere (a GPU worker is not bound to compute
cores) ``auto`` leaves them where they start, as ``"inherit"`` always does; a list of CPU ids pins them
there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from typing import Annotated, Literal

from pydantic import Field, NonNegativeInt

log = logging.getLogger("prefixcache.connector")

IoCpus = Literal["auto", "inherit"] | Annotated[list[NonNegativeInt], Field(min_length=1)]


def io_cpus(
    setting: IoCpus, *, on_cpu_backend: bool, compute: Collection[int], online: Collection[int]
) -> frozenset[int] | None:
    """The CPUs for the connector's threads, or None to leave them bound as the worker is.

    ``compute`` is the worker's own binding when the connector starts, ``online`` every CPU of the host.
    """
    if setting == "inherit":
        return None
    if setting == "auto":
        spare = frozenset(online) - frozenset(compute)
        return spare if on_cpu_backend and spare else None
    return frozenset(setting)


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
            log.warning("cannot bind a connector thread to CPUs %s (%s); it stays on %s",
                        sorted(cpus), exc, sorted(os.sched_getaffinity(0)))  # fmt: skip

    return pin
