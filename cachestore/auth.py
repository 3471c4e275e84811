"""Bearer-token access control for the REST API.

With no admin token configured every endpoint is open (the API binds to loopback unless told
otherwise). With one, every mutating endpoint needs ``Authorization: Bearer <token>`` and so does
every read-only one, unless reads are opened (``open_reads``). ``/v1/health``, ``/v1/live`` and
``/v1/config`` take no dependency and stay open: probes and connectors use them, and none holds a secret.

Routers declare their needs with ``dependencies=[Depends(require_admin)]`` (mutations) or
``Depends(require_reader)`` (inspection); the policy lives on ``app.state`` so any router, in any
module, checks the same token. Tokens are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

_bearer = HTTPBearer(auto_error=False, description="the daemon's admin token (PREFIXCACHE_ADMIN_TOKEN)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


@dataclass(frozen=True)
class AccessPolicy:
    admin_token: SecretStr | None = None
    #: read-only endpoints answer without the token
    open_reads: bool = False


def install_access_policy(app: FastAPI, policy: AccessPolicy) -> None:
    app.state.access_policy = policy


def _check(request: Request, credentials: HTTPAuthorizationCredentials | None, reading: bool) -> None:
    policy: AccessPolicy = getattr(request.app.state, "access_policy", AccessPolicy())
    if policy.admin_token is None or (reading and policy.open_reads):
        return
    expected = policy.admin_token.get_secret_value().encode()
    given = credentials.credentials.encode() if credentials is not None else b""
    if not hmac.compare_digest(given, expected):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="this endpoint needs the admin token: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_admin(request: Request, credentials: Credentials) -> None:
    """Dependency of every mutating endpoint: 401 unless the admin token is configured and given, or none is set."""
    _check(request, credentials, reading=False)


def require_reader(request: Request, credentials: Credentials) -> None:
    """Dependency of read-only endpoints: like ``require_admin`` unless reads are opened."""
    _check(request, credentials, reading=True)
