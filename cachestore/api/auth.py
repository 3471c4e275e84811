"""Bearer-token access control for the REST API.

Every mutating endpoint needs ``Authorization: Bearer <token>`` and so does every read-only one,
unless reads are opened (``open_reads``); writes and warm-up jobs can never be opened. The daemon
always has a token: the operator's, or one it generated at first start (``ADMIN_TOKEN_FILE`` in its
secrets folder, 0600, where the CLI run as the same user finds it). A policy without a token fails
closed: nothing authenticates. ``/v1/health``, ``/v1/live`` and ``/v1/config`` take no dependency and
stay open: probes and connectors use them, and none holds a secret (``/v1/config`` names the token's file,
never its value).

Routers declare their needs with ``dependencies=[Depends(require_admin)]`` (mutations) or
``Depends(require_reader)`` (inspection); the policy lives on ``app.state`` so any router, in any
module, checks the same token. Tokens are compared in constant time and never logged or echoed.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

_bearer = HTTPBearer(auto_error=False, description="the daemon's admin token (PREFIXCACHE_ADMIN_TOKEN)")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
#: The generated token's file, in the daemon's secrets folder (``secrets_store.secrets_dir``).
ADMIN_TOKEN_FILE = "admin-token"


@dataclass(frozen=True)
class AccessPolicy:
    #: None: no token is accepted (fail closed)
    admin_token: SecretStr | None = None
    #: read-only endpoints answer without the token
    open_reads: bool = False


def install_access_policy(app: FastAPI, policy: AccessPolicy) -> None:
    app.state.access_policy = policy


def _check(request: Request, credentials: HTTPAuthorizationCredentials | None, reading: bool) -> None:
    policy: AccessPolicy = getattr(request.app.state, "access_policy", AccessPolicy())
    if reading and policy.open_reads:
        return
    given = credentials.credentials.encode() if credentials is not None else b""
    expected = policy.admin_token.get_secret_value().encode() if policy.admin_token is not None else None
    if expected is None or not hmac.compare_digest(given, expected):
        raise HTTPException(
            status_code=status.HTTP_401_UNAUTHORIZED,
            detail="this endpoint needs the admin token: Authorization: Bearer <token>",
            headers={"WWW-Authenticate": "Bearer"},
        )


def require_admin(request: Request, credentials: Credentials) -> None:
    """Dependency of every mutating endpoint (warm-up jobs included): 401 unless the admin token is given."""
    _check(request, credentials, reading=False)


def require_reader(request: Request, credentials: Credentials) -> None:
    """Dependency of read-only endpoints: like ``require_admin`` unless reads are opened."""
    _check(request, credentials, reading=True)


def admin_token_path(secrets: Path) -> Path:
    """Where the daemon keeps the token it generated, given its secrets folder."""
    return Path(secrets) / ADMIN_TOKEN_FILE
