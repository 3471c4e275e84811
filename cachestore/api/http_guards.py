"""Checks every REST request passes before any endpoint sees it: a known Host header, a bounded body.

**Host.** A browser on the daemon's host can be made to send requests to it from any web page
(DNS rebinding: ``evil.example`` resolving to 127.0.0.1). Such requests carry the attacker's name in
the Host header, so only names the daemon is known by are answered: localhost, the loopback
addresses, the bind address, the node name, and the operator's ``allowed_hosts``. Anything else is
a 400 (Starlette's ``TrustedHostMiddleware``), whatever address the daemon binds to.

**Body size.** A request whose body is larger than ``max_body_bytes`` gets 413 before the body is
read: at once when its Content-Length says so, and, for a chunked body, as soon as the bytes received
pass the limit (the body is read ahead up to the limit, so the endpoint never parses a partial one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Names a local client reaches the daemon by, on any bind address.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def trusted_hosts(*names: str | None, extra: Iterable[str] = ()) -> list[str]:
    """Host header values (without the port) the API answers: loopback, ``names`` and ``extra``. An IPv6
    address is listed as the Host header carries it, in brackets. A wildcard bind address names no host."""
    hosts: list[str] = []
    for name in (*LOOPBACK_HOSTS, *names, *extra):
        if not name or name in ("0.0.0.0", "::", "[::]"):
            continue
        name = name.lower()
        if ":" in name and not name.startswith("["):
            name = f"[{name}]"
        if name not in hosts:
            hosts.append(name)
    return hosts


class BodyLimit:
    """ASGI middleware: 413 for a request body over ``max_bytes``, before the application reads any of it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope["headers"])
        if length is not None:
            if length > self.max_bytes:
                return await _too_large(self.max_bytes, send)
            return await self.app(scope, receive, send)
        # No Content-Length (a chunked body, or none): read ahead, counting, until the body ends or passes the limit.
        messages: list[Message] = []
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the application sees that as it would have
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                return await _too_large(self.max_bytes, send)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11) refuses a malformed length before we get here
    return None


async def _too_large(max_bytes: int, send: Send) -> None:
    body = b'{"detail":"request body too large: at most %d bytes"}' % max_bytes
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def install_http_guards(app: FastAPI, allowed_hosts: Sequence[str], max_body_bytes: int) -> None:
    """The Host check first (outermost), then the body limit."""
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts), www_redirect=False)
