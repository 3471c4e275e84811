"""A node lost under load: what the requests on a surviving node cost, per way to lose it.

    python -m benchmarks.node_loss [--prompt-tokens 1100] [--prompts 6] [--lost-s 15] [--back-s 20] [--only frozen]

Two nodes on hosts of their own (tests/netns.py; root needed), the cluster's Redis and master in the root namespace:
node A's engine publishes ``--prompts`` prompts, so that their KV lives on A alone; node B runs vLLM's OpenAI server
with the connector as ``kv_consumer`` (it never publishes, so every hit is a load from A) and vLLM's own prefix cache
off; each daemon runs on the core vLLM reserves, as the operations guide has it. A client streams completions of those
prompts to B one after another (before each loss, until each prompt has hit once), and A is lost, in turn: its link
shaped to 1 Mbit/s (slow, not dead), every process of it frozen (SIGSTOP), its cable pulled, and every process of it
killed. Each loss lasts ``--lost-s``; then A comes back
(link fast again, SIGCONT, cable plugged; a killed node does not) for ``--back-s``.

Per request: its time to first token, whether it hit (``hit``), and whether its answer equals the
same prompt computed whole on B (``{"prefixcache": {"load": false}}``: the cold recompute, whose time to first token
is the bound). Per way: the worst time to first token after the loss over the cold one of the same prompt (goal: at
most the cold one plus 1 s), failed requests, answers that differ, how long after the loss requests stopped trying A
(the first that missed fast), and after A's return the first hit again. Writes ``benchmarks/results/node_loss.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from benchmarks.common import print_table, with_defaults, write_results
from prefixcache.cachestore.host.cpus import format_cpu_list
from prefixcache.indexer.peers import SUSPECT_LONGEST_S
from tests.daemon_harness import cluster_servers, connector_config, node_on
from tests.e2e.launch import run_engine
from tests.e2e.openai_server import Server, vllm_server
from tests.e2e.tinymodel import ENGINE_DTYPE, build_tiny_llama, random_prompt
from tests.netns import Host, Network, unusable

#: Tokens each answer decodes: enough to compare answers, few enough that a request is mostly its prefill.
ANSWER_TOKENS = 4
CLIENT_TIMEOUT_S = 120.0
#: The longest the requests before a loss go on for every prompt to hit once: longer than a suspect mark and its
#: first doubling (indexer/peers.py), which a read past its deadline on a loaded host costs.
BEFORE_S = 30.0


@dataclass(frozen=True)
class Request:
    """One streamed completion on B, as its client saw it."""

    way: str
    phase: str  # "before", "lost" or "back"
    at_s: float  # when it was sent, seconds after the loss
    prompt: int
    ttft_s: float
    cached_tokens: int
    same_answer: bool
    failed: bool


@dataclass(frozen=True)
class Way:
    """One way to lose A: how, and how it comes back (None: it does not)."""

    name: str
    lose: Callable[[Host], None]
    recover: Callable[[Host], None] | None
    #: Its daemon still beats while lost: the cluster knows it only from reads past their deadline, whose marks
    #: grow while it stays slow, so after its return it is read from again only once the last mark is over.
    beats_while_lost: bool = False


WAYS = [
    Way("slow link (1 Mbit/s)", lambda host: host.slow("1mbit"), Host.unslow, beats_while_lost=True),
    Way("frozen (SIGSTOP)", Host.freeze, Host.thaw),
    Way("cable pulled", Host.unplug, Host.plug),
    Way("killed (kill -9)", Host.crash, None),
]


def complete(url: str, prompt: list[int], load: bool = True) -> tuple[float, int, str]:
    """One streamed completion of ``prompt`` (token ids): time to its first token, its cached tokens, its text."""
    body = {
        "model": served_model(url),
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"prefixcache": {"load": load}},
    }
    started, first, cached, text = time.perf_counter(), None, 0, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                first = first or time.perf_counter()
                text.append(event["choices"][0].get("text", ""))
            if usage := event.get("usage"):
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    if first is None:
        raise RuntimeError("an answer without a token")
    return first - started, cached, "".join(text)


@functools.cache
def served_model(url: str) -> str:
    """The name the server at ``url`` serves its model under."""
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def consumer(host: Host, daemon, model: Path, log_dir: Path) -> Server:
    """vLLM's OpenAI server on ``host``, loading through ``daemon``'s node only, reached at the host's address. It
    serves the model under its path, as the publishing engine names it: the model's name is part of the namespace."""
    transfer = connector_config(daemon, role="kv_consumer", redis_password=daemon.index_password)
    extra = ("--enable-prompt-tokens-details",)
    server = vllm_server("vllm-b", model, transfer, log_dir, *extra, served_name=None, on=host)
    return server.wait_ready()


@dataclass
class Scene:
    """Node A's KV published, node B's OpenAI server loading from A alone (``url``), the cold recompute of each
    prompt on B: its time to first token and its answer (``reference``), and each prompt's answer on B with its
    prefix loaded from A while A is healthy (``loaded_answers``).

    Both answers are right, and may differ: A computed the KV in an engine of its own, whose steps cut the prompt
    otherwise than B's server does, and a bf16 random-weight model's next token can turn on the last bits of a
    logit. A request during or after a loss must give one of its prompt's two answers."""

    url: str
    host_a: Host
    prompts: list[list[int]]
    reference: dict[int, tuple[float, str]]
    loaded_answers: dict[int, str]

    def right(self, prompt: int, text: str) -> bool:
        """Whether ``text`` is prompt ``prompt``'s answer, recomputed or loaded from A's intact KV."""
        return text in (self.reference[prompt][1], self.loaded_answers[prompt])


@contextlib.contextmanager
def a_lost_node_scene(directory: Path, prompts: list[list[int]]) -> Iterator[Scene]:
    """The two nodes on hosts of their own, the cluster's servers in the root namespace, A's engine run once over
    ``prompts`` (its KV persisted on A's NVMe too), and B's server started and warmed up; all stopped on exit."""
    model = build_tiny_llama(directory / "model")
    with Network() as network, cluster_servers(directory / "servers", network.gateway) as servers:
        host_a, host_b = network.host("a"), network.host("b")
        # each daemon on the core vLLM reserves (VLLM_CPU_NUM_OF_RESERVED_CPU=1), as docs/operations.md has it
        cpus = ("--cpus", format_cpu_list(frozenset(sorted(os.sched_getaffinity(0))[-1:])))
        a = node_on(host_a, servers, directory / "a", *cpus, dram="1GiB", nvme="2GiB")
        b = node_on(host_b, servers, directory / "b", *cpus, dram="1GiB", nvme="2GiB")
        a.start()
        b.start()
        try:
            spec = {"model": str(model), "prompts": prompts, "max_tokens": 1, "dtype": ENGINE_DTYPE}
            spec["kv_transfer_config"] = connector_config(a, redis_password=a.index_password)
            run_engine(spec, directory, "publisher", launcher=host_a.launcher)
            wait_persisted(a, len(prompts) * (len(prompts[0]) // a_chunk_tokens(a)))
            server = consumer(host_b, b, model, directory)
            try:
                complete(server.url, prompts[0])  # the engine's first request pays its warm-up
                # the cold recompute of each prompt, and its answer: what every request must equal
                reference = {i: complete(server.url, p, load=False)[::2] for i, p in enumerate(prompts)}
                loaded_answers = {i: answer_loaded(server.url, p, reference[i][0]) for i, p in enumerate(prompts)}
                yield Scene(server.url, host_a, prompts, reference, loaded_answers)
            finally:
                server.kill()
        finally:
            b.stop()
            a.stop()


def answer_loaded(url: str, prompt: list[int], cold_ttft_s: float, timeout_s: float = BEFORE_S) -> str:
    """``prompt``'s answer from ``url`` with its prefix loaded (``loaded``); a load that misses (a read past its
    deadline on a loaded host, a node still marked suspect) is tried again, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ttft, cached, text = complete(url, prompt)
        if loaded(ttft, cached, cold_ttft_s):
            return text
        time.sleep(0.5)
    raise RuntimeError(f"no load of the prompt's prefix within {timeout_s:.0f} s")


def run_way(scene: Scene, way: Way, lost_s: float, back_s: float) -> list[Request]:
    """Requests before the loss, until each prompt has hit once (a read that passed its deadline on a loaded host
    leaves A skipped for a while: at most ``BEFORE_S``); during it (``lost_s``); and after A's return
    (``back_s``)."""
    out: list[Request] = []
    turn = 0

    def send(phase: str, lost_at: float, i: int) -> Request:
        sent = time.monotonic()
        try:
            ttft, cached, text = complete(scene.url, scene.prompts[i])
            same = scene.right(i, text)
            request = Request(way.name, phase, sent - lost_at, i, ttft, cached, same, False)
        except (httpx.HTTPError, RuntimeError) as exc:
            print(f"  request failed: {exc}", file=sys.stderr)
            request = Request(way.name, phase, sent - lost_at, i, time.monotonic() - sent, 0, False, True)
        out.append(request)
        return request

    def send_next(phase: str, lost_at: float) -> None:
        nonlocal turn
        send(phase, lost_at, turn % len(scene.prompts))
        turn += 1

    now = time.monotonic()
    unhit = list(range(len(scene.prompts)))
    while unhit and time.monotonic() - now < BEFORE_S:
        if hit(send("before", now, unhit[0]), scene.reference):
            unhit.pop(0)
        else:
            unhit.append(unhit.pop(0))
            time.sleep(0.5)
    way.lose(scene.host_a)
    lost_at = time.monotonic()
    while time.monotonic() - lost_at < lost_s:
        send_next("lost", lost_at)
    if way.recover is not None:
        way.recover(scene.host_a)
        back_at = time.monotonic()
        while time.monotonic() - back_at < back_s:
            send_next("back", lost_at)
    return out


def wait_for_hits(scene: Scene, timeout_s: float = SUSPECT_LONGEST_S + 20) -> None:
    """Send requests until one loads its prefix: A's suspect marks (which grow while its link stays slow) are
    over."""
    answer_loaded(scene.url, scene.prompts[0], scene.reference[0][0], timeout_s)


def loaded(ttft_s: float, cached_tokens: int, cold_ttft_s: float) -> bool:
    """Whether a completion loaded its prefix: cached tokens, and a first token in under half the cold time (vLLM
    still counts a load that failed and was recomputed as cached)."""
    return cached_tokens > 0 and ttft_s < cold_ttft_s / 2


def hit(request: Request, reference: dict) -> bool:
    """Whether the request loaded its prefix (``loaded``, against its prompt's cold time)."""
    return loaded(request.ttft_s, request.cached_tokens, reference[request.prompt][0])


def summary(requests: list[Request], reference: dict, lost_s: float) -> dict:
    """The figures of one way: worst TTFT after the loss over the cold one, failures, answers, skip and return,
    and how many prompts hit before the loss."""
    lost = [r for r in requests if r.phase == "lost"]
    back = [r for r in requests if r.phase == "back"]
    worst = max(lost, key=lambda r: r.ttft_s - reference[r.prompt][0])
    cold = reference[worst.prompt][0]
    skipped = next((r.at_s for r in lost if not hit(r, reference) and r.ttft_s <= reference[r.prompt][0] + 0.5), None)
    return {
        "requests": len(requests),
        "failed": sum(r.failed for r in requests),
        "answers_differing": sum(not r.same_answer for r in requests if not r.failed),
        "worst_ttft_s": round(worst.ttft_s, 3),
        "cold_ttft_s": round(cold, 3),
        "worst_over_cold_s": round(worst.ttft_s - cold, 3),
        "hits_while_lost": sum(hit(r, reference) for r in lost),
        "skipped_after_s": None if skipped is None else round(skipped, 2),
        "hits_again_after_s": next((round(r.at_s - lost_s, 2) for r in back if hit(r, reference)), None),
        "hits_before": len({r.prompt for r in requests if r.phase == "before" and hit(r, reference)}),
    }


def a_chunk_tokens(daemon) -> int:
    return httpx.get(daemon.url + "/v1/config", timeout=10).json()["chunk_tokens"]


def wait_persisted(daemon, chunks: int, timeout_s: float = 300) -> None:
    """Wait until ``daemon``'s write-behind has persisted ``chunks`` chunks: A's KV is on its NVMe too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = httpx.get(daemon.url + "/v1/stats", headers=daemon.headers, timeout=10).json()
        if stats["write_behind"]["persisted"] >= chunks:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the publisher's node persisted fewer than {chunks} chunks in {timeout_s} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=1100)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--lost-s", type=float, default=15.0, help="how long each loss lasts")
    parser.add_argument("--back-s", type=float, default=20.0, help="how long requests go on after A returns")
    parser.add_argument("--only", help="run only the ways to lose A whose name holds this (e.g. frozen)")
    parser.add_argument(
        "--workdir", type=Path, help="where the run's files and logs go, kept [default: a temporary one]"
    )
    args = parser.parse_args(argv)
    ways_run = [way for way in WAYS if args.only is None or args.only in way.name]
    if not ways_run:
        parser.error(f"--only {args.only!r} names none of: {', '.join(way.name for way in WAYS)}")
    if reason := unusable():
        print(f"node_loss needs network namespaces: {reason}", file=sys.stderr)
        return 2
    prompts = [random_prompt(seed=700 + i, length=args.prompt_tokens) for i in range(args.prompts)]
    results: list[Request] = []
    ways: dict[str, dict] = {}
    with contextlib.ExitStack() as kept:
        directory = args.workdir or Path(kept.enter_context(tempfile.TemporaryDirectory(prefix="node-loss-")))
        directory.mkdir(parents=True, exist_ok=True)
        with a_lost_node_scene(directory, prompts) as scene:
            for way in ways_run:
                print(f"losing A: {way.name}", file=sys.stderr)
                requests = run_way(scene, way, args.lost_s, args.back_s)
                results += requests
                ways[way.name] = summary(requests, scene.reference, args.lost_s)
                if way.recover is not None:
                    wait_for_hits(scene)  # the next way starts from a node read from again
    rows = [
        [
            name,
            f["worst_ttft_s"],
            f["cold_ttft_s"],
            f["worst_over_cold_s"],
            f["failed"],
            f["answers_differing"],
            f["skipped_after_s"],
            f["hits_again_after_s"],
        ]
        for name, f in ways.items()
    ]
    print_table(
        "node loss (TTFT on the surviving node)",
        ["way", "worst s", "cold s", "worst - cold s", "failed", "differing", "skipped after s", "hits again s"],
        rows,
    )
    payload = {
        "config": {**{k: v for k, v in vars(args).items() if k != "workdir"}, "answer_tokens": ANSWER_TOKENS},
        "ways": ways,
        "cold_ttft_s": {i: round(ttft, 3) for i, (ttft, _) in scene.reference.items()},
        "requests": [asdict(r) for r in results],
    }
    written = write_results("node_loss", payload, partial=not with_defaults(parser, args, apart_from={"workdir"}))
    print(f"wrote {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
