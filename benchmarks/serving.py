"""vLLM's OpenAI server under traffic from the field's own clients, side by side: vLLM's own prefix cache alone,
prefixcache, LMCache's multi-process server, and a fresh prefixcache instance joining.

    python -m benchmarks.serving [--quick] [--only no-cache,prefixcache,...]

Every row starts real servers (``python -m vllm.entrypoints.openai.api_server``, tests/e2e/openai_server.py) of
the tiny test Llama with the same flags and environment (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, tests/e2e/launch.py):
vLLM's own prefix cache on, its KV cache forced to ``KV_BLOCKS`` blocks of 128 tokens (``--num-gpu-blocks-override``,
checked in the server's log), fewer than each workload's working set, so that vLLM must evict what the rows with
a cache behind it load again. Against each server the same clients run, in this order:

- ``vllm bench serve --dataset-name prefix_repetition`` (vLLM's own client, run as its module: the ``vllm`` script
  does not work on vllm-cpu), a few shared prefixes with short suffixes, at two request rates, the second
  replaying the first's prompts (the same seed): by then vLLM has evicted the first prefixes, a cache behind it
  has not. Goodput counts the requests whose TTFT is within ``TTFT_BOUND_MS``.
- LMCache's ``lmcache bench engine`` workloads ``multi-round-chat`` (sessions, each turn's prompt the last one's,
  its answer and a new question) and ``long-doc-qa`` (questions about a few documents in random order), streamed
  chat completions; each first warms every session or document up (unmeasured), then measures.

Rows: ``no-cache`` (vLLM's own prefix cache only); ``prefixcache`` (our connector, a fresh daemon, decode-KV
publishing on: ``publish_output``); ``scale-out`` (a fresh server of the same daemon, after ``prefixcache``'s
served the same traffic: what a new instance gets, against ``prefixcache-warm``, the first server running the same
traffic once more after it); ``lmcache-mp`` (LMCache's server with ``LMCacheMPConnector``).
The caches' servers and the clients run on the core vLLM reserves, the last one.

What publishing answers costs TPOT is measured inside one engine (engines of one configuration differ more than
the cost sought): ``decode-publishing-on`` and ``-off`` are blocks of the same traffic on one server of a fresh
daemon, alternately (ABBA), each request asking for its answer's publishing or not
(``{"prefixcache": {"publish_output": ...}}``). A block is a long answer streamed beside short ones that finish
one after another, so that each short one's publishing at its finish falls within the long one's decode; the
figure is the long answers' TPOT. The vLLM metric of published chunks, read around each block, shows the arms
differ in what they publish.

The model's tokenizer is the byte-level BPE of ``build_tiny_llama`` with ``CHAT_TEMPLATE`` given to the server:
the word-level chat model's tokenizer reads LMCache's English prompts as ``<unk>`` throughout, which would make
every session and document the same prompt. Its cost: a random model's answer, detokenized and tokenized again in
the next turn, seldom gives the same tokens, so a published answer is seldom hit, and the decode-publishing row
measures what publishing costs, not what it gains. Prompt lengths are the clients' in words; the tokens they come
to are in each row's ``input_tokens``. TPOT of the LMCache workloads is each request's decode time over its output
tokens after the first. Writes ``benchmarks/results/serving.json`` (``--quick``: ``serving.partial.json``).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import bound_to, lmcache_mp_server, print_table, with_defaults, write_results
from prefixcache.cachestore.host.cpus import format_cpu_list
from tests.daemon_harness import Daemon, connector_config
from tests.e2e.launch import REPO, vllm_env
from tests.e2e.openai_server import MODEL, Server, vllm_server
from tests.e2e.tinymodel import CHAT_TEMPLATE, ENGINE_DTYPE, build_tiny_llama

KV_BLOCKS = 24  # vLLM's KV cache: 3072 tokens, fewer than each workload's working set
MAX_MODEL_LEN = 2048
TTFT_BOUND_MS = 2000.0  # goodput's bound: a hit makes it, a cold prefill of the prefixes does not
CLIENT_TIMEOUT_S = 900
NO_CACHE, PREFIXCACHE, PREFIXCACHE_WARM, LMCACHE, SCALE_OUT = (
    "no-cache",
    "prefixcache",
    "prefixcache-warm",
    "lmcache-mp",
    "scale-out",
)
PUBLISHING, PUBLISHING_ON, PUBLISHING_OFF = ("decode-publishing", "decode-publishing-on", "decode-publishing-off")
#: The arms of the paired blocks in their order, ABBA twice: drift within the engine falls on both alike.
PUBLISHING_ARMS = (True, False, False, True, False, True, True, False)
BESIDE_FINISHES = "long answers beside finishing ones"
MULTI_ROUND_CHAT, LONG_DOC_QA = "multi-round-chat", "long-doc-qa"
TTFT, TPOT = "mean_ttft_ms", "mean_tpot_ms"  # the Result figures the ratios compare
#: vLLM's ``bench serve``, run as its module (the ``vllm`` script looks up a distribution named "vllm")
VLLM_BENCH = (
    "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
    "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
    "p = P(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


@dataclass(frozen=True)
class Sizes:
    """The clients' workloads; lengths in the clients' own units (vLLM's in tokens, LMCache's in words)."""

    prefix_tokens: int = 1536
    suffix_tokens: int = 64
    prefixes: int = 3
    prompts_per_prefix: int = 3
    prefix_output_tokens: int = 16
    rates: tuple[float, ...] = (0.25, 1.0)
    chat_sessions: int = 4
    chat_system_words: int = 200
    chat_history_words: int = 300
    chat_question_words: int = 10
    chat_answer_tokens: int = 32
    chat_qps: float = 0.5
    chat_duration_s: float = 40.0
    documents: int = 4
    document_words: int = 1000
    questions_per_document: int = 2
    document_answer_tokens: int = 16
    document_inflight: int = 2
    publishing_prompt_words: int = 80
    publishing_long_tokens: int = 192
    publishing_short_tokens: int = 48


QUICK = Sizes(
    prefix_tokens=256,
    suffix_tokens=16,
    prefixes=2,
    prompts_per_prefix=2,
    prefix_output_tokens=4,
    rates=(1.0, 4.0),
    chat_sessions=2,
    chat_system_words=30,
    chat_history_words=60,
    chat_question_words=5,
    chat_answer_tokens=4,
    chat_qps=1.0,
    chat_duration_s=6.0,
    documents=2,
    document_words=150,
    questions_per_document=1,
    document_answer_tokens=4,
    publishing_prompt_words=30,
    publishing_long_tokens=24,
    publishing_short_tokens=8,
)


@dataclass
class Result:
    """One client workload against one row's server."""

    row: str
    workload: str
    requests: int
    failed: int
    input_tokens: int
    mean_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    p99_tpot_ms: float
    requests_per_s: float
    #: requests within TTFT_BOUND_MS a second: vllm bench serve's own, or counted from LMCache's per-request TTFTs
    goodput_per_s: float | None


def from_vllm_bench(row: str, workload: str, out: dict) -> Result:
    """A ``vllm bench serve --save-result`` JSON as a Result."""
    return Result(
        row,
        workload,
        out["completed"],
        out.get("failed", 0),
        out["total_input_tokens"],
        out["mean_ttft_ms"],
        out["p99_ttft_ms"],
        out["mean_tpot_ms"],
        out["p99_tpot_ms"],
        out["request_throughput"],
        out.get("request_goodput"),
    )


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] if ordered else 0.0


def from_lmcache_bench(row: str, workload: str, summary: dict, per_request: list[dict[str, str]]) -> Result:
    """``lmcache bench engine --json`` output (its summary and bench_results.csv) as a Result; TPOT per request is
    its decode time over its output tokens after the first (requests of one token have none), and goodput counts
    the requests whose TTFT (seconds in the CSV) is within ``TTFT_BOUND_MS``."""
    done = [r for r in per_request if r["successful"] == "True"]
    within_bound = sum(1 for r in done if float(r["ttft"]) * 1000 <= TTFT_BOUND_MS)
    tpots = [
        (float(r["finish_time"]) - float(r["first_token_time"])) * 1000 / (int(r["num_output_tokens"]) - 1)
        for r in done
        if int(r["num_output_tokens"]) > 1
    ]
    results = summary["results"]
    return Result(
        row,
        workload,
        len(done),
        len(per_request) - len(done),
        sum(int(r["num_input_tokens"]) for r in done),
        results["mean_ttft_ms"],
        results["p99_ttft_ms"],
        statistics.fmean(tpots) if tpots else 0.0,
        _p99(tpots),
        len(done) / results["elapsed_time"] if results["elapsed_time"] > 0 else 0.0,
        within_bound / results["elapsed_time"] if results["elapsed_time"] > 0 else 0.0,
    )


@dataclass(frozen=True)
class Streamed:
    """One streamed chat completion, as its client saw it."""

    ttft_ms: float
    tpot_ms: float  # decode time over the tokens after the first
    tokens: int
    prompt_tokens: int  # as the server counted them (its usage report)


def stream_chat(url: str, prompt: str, max_tokens: int, publish_output: bool) -> Streamed:
    """A chat completion streamed from ``url``, asking for its answer's publishing or not; each event is a token."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"prefixcache": {"publish_output": publish_output}},
    }
    started, times, prompt_tokens = time.perf_counter(), [], 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT_S) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if usage := event.get("usage"):  # the last event's, after the answer
                    prompt_tokens = usage["prompt_tokens"]
                choices = event.get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"a streamed answer of {len(times)} tokens: expected {max_tokens}")
    tpot_ms = (times[-1] - times[0]) * 1000 / (len(times) - 1)
    return Streamed((times[0] - started) * 1000, tpot_ms, len(times), prompt_tokens)


def published_chunks(server: Server) -> float:
    """The server's count of chunks prefixcache published (vLLM's metric, summed over its labels)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:prefixcache_published_chunks_total"
    )


def words(rng: random.Random, count: int) -> str:
    """``count`` random five-letter words: a prompt no other request shares."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=5)) for _ in range(count))


def beside_finishes(server: Server, sizes: Sizes, publish_output: bool, rng: random.Random) -> list[Streamed]:
    """One block: a long answer streamed while short ones run one after another beside it; the long one first."""
    long_done = threading.Event()
    shorts: list[Streamed] = []

    def short_ones() -> None:
        while not long_done.is_set():
            prompt = words(rng, sizes.publishing_prompt_words)
            shorts.append(stream_chat(server.url, prompt, sizes.publishing_short_tokens, publish_output))

    beside = threading.Thread(target=short_ones, name="short-answers")
    beside.start()
    try:
        long = stream_chat(
            server.url, words(rng, sizes.publishing_prompt_words), sizes.publishing_long_tokens, publish_output
        )
    finally:
        long_done.set()
        beside.join()
    return [long, *shorts]


def from_blocks(row: str, blocks: list[list[Streamed]], elapsed_s: float) -> Result:
    """An arm's blocks as a Result: the long answers' TTFT and TPOT (the short ones only make publishing happen)."""
    longs = [block[0] for block in blocks]
    return Result(
        row,
        BESIDE_FINISHES,
        sum(len(block) for block in blocks),
        0,
        sum(s.prompt_tokens for block in blocks for s in block),
        statistics.fmean(s.ttft_ms for s in longs),
        _p99([s.ttft_ms for s in longs]),
        statistics.fmean(s.tpot_ms for s in longs),
        _p99([s.tpot_ms for s in longs]),
        sum(len(block) for block in blocks) / elapsed_s if elapsed_s > 0 else 0.0,
        None,
    )


class Bench:
    """Runs the clients against one row's server after another and keeps their Results."""

    def __init__(self, workdir: Path, sizes: Sizes, cpus: frozenset[int]) -> None:
        self.workdir = workdir
        self.sizes = sizes
        self.cpus = cpus  # the core vLLM reserves: the caches' servers and the clients
        self.model = build_tiny_llama(workdir / "model")
        self.results: list[Result] = []
        #: the decode-publishing blocks, in their order (``publishing_pairs``)
        self.publishing_blocks: list[dict[str, float | bool]] = []

    @contextmanager
    def server(self, row: str, transfer: dict | None) -> Iterator[Server]:
        """A row's OpenAI server, killed on exit whatever happens."""
        flags = ["--enable-prefix-caching", "--num-gpu-blocks-override", str(KV_BLOCKS)]
        flags += ["--max-model-len", str(MAX_MODEL_LEN), "--chat-template", CHAT_TEMPLATE]
        server = vllm_server(row, self.model, transfer, self.workdir, *flags)
        try:
            server.wait_ready()
            if f"num_gpu_blocks_override={KV_BLOCKS}" not in server.log_path.read_text(errors="replace"):
                raise RuntimeError(f"{row}: vLLM did not take --num-gpu-blocks-override (log {server.log_path})")
            yield server
        finally:
            server.kill()

    def _client(self, name: str, args: list[str]) -> Path:
        """Run a client on the reserved core, ``{out}`` in ``args`` naming its output folder; that folder."""
        out = self.workdir / name
        out.mkdir()
        log = out / "client.log"
        with bound_to(self.cpus), open(log, "wb") as sink:
            rc = subprocess.run(
                [arg.replace("{out}", str(out)) for arg in args],
                cwd=REPO,
                env=vllm_env(),
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=CLIENT_TIMEOUT_S,
            ).returncode
        if rc != 0:
            raise RuntimeError(f"{name} exited {rc}: {log.read_text(errors='replace')[-2000:]}")
        return out

    def prefix_repetition(self, row: str, server: Server) -> None:
        s = self.sizes
        for rate in s.rates:
            workload = f"prefix-repetition @ {rate:g} req/s"
            out = self._client(
                f"{row}-prefix-repetition-{rate:g}",
                [
                    sys.executable,
                    "-c",
                    VLLM_BENCH,
                    "--backend",
                    "vllm",
                    "--base-url",
                    server.url,
                    "--model",
                    MODEL,
                    "--tokenizer",
                    str(self.model),
                    "--dataset-name",
                    "prefix_repetition",
                    "--prefix-repetition-prefix-len",
                    str(s.prefix_tokens),
                    "--prefix-repetition-suffix-len",
                    str(s.suffix_tokens),
                    "--prefix-repetition-num-prefixes",
                    str(s.prefixes),
                    "--prefix-repetition-output-len",
                    str(s.prefix_output_tokens),
                    "--num-prompts",
                    str(s.prefixes * s.prompts_per_prefix),
                    "--request-rate",
                    str(rate),
                    "--seed",
                    "0",
                    "--ignore-eos",
                    "--num-warmups",
                    "0",
                    "--percentile-metrics",
                    "ttft,tpot,e2el",
                    "--metric-percentiles",
                    "50,99",
                    "--goodput",
                    f"ttft:{TTFT_BOUND_MS:g}",
                    "--disable-tqdm",
                    "--save-result",
                    "--result-dir",
                    "{out}",
                    "--result-filename",
                    "result.json",
                ],
            )
            self.results.append(from_vllm_bench(row, workload, json.loads((out / "result.json").read_text())))

    def lmcache_client(self, row: str, server: Server, workload: str) -> None:
        s = self.sizes
        if workload == MULTI_ROUND_CHAT:
            words = s.chat_system_words + s.chat_history_words
            flags = [
                "--kv-cache-volume",
                "1",
                "--tokens-per-gb-kvcache",
                str(s.chat_sessions * words),  # sessions = volume · tokens per GB / session length
                "--mrc-shared-prompt-length",
                str(s.chat_system_words),
                "--mrc-chat-history-length",
                str(s.chat_history_words),
                "--mrc-user-input-length",
                str(s.chat_question_words),
                "--mrc-output-length",
                str(s.chat_answer_tokens),
                "--mrc-qps",
                str(s.chat_qps),
                "--mrc-duration",
                str(s.chat_duration_s),
            ]
        else:
            flags = [
                "--kv-cache-volume",
                "1",
                "--tokens-per-gb-kvcache",
                str(s.documents * s.document_words),  # documents = volume · tokens per GB / document length
                "--ldqa-document-length",
                str(s.document_words),
                "--ldqa-query-per-document",
                str(s.questions_per_document),
                "--ldqa-max-output-length",
                str(s.document_answer_tokens),
                "--ldqa-num-inflight-requests",
                str(s.document_inflight),
            ]
        out = self._client(
            f"{row}-{workload}",
            [
                str(Path(sys.executable).parent / "lmcache"),
                "bench",
                "engine",
                "--engine-url",
                server.url,
                "--model",
                MODEL,
                "--workload",
                workload,
                *flags,
                "--seed",
                "42",
                "--ignore-eos",
                "--json",
                "--output-dir",
                "{out}",
                "--no-interactive",
                "--quiet",
            ],
        )
        summary = json.loads((out / "bench_summary.json").read_text())
        with open(out / "bench_results.csv", newline="") as f:
            per_request = list(csv.DictReader(f))
        self.results.append(from_lmcache_bench(row, workload, summary, per_request))

    def workloads(self, row: str, transfer: dict | None, again_as: str | None = None) -> None:
        """Every client against one fresh server of ``row``; with ``again_as``, every client once more on the same
        server, as that row (the same prompts: the server once warm)."""
        with self.server(row, transfer) as server:
            for name in (row, again_as) if again_as else (row,):
                self.prefix_repetition(name, server)
                for workload in (MULTI_ROUND_CHAT, LONG_DOC_QA):
                    self.lmcache_client(name, server, workload)

    def publishing_pairs(self, server: Server) -> None:
        """The paired blocks of ``PUBLISHING_ARMS`` on one server: one Result per arm, and each block's own figures
        (``publishing_blocks``: its arm, its long answer's TPOT, the chunks it published by vLLM's metric)."""
        rng = random.Random(7)
        beside_finishes(server, self.sizes, True, rng)  # unmeasured: the engine's first shapes
        blocks: dict[bool, list[list[Streamed]]] = {True: [], False: []}
        elapsed = {True: 0.0, False: 0.0}
        for arm in PUBLISHING_ARMS:
            before, started = published_chunks(server), time.perf_counter()
            block = beside_finishes(server, self.sizes, arm, rng)
            elapsed[arm] += time.perf_counter() - started
            blocks[arm].append(block)
            time.sleep(1)  # the block's last finishes are published before the count is read
            self.publishing_blocks.append(
                {
                    "publish_output": arm,
                    "long_tpot_ms": block[0].tpot_ms,
                    "requests": len(block),
                    "published_chunks": published_chunks(server) - before,
                }
            )
        for arm, row in ((True, PUBLISHING_ON), (False, PUBLISHING_OFF)):
            self.results.append(from_blocks(row, blocks[arm], elapsed[arm]))

    @contextmanager
    def daemon(self, name: str) -> Iterator[Daemon]:
        daemon = Daemon(self.workdir / name, "--cpus", format_cpu_list(self.cpus), dram="2GiB", nvme="4GiB")
        with bound_to(self.cpus):
            daemon.start()
        try:
            yield daemon
        finally:
            daemon.stop()


def no_cache(bench: Bench) -> None:
    bench.workloads(NO_CACHE, None)


def prefixcache(bench: Bench) -> None:
    """Ours with decode-KV publishing on, the same traffic twice (cold, then warm), then a fresh server of the same
    daemon over the same traffic."""
    with bench.daemon("prefixcache") as daemon:
        config = connector_config(daemon, arena_mb="auto", publish_output=True)
        bench.workloads(PREFIXCACHE, config, again_as=PREFIXCACHE_WARM)
        bench.workloads(SCALE_OUT, config)


def decode_publishing(bench: Bench) -> None:
    """The paired blocks, on one server of a fresh daemon whose connector publishes answers unless asked not to."""
    with (
        bench.daemon(PUBLISHING) as daemon,
        bench.server(PUBLISHING, connector_config(daemon, arena_mb="auto", publish_output=True)) as server,
    ):
        bench.publishing_pairs(server)


def lmcache_mp(bench: Bench) -> None:
    with lmcache_mp_server(bench.workdir, bench.cpus) as config:
        bench.workloads(LMCACHE, config)


ROWS: dict[str, Callable[[Bench], None]] = {
    NO_CACHE: no_cache,
    PREFIXCACHE: prefixcache,  # and scale-out
    PUBLISHING: decode_publishing,  # its two arms
    LMCACHE: lmcache_mp,
}

#: name: (row, the row it is divided by, workload, figure, the goal's bound on the ratio or None: reported only)
RATIOS: dict[str, tuple[str, str, str, str, float | None]] = {
    "prefixcache / no-cache, multi-round-chat mean TTFT": (PREFIXCACHE, NO_CACHE, MULTI_ROUND_CHAT, TTFT, 0.5),
    "prefixcache / lmcache-mp, multi-round-chat mean TTFT": (PREFIXCACHE, LMCACHE, MULTI_ROUND_CHAT, TTFT, 1.0),
    "scale-out / prefixcache-warm, multi-round-chat mean TTFT": (
        SCALE_OUT,
        PREFIXCACHE_WARM,
        MULTI_ROUND_CHAT,
        TTFT,
        1.25,
    ),
    "scale-out / prefixcache-warm, long-doc-qa mean TTFT": (SCALE_OUT, PREFIXCACHE_WARM, LONG_DOC_QA, TTFT, 1.25),
    "scale-out / prefixcache-warm, prefix-repetition @ 1 req/s mean TTFT": (
        SCALE_OUT,
        PREFIXCACHE_WARM,
        "prefix-repetition @ 1 req/s",
        TTFT,
        1.25,
    ),
    "decode publishing on / off, mean TPOT beside finishing answers (one engine)": (
        PUBLISHING_ON,
        PUBLISHING_OFF,
        BESIDE_FINISHES,
        TPOT,
        1.05,
    ),
    "prefixcache / no-cache, long-doc-qa mean TTFT": (PREFIXCACHE, NO_CACHE, LONG_DOC_QA, TTFT, None),
    "prefixcache / lmcache-mp, long-doc-qa mean TTFT": (PREFIXCACHE, LMCACHE, LONG_DOC_QA, TTFT, None),
}


def ratios(results: list[Result]) -> dict[str, dict[str, float | bool | None]]:
    """Every ratio of ``RATIOS`` whose rows both ran: its value, its goal and whether it is met (None: no goal)."""
    by = {(r.row, r.workload): r for r in results}
    out: dict[str, dict[str, float | bool | None]] = {}
    for name, (a, b, workload, figure, goal) in RATIOS.items():
        if (a, workload) in by and (b, workload) in by and getattr(by[(b, workload)], figure) > 0:
            value = getattr(by[(a, workload)], figure) / getattr(by[(b, workload)], figure)
            out[name] = {"value": value, "goal": goal, "met": None if goal is None else value <= goal}
    return out


def _goal(ratio: dict[str, float | bool | None]) -> list[str]:
    """A ratio's goal and whether it is met, as the tables print them."""
    if ratio["goal"] is None:
        return ["-", "-"]
    return [f"<= {ratio['goal']:g}", "yes" if ratio["met"] else "no"]


def report(results: list[Result]) -> dict[str, dict[str, float | bool | None]]:
    print_table(
        f"serving (ms; requests per second; goodput: TTFT <= {TTFT_BOUND_MS:g} ms)",
        ["row", "workload", "requests", "input tokens", "mean TTFT", "p99 TTFT", "mean TPOT", "p99 TPOT", "req/s"]
        + ["goodput"],
        [
            [
                r.row,
                r.workload,
                f"{r.requests} ({r.failed} failed)" if r.failed else str(r.requests),
                r.input_tokens,
                f"{r.mean_ttft_ms:.0f}",
                f"{r.p99_ttft_ms:.0f}",
                f"{r.mean_tpot_ms:.1f}",
                f"{r.p99_tpot_ms:.1f}",
                f"{r.requests_per_s:.3f}",
                "-" if r.goodput_per_s is None else f"{r.goodput_per_s:.3f}",
            ]
            for r in results
        ],
    )
    found = ratios(results)
    print_table(
        "ratios (this run)",
        ["ratio", "value", "goal", "met"],
        [[name, f"{v['value']:.2f}", *_goal(v)] for name, v in found.items()],
    )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads, to check the harness (partial run)")
    parser.add_argument("--only", default=",".join(ROWS), help=f"rows to run, of: {', '.join(ROWS)}")
    args = parser.parse_args(argv)
    only = [name for name in args.only.split(",") if name]
    unknown = set(only) - set(ROWS)
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; known: {', '.join(ROWS)}")
    if importlib.util.find_spec("lmcache") is None:
        parser.error("lmcache is not installed (make bench installs it): its client drives every row")
    sizes = QUICK if args.quick else Sizes()
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="serving-") as tmp:
        bench = Bench(Path(tmp), sizes, frozenset(sorted(os.sched_getaffinity(0))[-1:]))
        for name in only:
            try:
                ROWS[name](bench)
            except (AssertionError, RuntimeError, subprocess.TimeoutExpired) as exc:  # one row must not sink the rest
                failed[name] = reason = str(exc).splitlines()[0]
                print(f"[serving] {name} failed: {reason}")
        found = report(bench.results)
    path = write_results(
        "serving",
        {
            "sizes": asdict(sizes),
            "kv_blocks": KV_BLOCKS,
            "ttft_bound_ms": TTFT_BOUND_MS,
            "dtype": ENGINE_DTYPE,
            "results": [asdict(r) for r in bench.results],
            "ratios": found,
            "publishing_blocks": bench.publishing_blocks,
            "failed_rows": failed,
        },
        partial=not with_defaults(parser, args),
    )
    print(f"[serving] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
