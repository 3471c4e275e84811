"""Keeps vLLM's engine core off the cores its CPU workers compute on.

vLLM's CPU backend binds each worker's compute threads to cores of their own and reserves the others
(``VLLM_CPU_NUM_OF_RESERVED_CPU``) for the engine's other processes, but leaves the engine core
process unbound: it runs the scheduler and, between steps, busy-polls for the workers' output. While
the reserved cores idle the kernel keeps it there. The connector's work loads them (a publish's signing
and store, the daemon's write-behind, a DRAM hit's copy and verification), and the kernel then moves the
engine core onto a compute core, where its polling takes turns with the forward pass it waits for.
With ``engine_core_cpus: auto`` the scheduler side, which runs in the engine core once the workers are
bound, binds every thread of its process to the cores no worker computes on, the set vLLM reserved for it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from typing import Any

from prefixcache.connector.io_threads import IoCpus, ranks_bound_by_vllm

log = logging.getLogger("prefixcache.connector")


def engine_core_cpus(
    setting: IoCpus, *, multiprocess_cpu_workers: bool, allowed: Collection[int], compute: Collection[int]
) -> frozenset[int] | None:
    """The CPUs for the engine core's threads, or None to leave them where vLLM put them.

    ``multiprocess_cpu_workers``: vLLM's CPU backend runs its workers in processes of their own (a worker
    computing in this process would be bound with it); ``allowed`` the CPUs this process may use,
    ``compute`` those vLLM bound its workers' compute threads to (none known: nothing to avoid).
    """
    if setting == "inherit":
        return None
    if setting == "auto":
        spare = frozenset(allowed) - frozenset(compute)
        return spare if multiprocess_cpu_workers and compute and spare else None
    return frozenset(setting)


def workers_compute_cores(vllm_config: Any) -> frozenset[int]:
    """The cores vLLM binds its CPU workers' compute threads to, as its multiprocess executor computed them
    (``OMPProcessManager``: ``VLLM_CPU_OMP_THREADS_BIND``, automatic or the user's lists), and every core that
    variable names (other data-parallel engines' ranks too); none where vLLM binds nothing, or where this vLLM
    cannot say."""
    vllm_log = logging.getLogger("vllm.utils.ompmultiprocessing")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)  # its warnings were logged once, as the executor bound the workers
    try:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        lists = OMPProcessManager(vllm_config).cpu_lists
    except Exception as exc:  # noqa: BLE001 - an internal API of vLLM: unknown means leave the engine core be
        log.warning("prefixcache: cannot tell which cores vLLM's workers compute on (%s)", exc)
        return frozenset()
    finally:
        vllm_log.setLevel(level)
    ranks = ranks_bound_by_vllm(os.environ.get("VLLM_CPU_OMP_THREADS_BIND")) if lists else frozenset()
    return frozenset(cpu for cores in lists for cpu in cores) | ranks


def place_engine_core(setting: IoCpus, vllm_config: Any, *, on_cpu_backend: bool) -> None:
    """Bind every thread of this process, the engine core, as ``setting`` says (``engine_core_cpus``); the
    threads it starts later inherit that. A binding the host refuses is logged: slower, never wrong."""
    multiprocess = on_cpu_backend and vllm_config.parallel_config.distributed_executor_backend == "mp"
    cpus = engine_core_cpus(
        setting,
        multiprocess_cpu_workers=multiprocess,
        allowed=os.sched_getaffinity(0),
        compute=workers_compute_cores(vllm_config) if multiprocess and setting == "auto" else (),
    )
    if cpus is None:
        return
    try:
        for thread in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread), cpus)
    except OSError as exc:
        log.warning("prefixcache: cannot bind the engine core to CPUs %s (%s)", sorted(cpus), exc)
        return
    log.info("prefixcache: the engine core's threads on CPUs %s", sorted(cpus))
