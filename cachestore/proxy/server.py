"""``prefixcache proxy``: disaggregated prefill through the store, behind one OpenAI-compatible address.

Each request goes first to a prefill instance with ``max_tokens=1``: its connector (``kv_producer``)
computes the prompt's KV and publishes it. The original request then goes to a decode instance,
whose connector (``kv_consumer`` or ``kv_both``) finds the prefix in the store, loads it and computes
only the rest. Any of X prefill instances can serve any of Y decode instances: the store is where
they meet, so no instance needs to know another and the proxy never touches KV bytes.

Routing is round robin, or cache-aware: the proxy asks the index how much of the prompt is already
cached and skips the prefill step when a prefill could add nothing. A request that turns publishing or
loading off for itself (``kv_transfer_params``, cachestore/client/request_params.py) cannot travel through the
store, so it goes to a decode instance directly; a malformed such entry is answered 400.

Failures degrade, never break: a prefill instance that cannot be reached (or answers 5xx) is skipped and
the decode instance prefills the prompt itself; a decode instance that cannot be reached is replaced by
the next one; only when none answers does the client get an error, as an OpenAI-style JSON body with
status 502.

Authorization: the client's ``Authorization`` header reaches every instance the request goes to (so vLLM's own
``--api-key`` works behind the proxy), and with ``auth_token`` the proxy itself answers 401 to a request that
does not carry ``Bearer <auth_token>`` (the same value as vLLM's API key, when both are set).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import SecretStr
from starlette.background import BackgroundTask

from prefixcache.cachestore.client.config import fetch_config, index_url
from prefixcache.cachestore.client.request_params import request_cache_params
from prefixcache.cachestore.proxy.routing import (
    InstancePool,
    prefill_body,
    prompt_token_ids,
    publishable_tokens,
    tokenize_body,
)
from prefixcache.cachestore.proxy.settings import ProxySettings
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.index import PrefixIndex
from prefixcache.indexer.keys import PrefixHasher, extend_all
from prefixcache.indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.proxy")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: How often the proxy re-checks the index while a prefill instance's chunks are being registered.
PUBLISH_POLL_S = 0.01


@dataclass
class ProxyStats:
    requests: int = 0
    prefilled: int = 0
    prefill_skipped: int = 0  # cache-aware: the whole prefix was already in the store
    prefill_failed: int = 0  # no prefill instance answered: the decode instance prefilled itself
    decode_failed: int = 0  # no decode instance answered: the client got a 502
    publish_wait_expired: int = 0  # cache-aware: a prefill's chunks missed the index for publish_wait_s
    not_through_the_store: int = 0  # the request turned publishing or loading off: sent to decode directly


class CachedPrefix:
    """Cache-aware routing's view of the index: is a prompt's whole publishable prefix already stored?

    The proxy does not know a decode instance's namespace (model fingerprint, KV layout...), only the
    model name the client asked for, so it checks every namespace registered under that name. Under
    tensor or pipeline parallelism each rank stores its shard in a namespace of its own: a prefix is
    stored once every rank's is.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    @classmethod
    def of_service(cls, service_url: str, redis_password: str | None) -> CachedPrefix:
        """The index the daemon at ``service_url`` uses."""
        config = fetch_config(service_url)
        return cls(RedisIndex(index_url(config, redis_password), key_prefix=config.key_prefix))

    def complete(self, model: str, tokens: list[int], tenant_salt: str | None) -> bool:
        try:
            for spec in self.index.namespaces():
                if spec.model != model or spec.shard:
                    continue
                geometry = ChunkGeometry(spec.chunk_tokens)
                chains = [PrefixHasher(shard.root(tenant_salt), geometry) for shard in spec.shards()]
                extend_all(chains, tokens)  # the tokens converted once, not once per rank
                matches = self.index.lookup_many([chain.query() for chain in chains])
                if all(m.matched_tokens >= publishable_tokens(len(tokens), spec.chunk_tokens) for m in matches):
                    return True
        except IndexUnavailableError as exc:
            log.debug("index unreachable, assuming a miss: %s", exc)
        return False

    def close(self) -> None:
        self.index.close()


class Proxy:
    def __init__(self, settings: ProxySettings) -> None:
        self.settings = settings
        self.prefill = InstancePool(settings.prefill, settings.retry_after_s)
        self.decode = InstancePool(settings.decode, settings.retry_after_s)
        self.stats = ProxyStats()
        self.cache = (
            CachedPrefix.of_service(settings.service_url, settings.redis_password) if settings.service_url else None
        )
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(settings.timeout_s, connect=5.0))

    async def close(self) -> None:
        await self.client.aclose()
        if self.cache is not None:
            self.cache.close()

    async def generate(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
        """``headers``: the client's that go on to the instances (its ``Authorization``)."""
        headers = headers or {}
        self.stats.requests += 1
        params, problem = request_cache_params(body.get("kv_transfer_params"))
        if problem:
            return error_response(400, problem, "BadRequestError")
        decode_order = self.decode.order()
        if not (params.publish and params.load):  # a prefill instance's work would never reach the decode instance
            self.stats.not_through_the_store += 1
            return await self._decode(path, body, decode_order, headers)
        tokens = await self._prompt_tokens(path, body, decode_order[0], headers)
        aware = self.settings.routing == "cache-aware" and tokens is not None and "model" in body
        if aware and tokens is not None and await self._cached(body, tokens):
            self.stats.prefill_skipped += 1
        else:
            prefilled = await self._prefill(path, body, headers)
            if isinstance(prefilled, Response):
                return prefilled
            if prefilled and aware and tokens is not None and self.settings.publish_wait_s > 0:
                await self._wait_published(body, tokens)
        return await self._decode(path, body, decode_order, headers)

    async def _prompt_tokens(
        self, path: str, body: dict[str, Any], decode_url: str, headers: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids, asking the decode instance's tokenizer when the request has text."""
        if self.settings.routing != "cache-aware":
            return None
        tokens = prompt_token_ids(path, body)
        request = tokenize_body(path, body) if tokens is None else None
        if request is not None:
            try:
                response = await self.client.post(decode_url + "/tokenize", json=request, headers=headers)
                if response.status_code == 200:
                    tokens = response.json().get("tokens")
            except httpx.HTTPError as exc:
                log.debug("tokenize at %s failed: %s", decode_url, exc)
        return tokens or None

    async def _cached(self, body: dict[str, Any], tokens: list[int]) -> bool:
        assert self.cache is not None
        return await asyncio.to_thread(self.cache.complete, body["model"], tokens, body.get("cache_salt"))

    async def _wait_published(self, body: dict[str, Any], tokens: list[int]) -> None:
        """A prefill instance registers its chunks just after it answers; the decode instance should find them."""
        clock = asyncio.get_running_loop().time
        started = clock()
        while not await self._cached(body, tokens):
            if clock() - started >= self.settings.publish_wait_s:
                self.stats.publish_wait_expired += 1
                log.warning(
                    "a prefill's chunks were not all in the index after %.1f s: the decode instance "
                    "computes what is missing (raise --publish-wait-s if this repeats)",
                    self.settings.publish_wait_s,
                )
                return
            await asyncio.sleep(PUBLISH_POLL_S)
        log.debug("a prefill's chunks reached the index %.3f s after it answered", clock() - started)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Response | bool:
        """Run the prompt on a prefill instance; whether one did. An instance failure just skips the step (the
        decode instance prefills itself, and nothing is waited for); the client's own mistakes (4xx: the decode
        instance would refuse the request too) come back as the error response to relay."""
        request = prefill_body(body)
        for url in self.prefill.order():
            try:
                response = await self.client.post(url + path, json=request, headers=headers)
            except httpx.HTTPError as exc:
                log.warning("prefill instance %s failed (%s); trying the next", url, exc)
                self.prefill.failed(url)
                continue
            if response.status_code < 400:
                self.prefill.succeeded(url)
                self.stats.prefilled += 1
                return True
            if response.status_code < 500:
                return _relay(response)
            log.warning("prefill instance %s answered %d; trying the next", url, response.status_code)
            self.prefill.failed(url)
        self.stats.prefill_failed += 1
        log.warning("no prefill instance answered: the decode instance prefills the prompt itself")
        return False

    async def _decode(self, path: str, body: dict[str, Any], order: list[str], headers: dict[str, str]) -> Response:
        stream = bool(body.get("stream"))
        for url in order:
            request = self.client.build_request("POST", url + path, json=body, headers=headers)
            try:
                response = await self.client.send(request, stream=stream)
            except httpx.HTTPError as exc:
                log.warning("decode instance %s failed (%s); trying the next", url, exc)
                self.decode.failed(url)
                continue
            self.decode.succeeded(url)
            if not stream:
                return _relay(response)
            if response.status_code >= 400:
                await response.aread()
                await response.aclose()
                return _relay(response)
            return StreamingResponse(
                _relay_stream(response, url),
                status_code=response.status_code,
                media_type=response.headers.get("content-type", "text/event-stream"),
                background=BackgroundTask(response.aclose),
            )
        self.stats.decode_failed += 1
        return error_response(502, f"no decode instance answered (tried {', '.join(order)})", "BadGateway")

    async def forward_get(self, path: str, headers: dict[str, str] | None = None) -> Response:
        for url in self.decode.order():
            try:
                return _relay(await self.client.get(url + path, headers=headers))
            except httpx.HTTPError:
                self.decode.failed(url)
        return error_response(502, "no decode instance answered", "BadGateway")


def _relay(response: httpx.Response) -> Response:
    return Response(
        response.content,
        status_code=response.status_code,
        media_type=response.headers.get("content-type", "application/json"),
    )


async def _relay_stream(response: httpx.Response, url: str) -> AsyncIterator[bytes]:
    """The decode instance's server-sent events as they come; a broken stream ends with an error event."""
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("decode instance %s broke off a stream: %s", url, exc)
        message = {
            "error": {"message": f"decode instance broke off the stream: {exc}", "type": "BadGateway", "code": 502}
        }
        yield f"data: {json.dumps(message)}\n\n".encode()


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """An error as vLLM and OpenAI shape it, so clients' error handling works unchanged."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def forwarded_headers(request: Request) -> dict[str, str]:
    """What of the client's request goes on to the instances: its credentials."""
    authorization = request.headers.get("authorization")
    return {"Authorization": authorization} if authorization is not None else {}


def bearer_matches(request: Request, token: SecretStr) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (compared in constant time)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    expected = token.get_secret_value().encode()
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)


def create_app(settings: ProxySettings) -> FastAPI:
    proxy = Proxy(settings)
    app = FastAPI(title="prefixcache proxy", summary="Disaggregated prefill through the prefixcache store.")
    app.router.add_event_handler("shutdown", proxy.close)
    app.state.proxy = proxy

    if settings.auth_token is not None:
        token = settings.auth_token

        @app.middleware("http")
        async def require_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            if request.url.path == "/health" or bearer_matches(request, token):
                return await call_next(request)
            response = error_response(
                401, "missing or wrong bearer token (Authorization: Bearer ...)", "AuthenticationError"
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response

    async def generation(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return error_response(400, f"request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object", "BadRequestError")
        return await proxy.generate(request.url.path, body, forwarded_headers(request))

    for path in GENERATION_PATHS:
        app.add_api_route(path, generation, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await proxy.forward_get("/v1/models", forwarded_headers(request))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        """The proxy is up; instances that failed recently are listed (requests still go around them)."""
        return {"status": "ok", "prefill_down": proxy.prefill.down(), "decode_down": proxy.decode.down()}

    @app.get("/proxy/stats")
    async def stats() -> dict[str, int]:
        return asdict(proxy.stats)

    return app


def serve(settings: ProxySettings) -> None:
    import uvicorn

    app = create_app(settings)
    log.info(
        "prefixcache proxy on http://%s:%d: prefill %s, decode %s, routing %s",
        settings.host,
        settings.port,
        ", ".join(settings.prefill),
        ", ".join(settings.decode),
        settings.routing,
    )
    if settings.auth_token is None and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "no proxy token: anyone who reaches %s:%d can send requests to the instances "
            "(set PREFIXCACHE_PROXY_TOKEN, or give them --api-key)",
            settings.host,
            settings.port,
        )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")
