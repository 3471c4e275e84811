"""The embedded index server: a private ``redis-server`` with AOF persistence under the data dir.

It needs a password, and the commands that could wipe, reconfigure or take over the server are not
allowed to its clients (``CLIENT_ACL``): Redis 7 ACLs, in a ``redis.conf`` written 0600 next to the
AOF and passed as the only argument, so neither the password nor its hash shows in ``ps``.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import redis

from prefixcache.cachestore.host.processes import ManagedProcess, find_executable, free_port
from prefixcache.cachestore.host.secret_files import PRIVATE_FILE_MODE, make_private_dir
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import redis_client, with_password

#: What the embedded server's clients (the daemon, connectors, warm-up jobs, the proxy) may run: everything
#: but Redis 7's ``@dangerous`` commands (FLUSHALL, FLUSHDB, CONFIG, DEBUG, SHUTDOWN, MODULE, SAVE, BGSAVE,
#: BGREWRITEAOF, ACL, REPLICAOF, MIGRATE, MONITOR, KEYS, INFO...), none of which the project calls.
CLIENT_ACL = "~* &* +@all -@dangerous"
CONFIG_FILE = "redis.conf"
#: Every command the project runs on its index (the daemon, connectors, warm-up jobs, the proxy), those its Lua
#: scripts (indexer/lua) call included: tests/test_redis_acl.py runs the index suites and a daemon with only these.
INDEX_USER_COMMANDS = (
    "+ping +time +multi +exec +evalsha +script|load +exists +get +set +incrby +del +unlink +scan +expire +pexpire "
    "+hget +hgetall +hmget +hset +hsetnx +hdel +hincrby +hkeys +hlen +hvals +hrandfield +sadd +srem +smembers "
    "+zadd +zrange +zrem +zmscore +zremrangebyscore +rpush +lpop +blpop +llen "
    "+xadd +xlen +xreadgroup +xack +xgroup|create +xinfo|groups"
)


def index_user_acl(user: str, password: str, key_prefix: str) -> str:
    """The ``user`` line (redis.conf, or ``ACL SETUSER`` without the word ``user``) of a shared index's user for
    the project: only the commands it runs (``INDEX_USER_COMMANDS``), only keys under ``key_prefix``, no channels."""
    return f"user {user} on >{password} resetchannels {Keyspace(key_prefix).acl_pattern} -@all {INDEX_USER_COMMANDS}"


def _acl_password(password: str) -> str:
    """The ACL form of a password that keeps it out of the file: ``#`` and its SHA-256."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


class EmbeddedRedis(ManagedProcess):
    """``redis-server`` bound to loopback, persisting with ``appendfsync everysec`` in ``directory``.

    AOF (not RDB snapshots) so that a restart loses at most a second of index updates; anything
    lost is rebuilt from the NVMe tier when the daemon reconciles on start.

    ``password``: what clients authenticate with (the daemon passes its generated secret; unset: a
    random one for this process's lifetime). ``admin``: also an ``admin`` user allowed every command,
    with a random password only this object knows (``admin_url``), for tests that need one.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        *,
        password: str | None = None,
        admin: bool = False,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.directory = make_private_dir(Path(directory))
        self.password = password or secrets.token_hex(32)
        self._admin_password = secrets.token_hex(32) if admin else None
        self.config_path = self.directory / CONFIG_FILE
        self._write_config()
        argv = [find_executable("redis-server"), str(self.config_path)]
        super().__init__(
            "redis-server", argv, self.directory / "redis.log", self._answers, listens_on=[(host, self.port)]
        )

    def _write_config(self) -> None:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f'dir "{self.directory}"',
            "appendonly yes",
            "appendfsync everysec",
            'save ""',
            "protected-mode yes",
            "daemonize no",
            f"user default on {_acl_password(self.password)} {CLIENT_ACL}",
        ]
        if self._admin_password is not None:
            lines.append(f"user admin on {_acl_password(self._admin_password)} ~* &* +@all")
        tmp = self.config_path.with_name(CONFIG_FILE + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
        with os.fdopen(fd, "w") as f:
            f.write("# written by prefixcache at every start: edits are lost\n" + "\n".join(lines) + "\n")
        os.replace(tmp, self.config_path)

    @property
    def url(self) -> str:
        """The URL clients connect with: it holds the password (``public_redis_url`` takes it out)."""
        return with_password(f"redis://{self.host}:{self.port}/0", self.password)

    @property
    def admin_url(self) -> str:
        if self._admin_password is None:
            raise ValueError("this server has no admin user (EmbeddedRedis(admin=True))")
        return with_password(f"redis://admin@{self.host}:{self.port}/0", self._admin_password)

    def _answers(self) -> bool:
        try:
            with redis_client(self.url, connect_timeout_s=0.2) as client:
                return bool(client.ping())
        except redis.exceptions.RedisError:
            return False
