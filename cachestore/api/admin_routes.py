"""The admin endpoints: namespaces, lookup, chunks, evict, pin and unpin (what they do is
cachestore/services/cache_admin.py). Reads need ``require_reader``, changes ``require_admin``; errors a request
can cause map to clear 4xx answers here, and an unreachable index to 503, so no request can produce a 500."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import redis
from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from prefixcache.cachestore.api.auth import require_admin, require_reader
from prefixcache.cachestore.api.models import (
    MAX_PAGE,
    Chunk,
    ChunkPage,
    EvictRequest,
    EvictResult,
    HexDigest,
    Lookup,
    NamespaceInfo,
    PinRequest,
    PinResult,
    PromptRef,
    Selector,
    TenantId,
)
from prefixcache.cachestore.services.cache_admin import CacheAdmin, ConflictError, NotFoundError
from prefixcache.cachestore.services.tokenizers import TokenizerUnavailableError
from prefixcache.indexer.errors import ConfigError, IndexUnavailableError, InvalidTokensError
from prefixcache.indexer.index import Tier

KEY_PATH = Path(pattern=r"^[0-9a-fA-F]{32}$", description="chunk key, 32 hex characters")
_ERRORS: dict[int | str, dict[str, object]] = {
    404: {"description": "no such chunk or namespace"},
    422: {"description": "invalid request"},
    503: {"description": "the index is unreachable"},
}


def admin_routers(admin: CacheAdmin) -> list[APIRouter]:
    reads = APIRouter(prefix="/v1", dependencies=[Depends(require_reader)], responses=_ERRORS, tags=["inspect"])
    changes = APIRouter(prefix="/v1", dependencies=[Depends(require_admin)], responses=_ERRORS, tags=["evict and pin"])

    @reads.get("/namespaces", response_model=list[NamespaceInfo])
    def namespaces() -> list[NamespaceInfo]:
        """Every registered namespace: its description and what it holds."""
        return admin.namespaces()

    @reads.post("/lookup", response_model=Lookup)
    def lookup(prompt: PromptRef) -> Lookup:
        """How much of a prompt is cached, and in which tiers; does not count as a hit."""
        return admin.lookup(prompt)

    @reads.get("/chunks", response_model=ChunkPage)
    def list_chunks(
        namespace: HexDigest | None = None,
        model: Annotated[str | None, Query(min_length=1, max_length=512)] = None,
        tenant: TenantId | None = None,
        tier: Tier | None = None,
        pinned: bool | None = None,
        older_than_s: Annotated[float | None, Query(ge=0, le=1e10, description="created more than this ago")] = None,
        newer_than_s: Annotated[float | None, Query(ge=0, le=1e10, description="created less than this ago")] = None,
        min_hits: Annotated[int | None, Query(ge=0, le=2**62)] = None,
        cursor: Annotated[HexDigest | None, Query(description="next_cursor of the previous page")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    ) -> ChunkPage:
        """Entries in key order, filtered; a page may be short, follow next_cursor until it is unset."""
        selector = Selector(
            namespace=namespace,
            model=model,
            tenant=tenant,
            tier=tier,
            pinned=pinned,
            older_than_s=older_than_s,
            newer_than_s=newer_than_s,
            min_hits=min_hits,
        )
        return admin.list_chunks(selector, cursor, limit)

    @reads.get("/chunks/{key}", response_model=Chunk)
    def chunk(key: Annotated[str, KEY_PATH]) -> Chunk:
        """One entry's metadata."""
        return admin.chunk(key.lower())

    @changes.delete("/chunks/{key}", response_model=EvictResult, responses={409: {"description": "pinned"}})
    def delete_chunk(key: Annotated[str, KEY_PATH], force: bool = False) -> EvictResult:
        """Evict one chunk from every tier and the index (a pinned one only with force=true)."""
        return admin.delete_chunk(key.lower(), force)

    @changes.post("/evict", response_model=EvictResult)
    def evict(request: EvictRequest) -> EvictResult:
        """Evict by keys, prompt prefix, attributes or all; dry_run reports what would go."""
        return admin.evict(request)

    @changes.post("/pin", response_model=PinResult)
    def pin(request: PinRequest) -> PinResult:
        """Keep chunks through eviction pressure, for ttl_s or until unpinned."""
        return admin.pin(request, pin=True)

    @changes.post("/unpin", response_model=PinResult)
    def unpin(request: PinRequest) -> PinResult:
        """Make chunks evictable again."""
        return admin.pin(request, pin=False)

    return [reads, changes]


def install_error_handlers(app: FastAPI) -> None:
    """Errors a request can cause, as 4xx with the reason; an unreachable index as 503. A validation error (422)
    names each bad field and why, never the value sent (which may be large, or a secret)."""
    app.add_exception_handler(RequestValidationError, _invalid)
    statuses: dict[type[Exception], int] = {
        NotFoundError: 404,
        ConflictError: 409,
        TokenizerUnavailableError: 422,
        ConfigError: 422,
        InvalidTokensError: 422,
        IndexUnavailableError: 503,
        redis.RedisError: 503,
    }
    for error, code in statuses.items():
        app.add_exception_handler(error, _answer(code))


def _answer(code: int) -> Callable[[Request, Exception], Awaitable[JSONResponse]]:  # a Starlette exception handler
    async def handler(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(status_code=code, content={"detail": str(exc)})

    return handler


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = [
        {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
    ]
    return JSONResponse(status_code=422, content={"detail": problems})
