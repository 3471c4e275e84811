"""``/v1/quotas``: byte quotas per tenant and per namespace (indexer/quotas.py), and what each scope holds.

Reads need ``require_reader``, changes ``require_admin``. A quota set here replaces the daemon's settings for
its scope, in every daemon of the cluster (quotas live in the index); deleting it brings the settings' back.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path

from prefixcache.cachestore.api.auth import require_admin, require_reader
from prefixcache.cachestore.api.models import Quota, QuotaRequest
from prefixcache.cachestore.services.cache_admin import NotFoundError
from prefixcache.cachestore.services.quotas import QuotaEnforcer, QuotaState
from prefixcache.indexer.quotas import QuotaScope

ScopeId = Annotated[
    str, Path(pattern=r"^([0-9a-fA-F]{16}|none|[0-9a-fA-F]{32})$", description="tenant id or namespace digest")
]
_ERRORS: dict[int | str, dict[str, object]] = {
    422: {"description": "invalid request"},
    503: {"description": "the index is unreachable"},
}


def quota(state: QuotaState) -> Quota:
    return Quota(
        scope=state.scope.kind,
        id=state.scope.id,
        limit_bytes=state.limit_bytes,
        source=state.source,
        used_chunks=state.used.chunks,
        used_bytes=state.used.bytes,
        at_quota=state.at_quota,
        evicted_chunks=state.evicted_chunks,
    )


def quota_router(quotas: QuotaEnforcer) -> APIRouter:
    router = APIRouter(prefix="/v1/quotas", responses=_ERRORS, tags=["quotas"])

    def of_scope(scope: QuotaScope) -> Quota | None:
        return next((quota(s) for s in quotas.states() if s.scope == scope), None)

    @router.get("", response_model=list[Quota], dependencies=[Depends(require_reader)])
    def list_quotas() -> list[Quota]:
        """Every quota (set here, by settings, or the default tenant quota) and what its scope holds."""
        return [quota(s) for s in quotas.states()]

    @router.put("/{kind}/{scope_id}", response_model=Quota, dependencies=[Depends(require_admin)])
    def set_quota(kind: Literal["tenant", "namespace"], scope_id: ScopeId, request: QuotaRequest) -> Quota:
        """Set a scope's quota; a scope over it loses its least recently used unpinned chunks within a second."""
        scope = QuotaScope(kind, scope_id.lower())
        quotas.store.set(scope, int(request.limit_bytes))
        quotas.poke()
        answer = of_scope(scope)
        assert answer is not None  # just set
        return answer

    @router.delete(
        "/{kind}/{scope_id}",
        response_model=Quota | None,
        dependencies=[Depends(require_admin)],
        responses={404: {"description": "no quota set through the API"}},
    )
    def delete_quota(kind: Literal["tenant", "namespace"], scope_id: ScopeId) -> Quota | None:
        """Remove a quota set through the API; answers the scope's quota from the settings, if any."""
        scope = QuotaScope(kind, scope_id.lower())
        if not quotas.store.delete(scope):
            raise NotFoundError(f"no quota for {scope} was set through the API")
        quotas.poke()
        return of_scope(scope)

    return router
