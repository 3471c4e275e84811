"""Every Redis connection prefixcache opens, made here, with explicit socket and connect timeouts.

A connection without a socket timeout waits for ever on a Redis that is hung rather than gone (stopped,
or behind a full network buffer), and what a client gets without naming one has changed between
redis-py versions. So no caller builds ``redis.Redis`` itself: each names the timeouts its work needs,
or takes the defaults, which make an unreachable index a quick miss.

Three deployments, told apart by the URL's scheme:

* ``redis://``, ``rediss://``, ``unix://``: one server (standalone, or a primary with replicas).
* ``redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE``: the primary that Redis Sentinel names
  for SERVICE, found again after a failover; the password is the data nodes' (sentinels take none).
* ``redis+cluster://[user:password@]host:port[,host:port...]``: a Redis (or Valkey) Cluster, through any of its
  nodes; the client learns the others and which slots each serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.cluster
import redis.sentinel
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.keyspace import Keyspace

#: How long a command may wait for its reply: a lookup or registration answers in milliseconds.
SOCKET_TIMEOUT_S = 2.0
#: How long opening a connection may take: a Redis that is down refuses at once, an unreachable host does not.
CONNECT_TIMEOUT_S = 1.0
#: For connections whose commands block on a queue (``BLPOP``) for up to a few seconds: longer than any wait
#: they ask Redis for, so that a wait never ends in a timeout of its own socket.
WAITING_SOCKET_TIMEOUT_S = 10.0

#: Keys read to tell a Cluster node from a lone server: spread over the slots, so that with two masters or more one
#: of them lies on another master (all on one: 1 in 3**16 with three).
CLUSTER_PROBES = 16
SENTINEL_SCHEME = "redis+sentinel"
CLUSTER_SCHEME = "redis+cluster"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME, CLUSTER_SCHEME)

#: What ``redis_client`` returns: both offer the commands prefixcache sends (a cluster client routes each by key).
RedisClient: TypeAlias = redis.Redis | redis.cluster.RedisCluster


@dataclass(frozen=True)
class ServerList:
    """The hosts, credentials and path of a URL that names several servers (Sentinel or Cluster)."""

    hosts: list[tuple[str, int]]
    username: str | None
    password: str | None
    path: str


def scheme_of(url: str) -> str:
    return urlsplit(url).scheme


def check_redis_url(url: str) -> None:
    """Raise ``ConfigError`` unless ``url`` names a Redis in one of the ``SCHEMES``."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        schemes = ", ".join(s + "://" for s in SCHEMES)
        raise ConfigError(f"redis URL must start with {schemes}, got {redact_url(url)!r}")
    if scheme in (SENTINEL_SCHEME, CLUSTER_SCHEME):
        servers = server_list(url)
        if scheme == SENTINEL_SCHEME and not servers.path.strip("/"):
            raise ConfigError(f"a Sentinel URL names its service after the hosts (…/mymaster), got {redact_url(url)!r}")


def server_list(url: str) -> ServerList:
    """The parts of a ``redis+sentinel://`` or ``redis+cluster://`` URL; ``ConfigError`` where one is wrong."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    found = []
    for item in filter(None, hosts.split(",")):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"each server in a {parts.scheme}:// URL is host:port, got {item!r}")
        found.append((host.strip("[]"), int(port)))
    if not found:
        raise ConfigError(f"a {parts.scheme}:// URL names at least one host:port, got {redact_url(url)!r}")
    return ServerList(
        hosts=found,
        username=unquote(username) or None,
        password=unquote(password) if userinfo and ":" in userinfo else None,
        path=parts.path,
    )


def redis_client(
    url: str, *, socket_timeout_s: float = SOCKET_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S
) -> RedisClient:
    """A client of the Redis at ``url`` (see the module docstring for the schemes); it connects at its first
    command. Raises ``ConfigError`` for a URL that names no Redis."""
    check_redis_url(url)
    timeouts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": connect_timeout_s}
    scheme = scheme_of(url)
    if scheme == SENTINEL_SCHEME:
        return _sentinel_primary(server_list(url), timeouts)
    if scheme == CLUSTER_SCHEME:
        return cluster_client(server_list(url), timeouts)
    try:
        return redis.Redis.from_url(url, **timeouts)
    except ValueError as exc:
        raise ConfigError(f"invalid redis URL {redact_url(url)!r}: {exc}") from exc


def _sentinel_primary(servers: ServerList, timeouts: dict[str, Any]) -> redis.Redis:
    service, _, db = servers.path.strip("/").partition("/")
    if db and not db.isdigit():
        raise ConfigError(f"a Sentinel URL's database is a number, got {db!r}")
    sentinel = redis.sentinel.Sentinel(servers.hosts, sentinel_kwargs=dict(timeouts), **timeouts)
    primary: redis.Redis = sentinel.master_for(
        service, username=servers.username, password=servers.password, db=int(db or 0), **timeouts
    )
    return primary


def cluster_client(servers: ServerList, timeouts: dict[str, Any]) -> redis.cluster.RedisCluster:
    """A cluster client that gives up quickly: a command routed to a failed master waits for the failover at most
    one retry, and the caller treats what still fails as a miss."""
    # redis-py leaves ClusterNode.__init__ unannotated
    nodes = [redis.cluster.ClusterNode(host, port) for host, port in servers.hosts]  # type: ignore[no-untyped-call]
    return redis.cluster.RedisCluster(
        startup_nodes=nodes,
        username=servers.username,
        password=servers.password,
        require_full_coverage=False,
        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
        **timeouts,
    )


def with_password(url: str, password: str) -> str:
    """The URL with its password set to ``password`` (the user name and the rest kept)."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{username}:{password}@{hosts}"))


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and logs."""
    return url if urlsplit(url).password is None else with_password(url, "***")


def public_redis_url(url: str) -> tuple[str, bool]:
    """The Redis URL without its password (its user name kept), and whether one is needed."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, False
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{username}@{hosts}" if username else hosts)), True


def deployment_problem(client: RedisClient, url: str, keyspace: Keyspace) -> str | None:
    """Why the server a ``redis://`` (``rediss://``, ``unix://``) URL names cannot hold the index, naming the URL form
    to use, or None where it can: a Redis Cluster node (every command on another node's slots fails with MOVED), a
    replica (every write is refused) or a Sentinel (it holds no data). Told by what the server answers to a delete
    of a key that does not exist and to reads of keys spread over the slots (``keyspace`` names them), which a
    least-privileged user may send. Sentinel and Cluster URLs find their primaries themselves."""
    if scheme_of(url) in (SENTINEL_SCHEME, CLUSTER_SCHEME) or not isinstance(client, redis.Redis):
        return None
    shown = redact_url(url)
    probe = keyspace.deployment_probe
    try:
        client.delete(probe)
    except redis.exceptions.ReadOnlyError:
        return (
            f"{shown} is a replica, which refuses every write: give its primary, or "
            "redis+sentinel://host:26379[,host:port...]/SERVICE where Sentinel watches it"
        )
    except redis.exceptions.ResponseError as exc:
        if "unknown command" not in str(exc).lower():
            raise
        return (
            f"{shown} is a Redis Sentinel, which holds no data: give "
            "redis+sentinel://[user:password@]host:26379[,host:port...]/SERVICE for the primary it names"
        )
    pipe = client.pipeline(transaction=False)
    for tag in range(CLUSTER_PROBES):
        pipe.exists(keyspace.cluster_probe(tag))
    if any(isinstance(reply, redis.exceptions.MovedError) for reply in pipe.execute(raise_on_error=False)):
        return (
            f"{shown} is a node of a Redis Cluster, where every command on another node's slots fails: give "
            "redis+cluster://[user:password@]host:port[,host:port...]"
        )
    return None
