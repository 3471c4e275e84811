"""The proxy's pure rules, its settings' errors, what it forwards and refuses, and how it answers when no instance
can be reached.

The flow through real vLLM instances is tested in tests/e2e/test_proxy_e2e.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from prefixcache.cachestore.host.processes import free_port
from prefixcache.cachestore.proxy.routing import (
    InstancePool,
    prefill_body,
    prompt_token_ids,
    publishable_tokens,
    tokenize_body,
)
from prefixcache.cachestore.proxy.server import CachedPrefix, create_app
from prefixcache.cachestore.proxy.settings import ProxySettings
from prefixcache.indexer.errors import ConfigError
from tests.test_index import publish


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_round_robin_rotates_and_tries_a_failed_instance_last_until_its_cooldown_ends():
    clock = Clock()
    pool = InstancePool(["a", "b", "c"], cooldown_s=10, clock=clock)
    assert [pool.order()[0] for _ in range(4)] == ["a", "b", "c", "a"]
    pool.failed("c")
    assert pool.order() == ["b", "a", "c"] and pool.down() == ["c"]
    clock.now += 10
    assert pool.order() == ["c", "a", "b"] and pool.down() == []
    pool.failed("a")
    pool.succeeded("a")
    assert pool.order() == ["a", "b", "c"]


def test_a_prefill_request_asks_for_one_token_without_streaming_and_keeps_the_rest():
    body = {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"x": 1},
        "min_tokens": 8,
        "n": 4,
        "temperature": 0.0,
        "cache_salt": "t",
    }
    assert prefill_body(body) == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "temperature": 0.0,
        "cache_salt": "t",
    }
    assert body["max_tokens"] == 64  # the decode instance gets the original
    chat = prefill_body({"messages": [], "max_completion_tokens": 100})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [(512, 512), (512 + 16, 528), (512 + 15, 512), (10, 0), (300, 300)],
)
def test_the_store_holds_full_chunks_and_tails_of_at_least_16_tokens(prompt, expected):
    assert publishable_tokens(prompt, 256) == expected


def test_token_ids_come_from_the_request_only_for_one_tokenized_completion_prompt():
    assert prompt_token_ids("/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids("/v1/completions", {"prompt": [[5], [6]]}) is None
    assert prompt_token_ids("/v1/completions", {"prompt": [True, 1]}) is None
    assert prompt_token_ids("/v1/completions", {"prompt": "text"}) is None
    assert prompt_token_ids("/v1/chat/completions", {"prompt": [1]}) is None


def test_text_and_chat_prompts_are_tokenized_by_the_engine_batches_are_not():
    assert tokenize_body("/v1/completions", {"model": "m", "prompt": "hi"}) == {"model": "m", "prompt": "hi"}
    messages = [{"role": "user", "content": "hi"}]
    chat = {"model": "m", "messages": messages, "temperature": 1, "add_generation_prompt": True}
    assert tokenize_body("/v1/chat/completions", chat) == {
        "model": "m",
        "messages": messages,
        "add_generation_prompt": True,
    }
    assert tokenize_body("/v1/completions", {"prompt": ["a", "b"]}) is None


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"prefill": ["localhost:8100"], "decode": ["http://a:1"]}, "prefill: must look like http://HOST:PORT"),
        ({"prefill": ["http://a:1"], "decode": []}, "decode: List should have at least 1 item"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1/v1"]}, "decode: must look like http://HOST:PORT"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1"], "routing": "cache-aware"}, "needs --service-url"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1"], "routing": "random"}, "routing: Input should be"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1"], "port": 0}, "port: Input should be greater"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1"], "publish_wait_s": -1}, "publish_wait_s: Input should"),
        ({"prefill": ["http://a:1"], "decode": ["http://b:1"], "retry_after_s": 0}, "retry_after_s: Input should"),
    ],
)
def test_bad_settings_are_refused_with_the_field_and_the_reason(values, message):
    with pytest.raises(ConfigError, match="invalid proxy setting") as caught:
        ProxySettings.parse(values)
    assert message in str(caught.value)


def test_comma_separated_and_repeated_urls_mean_the_same():
    settings = ProxySettings.parse({"prefill": ["http://a:1,http://b:2/", "http://c:3"], "decode": "http://d:4"})
    assert settings.prefill == ["http://a:1", "http://b:2", "http://c:3"] and settings.decode == ["http://d:4"]


@pytest.fixture
def nothing_listening() -> ProxySettings:
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    return ProxySettings.parse({"prefill": urls[:1], "decode": urls[1:]})


@pytest.mark.anyio
async def test_with_no_instance_reachable_the_client_gets_an_openai_style_502(nothing_listening):
    app = create_app(nothing_listening)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 4})
        assert response.status_code == 502
        error = response.json()["error"]
        assert error["code"] == 502 and "no decode instance answered" in error["message"]
        stats = (await client.get("/proxy/stats")).json()
        assert stats == {
            "requests": 1,
            "prefilled": 0,
            "prefill_skipped": 0,
            "prefill_failed": 1,
            "decode_failed": 1,
            "publish_wait_expired": 0,
            "not_through_the_store": 0,
        }
        health = (await client.get("/health")).json()
        assert health["prefill_down"] == nothing_listening.prefill
        assert sorted(health["decode_down"]) == sorted(nothing_listening.decode)
    await app.state.proxy.close()


@pytest.mark.anyio
@pytest.mark.parametrize("opt_out", [{"publish": False}, {"load": False}])
async def test_a_request_that_turns_the_store_off_for_itself_goes_to_a_decode_instance_directly(
    nothing_listening, opt_out
):
    app = create_app(nothing_listening)
    body = {"model": "m", "prompt": [1, 2, 3], "kv_transfer_params": {"prefixcache": opt_out}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        assert (await client.post("/v1/completions", json=body)).status_code == 502
        stats = (await client.get("/proxy/stats")).json()
        # no prefill instance was tried: its KV could not have reached the decode instance
        assert stats["not_through_the_store"] == 1 and stats["prefill_failed"] == 0 and stats["decode_failed"] == 1
    await app.state.proxy.close()


@pytest.mark.anyio
async def test_a_malformed_prefixcache_request_entry_is_a_400_naming_it(nothing_listening):
    app = create_app(nothing_listening)
    body = {"model": "m", "prompt": [1, 2, 3], "kv_transfer_params": {"prefixcache": {"pubish": False}}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 400
        assert 'kv_transfer_params["prefixcache"] is invalid (pubish' in response.json()["error"]["message"]
        assert (await client.get("/proxy/stats")).json()["decode_failed"] == 0  # nothing was sent anywhere
    await app.state.proxy.close()


@pytest.mark.anyio
async def test_a_body_that_is_not_a_json_object_is_a_400(nothing_listening):
    app = create_app(nothing_listening)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        assert (await client.post("/v1/chat/completions", content=b"{nope")).status_code == 400
        response = await client.post("/v1/chat/completions", json=[1, 2])
        assert response.status_code == 400 and response.json()["error"]["type"] == "BadRequestError"
    await app.state.proxy.close()


def test_a_prefix_counts_as_stored_once_every_rank_holds_it(index, spec):
    """Cache-aware routing skips the prefill only when each rank's shard of the prompt is stored: every tensor-parallel
    rank of every pipeline stage."""
    ranks = spec.model_copy(update={"tp_size": 2, "pp_size": 2}).shards()
    for rank in ranks:
        index.register_namespace(rank)
    prompt = list(range(200))  # three 64-token chunks and an 8-token tail (too short to publish)
    cache = CachedPrefix(index)
    for rank in ranks[:-1]:
        publish(index, rank, prompt[:192])
    assert not cache.complete(spec.model, prompt, None)  # the second stage's second rank lacks it
    publish(index, ranks[-1], prompt[:192])
    assert cache.complete(spec.model, prompt, None)
    assert not cache.complete("another-model", prompt, None) and not cache.complete(spec.model, prompt, "tenant")


@pytest.mark.anyio
async def test_with_no_prefill_instance_answering_nothing_waits_for_chunks_it_never_published(daemon):
    """Cache-aware routing waits for a prefill's chunks to reach the index, but only after a prefill ran: with
    every prefill instance down the decode instance is asked at once, not ``publish_wait_s`` later."""
    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    settings = ProxySettings.parse(
        {
            "prefill": urls[:1],
            "decode": urls[1:],
            "routing": "cache-aware",
            "service_url": daemon.url,
            "publish_wait_s": 60,
        }
    )
    app = create_app(settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": list(range(300))})
        assert response.status_code == 502
        stats = (await client.get("/proxy/stats")).json()
        assert stats["prefill_failed"] == 1 and stats["decode_failed"] == 1 and stats["publish_wait_expired"] == 0
    await app.state.proxy.close()


class Upstream:
    """A stand-in vLLM instance on a real local port: answers completions and models, records each request's path
    and Authorization header."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                upstream.seen.append((self.path, self.headers.get("Authorization")))
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps({"choices": [{"text": "ok"}], "data": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def instances() -> Iterator[tuple[Upstream, Upstream]]:
    prefill, decode = Upstream(), Upstream()
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.mark.anyio
async def test_the_clients_authorization_reaches_the_prefill_and_the_decode_instance(instances):
    """vLLM started with --api-key checks it behind the proxy."""
    prefill, decode = instances
    app = create_app(ProxySettings.parse({"prefill": [prefill.url], "decode": [decode.url]}))
    auth = {"Authorization": "Bearer vllm-api-key"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3]}, headers=auth)
        assert response.status_code == 200
        assert (await client.get("/v1/models", headers=auth)).status_code == 200
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": [1]})).status_code == 200
    await app.state.proxy.close()
    assert prefill.seen == [("/v1/completions", "Bearer vllm-api-key"), ("/v1/completions", None)]
    assert decode.seen == [
        ("/v1/completions", "Bearer vllm-api-key"),
        ("/v1/models", "Bearer vllm-api-key"),
        ("/v1/completions", None),
    ]


@pytest.mark.anyio
async def test_with_a_proxy_token_a_request_without_it_is_a_401_that_reaches_no_instance(instances):
    prefill, decode = instances
    token = "proxy-token-0123456789abcdef"
    app = create_app(ProxySettings.parse({"prefill": [prefill.url], "decode": [decode.url], "auth_token": token}))
    body = {"model": "m", "prompt": [1, 2, 3]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        for headers in (
            {},
            {"Authorization": "Bearer wrong-token-0123456789ab"},
            {"Authorization": token},
            {"Authorization": f"Basic {token}"},
        ):
            response = await client.post("/v1/completions", json=body, headers=headers)
            assert response.status_code == 401, headers
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json()["error"]["code"] == 401 and token not in response.text
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/proxy/stats")).status_code == 401
        assert (await client.get("/health")).status_code == 200  # for probes
        assert prefill.seen == decode.seen == []
        good = {"Authorization": f"Bearer {token}"}
        assert (await client.post("/v1/completions", json=body, headers=good)).status_code == 200
        assert (await client.get("/proxy/stats", headers=good)).json()["prefilled"] == 1
    await app.state.proxy.close()
    assert decode.seen == [("/v1/completions", f"Bearer {token}")]  # the same value may be vLLM's --api-key


def test_a_short_proxy_token_is_refused():
    with pytest.raises(ConfigError, match="auth_token"):
        ProxySettings.parse({"prefill": ["http://a:1"], "decode": ["http://b:1"], "auth_token": "short"})
