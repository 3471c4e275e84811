"""Every Redis connection prefixcache opens, made here, with explicit socket and connect timeouts.

A connection without a socket timeout waits for ever on a Redis that is hung rather than gone (stopped,
or behind a full network buffer), and what a client gets without naming one has changed between
redis-py versions. So no caller builds ``redis.Redis`` itself: each names the timeouts its work needs,
or takes the defaults, which make an unreachable index a quick miss.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis

from prefixcache.indexer.errors import ConfigError

#: How long a command may wait for its reply: a lookup or registration answers in milliseconds.
SOCKET_TIMEOUT_S = 2.0
#: How long opening a connection may take: a Redis that is down refuses at once, an unreachable host does not.
CONNECT_TIMEOUT_S = 1.0
#: For connections whose commands block on a queue (``BLPOP``) for up to a few seconds: longer than any wait
#: they ask Redis for, so that a wait never ends in a timeout of its own socket.
WAITING_SOCKET_TIMEOUT_S = 10.0

_SCHEMES = ("redis", "rediss", "unix")


def redis_client(
    url: str, *, socket_timeout_s: float = SOCKET_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> redis.Redis:
    """A client of the Redis at ``url`` (``redis://``, ``rediss://`` or ``unix://``); it connects at its first
    command. Raises ``ConfigError`` for a URL that names no Redis."""
    if urlsplit(url).scheme not in _SCHEMES:
        raise ConfigError(f"redis URL must start with redis://, rediss:// or unix://, got {redact_url(url)!r}")
    try:
        return redis.Redis.from_url(url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s)
    except ValueError as exc:
        raise ConfigError(f"invalid redis URL {redact_url(url)!r}: {exc}") from exc


def with_password(url: str, password: str) -> str:
    """The URL with its password set to ``password`` (the user name and the rest kept)."""
    parts = urlsplit(url)
    netloc = f"{parts.username or ''}:{password}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    return url if urlsplit(url).password is None else with_password(url, "***")


def public_redis_url(url: str) -> tuple[str, bool]:
    """The Redis URL without its password (its user name kept), and whether one is needed."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, False
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{parts.username}@{host}" if parts.username else host
    return f"{parts.scheme}://{netloc}" + urlunsplit(parts._replace(scheme="", netloc="")), True
