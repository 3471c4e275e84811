"""Bursts of cached prompts: many requests that all hit, arriving together.

    python -m benchmarks.burst [--bursts 32x1025,8x4097] [--rounds 3] [--servers-on reserved|anywhere]

A shared system prompt or document is hit by many requests at once. Here a burst is N prompts of L tokens,
all cached, submitted in one ``generate`` call with ``max_tokens=1``: vLLM schedules them in one pass (each
computes one token), so the whole burst is one step, looked up in one round trip (connector/lookups.py) and
loaded in one Mooncake call from DRAM, or in one planned set of reads from NVMe. The figure is the call's
wall time (the last request's first token), median over rounds; the median TTFT inside the burst is shown
beside it.

Rows, each engine a fresh process with ``benchmarks.ttft``'s CPU binding, dtype and warm-up prompt, and a first,
unmeasured burst of each shape, run as the row runs its measured ones (cold, then repeated, where the row repeats
them; published by the producer, so that consumers hit it), so that no measured round pays for the first
computation of its shape, which the first NVMe rounds and vLLM's own first hit otherwise do:

- ``cold`` and ``vllm-prefix-cache``: one engine with vLLM's own prefix cache on and no connector. Each shape's
  first burst computes its prompts (cold); the next ``--rounds`` bursts repeat them (vLLM's own hit, the
  ceiling: one token per request computed, nothing moved).
- ``prefixcache-dram`` and ``prefixcache-nvme``: a producer engine publishes one set of prompts per round and
  shape, and exits. A consumer engine (vLLM's own prefix cache off) runs one set per round from DRAM; after
  the daemon restarts, another runs them from the NVMe tier alone. Each round's set is new to the engine, so
  no NVMe read is answered by a promotion an earlier round caused. The consumers' first bursts are recorded
  apart, as ``<row>, first burst``: the NVMe one is the first load after the restart.

The ratios quoted are inside this one run (ours / ceiling, hit / cold): absolute times on a shared VM drift.
Writes ``benchmarks/results/burst.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import print_table, wait_until_persisted, with_defaults, write_results
from benchmarks.ttft import MAX_BATCHED_TOKENS, WARM_PROMPT
from prefixcache.cachestore.host.cpus import format_cpu_list
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.launch import run_engine
from tests.e2e.tinymodel import (
    BLOCK_TOKENS,
    ENGINE_DTYPE,
    KV_BYTES_PER_TOKEN,
    KV_CACHE_BLOCKS,
    build_tiny_llama,
    cache_blocks,
    random_prompt,
)

DEFAULT_BURSTS = "32x1025,8x4097"
CEILING = "vllm-prefix-cache"
WARM_UP_ROUND = 999  # the unmeasured set of each shape: measured rounds stay under 100 (main)


@dataclass(frozen=True)
class Shape:
    requests: int
    tokens: int

    def __str__(self) -> str:
        return f"{self.requests}x{self.tokens}"

    @property
    def blocks(self) -> int:
        """vLLM's KV cache blocks the burst takes: each request's prompt and its one generated token."""
        return self.requests * cache_blocks(self.tokens + 1)


@dataclass
class Burst:
    shape: str
    config: str
    round: int
    wall_s: float
    median_ttft_s: float
    cached_tokens: int  # the least any request of the burst took from a cache
    first_tokens: list[int]


class Runner:
    """Runs engines over bursts of the benchmark's prompts and records one Burst per measured call."""

    def __init__(self, model: Path, workdir: Path, shapes: list[Shape], rounds: int) -> None:
        self.model, self.workdir, self.shapes, self.rounds = model, workdir, shapes, rounds
        self.bursts: list[Burst] = []

    def prompts(self, shape: Shape, round_: int) -> list[list[int]]:
        """The prompts of one burst: a set per shape and round, none shared with another set."""
        seed = ((shape.tokens * 1000 + shape.requests) * 1000 + round_) * 1000  # each part under 1000 (main)
        return [random_prompt(seed=seed + i, length=shape.tokens) for i in range(shape.requests)]

    def engine(
        self,
        name: str,
        plan: list[tuple[Shape, int, str | None]],
        kv_transfer_config: dict | None = None,
        prefix_caching: bool = False,
    ) -> None:
        """One fresh engine process running the warm-up prompt alone, then each ``(shape, round, config)`` of
        ``plan`` as a burst in a call of its own, recorded as ``config`` (unless None)."""
        prompts = [WARM_PROMPT, *(p for shape, round_, _ in plan for p in self.prompts(shape, round_))]
        spec = {
            "model": str(self.model),
            "dtype": ENGINE_DTYPE,
            "prompts": prompts,
            "max_tokens": 1,
            "logprobs": 0,
            "prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "max_num_seqs": max(s.requests for s in self.shapes),
            "together": [1, *(shape.requests for shape, _, _ in plan)],
        }
        print(f"[burst] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = run_engine(spec, self.workdir, name, timeout_s=3600)
        print(f"[burst] {name}: {time.perf_counter() - t0:.0f} s (engine start {result['engine_start_s']:.0f} s)")
        outputs = result["outputs"][1:]
        for shape, round_, config in plan:
            burst, outputs = outputs[: shape.requests], outputs[shape.requests :]
            if config is not None:
                self.bursts.append(
                    Burst(
                        str(shape),
                        config,
                        round_,
                        burst[0]["wall_s"],
                        statistics.median(out["ttft_s"] for out in burst),
                        min(out["num_cached_tokens"] for out in burst),
                        [out["token_ids"][0] for out in burst],
                    )
                )

    def every_round(self, config: str | None) -> list[tuple[Shape, int, str | None]]:
        return [(shape, round_, config) for round_ in range(self.rounds) for shape in self.shapes]

    def warm_ups(self, runs: int = 1, config: str | None = None) -> list[tuple[Shape, int, str | None]]:
        """Each shape's unmeasured set, ``runs`` times in a row (recorded as ``config``, if given, once)."""
        return [(shape, WARM_UP_ROUND, config if run == 0 else None) for shape in self.shapes for run in range(runs)]


def vllm_prefix_cache(run: Runner) -> None:
    """Cold bursts, then their repeats served by vLLM's own prefix cache: round 0's set of each shape throughout."""
    repeats = [(shape, 0, CEILING) for _ in range(run.rounds) for shape in run.shapes]
    run.engine(
        CEILING, run.warm_ups(runs=2) + [(shape, 0, "cold") for shape in run.shapes] + repeats, prefix_caching=True
    )


def prefixcache(run: Runner, server_cpus: frozenset[int] | None) -> None:
    """A producer publishes every round's sets; consumers load them from DRAM, then, after a restart, from NVMe.
    The tiers hold every set twice over, so no chunk is evicted before it is read."""
    cpus = ["--cpus", format_cpu_list(server_cpus)] if server_cpus is not None else []
    producer = run.warm_ups() + run.every_round(None)
    published = [p for shape, round_, _ in producer for p in run.prompts(shape, round_)]
    mib = 2 * sum(map(len, published)) * KV_BYTES_PER_TOKEN // (1 << 20) + 512
    daemon = Daemon(run.workdir / "prefixcache", *cpus, dram=f"{mib}MiB", nvme=f"{mib}MiB").start()
    try:
        config = connector_config(daemon, arena_mb="auto")  # the connector's defaults
        run.engine("prefixcache-producer", producer, config)
        run.engine(
            "prefixcache-consumer-dram",
            run.warm_ups(config="prefixcache-dram, first burst") + run.every_round("prefixcache-dram"),
            config,
        )
        wait_until_persisted(daemon.url, [WARM_PROMPT, *published])
        daemon.stop()
        daemon.start()  # the segment owner starts empty: every chunk now comes from the NVMe tier
        run.engine(
            "prefixcache-consumer-nvme",
            run.warm_ups(config="prefixcache-nvme, first burst") + run.every_round("prefixcache-nvme"),
            config,
        )
    finally:
        daemon.stop()


RATIOS = {
    "prefixcache-dram / vllm-prefix-cache": ("prefixcache-dram", CEILING),
    "prefixcache-nvme / vllm-prefix-cache": ("prefixcache-nvme", CEILING),
    "vllm-prefix-cache / cold": (CEILING, "cold"),
    "prefixcache-dram / cold": ("prefixcache-dram", "cold"),
    "prefixcache-nvme / cold": ("prefixcache-nvme", "cold"),
}


def report(bursts: list[Burst], shapes: list[Shape]) -> dict:
    """Print the medians over rounds and the run's ratios of them; the JSON payload."""
    groups: dict[tuple[str, str], list[Burst]] = {}
    for burst in bursts:
        groups.setdefault((burst.config, burst.shape), []).append(burst)
    wall = {key: statistics.median(b.wall_s for b in group) for key, group in groups.items()}
    names = [str(shape) for shape in shapes]

    def cell(config: str, name: str) -> str:
        group = groups.get((config, name))
        if group is None:
            return "-"
        ttft = statistics.median(b.median_ttft_s for b in group)
        return f"{wall[(config, name)] * 1000:.0f} ms / {ttft * 1000:.0f} ms / {min(b.cached_tokens for b in group)}"

    title = "bursts (requests x tokens): the call's wall time / median TTFT in it / least cached tokens; medians"
    print_table(
        title, ["config", *names], [[c, *(cell(c, n) for n in names)] for c in dict.fromkeys(b.config for b in bursts)]
    )
    found: dict[str, dict[str, float]] = {}
    for label, (a, b) in RATIOS.items():
        values = {n: wall[(a, n)] / wall[(b, n)] for n in names if (a, n) in wall and (b, n) in wall}
        if values:
            found[label] = values
    rows = [[label, *(f"{v[n]:.3g}" if n in v else "-" for n in names)] for label, v in found.items()]
    print_table("ratios of wall times (this run)", ["ratio", *names], rows)
    cold = {b.shape: b.first_tokens for b in bursts if b.config == "cold"}
    # round 0 runs the prompts the cold bursts ran
    differing = sorted({b.config for b in bursts if b.round == 0 and b.first_tokens != cold.get(b.shape)})
    if differing:
        print(f"[burst] first tokens differ from cold in: {', '.join(differing)} (see tests/e2e/compare.py)")
    return {"bursts": [asdict(b) for b in bursts], "ratios": found, "first_tokens_differ_from_cold": differing}


def parse_shapes(text: str) -> list[Shape]:
    """``32x1025,8x4097``: a burst of 32 prompts of 1025 tokens, one of 8 of 4097."""
    shapes = []
    for item in filter(None, text.split(",")):
        requests, _, tokens = item.partition("x")
        if not (requests.isdigit() and tokens.isdigit()):
            raise ValueError(f"{item!r} is not REQUESTSxTOKENS")
        shapes.append(Shape(int(requests), int(tokens)))
    if not shapes:
        raise ValueError("no burst given")
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bursts", default=DEFAULT_BURSTS, help="burst shapes, REQUESTSxTOKENS, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="bursts per shape and row (the median is reported)")
    parser.add_argument(
        "--servers-on",
        choices=["reserved", "anywhere"],
        default="reserved",
        help="our daemon on the core vLLM reserves (the last), or anywhere",
    )
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.bursts)
    except ValueError as exc:
        parser.error(f"--bursts: {exc}")
    for shape in shapes:
        if not (1 <= shape.requests <= 256 and 2 <= shape.tokens <= MAX_BATCHED_TOKENS):
            parser.error(f"--bursts: {shape} needs 1-256 requests of 2-{MAX_BATCHED_TOKENS} tokens")
    most_blocks = KV_CACHE_BLOCKS * 7 // 8
    if sum(shape.blocks for shape in shapes) > most_blocks:
        parser.error(
            f"--bursts: vLLM's own prefix cache must hold every shape's prompts at once: at most "
            f"{most_blocks} blocks of {BLOCK_TOKENS} tokens in all"
        )
    if not 1 <= args.rounds <= 100:
        parser.error("--rounds must be 1-100")
    reserved = frozenset(sorted(os.sched_getaffinity(0))[-1:])  # VLLM_CPU_NUM_OF_RESERVED_CPU=1
    server_cpus = reserved if args.servers_on == "reserved" else None
    with tempfile.TemporaryDirectory(prefix="burst-") as tmp:
        workdir = Path(tmp)
        run = Runner(build_tiny_llama(workdir / "model"), workdir, shapes, args.rounds)
        vllm_prefix_cache(run)
        prefixcache(run, server_cpus)
        payload = report(run.bursts, shapes)
    path = write_results(
        "burst",
        {"bursts": args.bursts, "rounds": args.rounds, "servers_on": args.servers_on, "dtype": ENGINE_DTYPE, **payload},
        partial=not with_defaults(parser, args),
    )
    print(f"[burst] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
