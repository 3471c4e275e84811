"""The embedded index server: a private ``redis-server`` with AOF persistence under the data dir."""

from __future__ import annotations

from pathlib import Path

import redis

from cachestore.processes import ManagedProcess, find_executable, free_port
from indexer.redis_clients import redis_client


class EmbeddedRedis(ManagedProcess):
    """``redis-server`` bound to loopback, persisting with ``appendfsync everysec`` in ``directory``.

    AOF (not RDB snapshots) so that a restart loses at most a second of index updates; anything
    lost is rebuilt from the NVMe tier when the daemon reconciles on start.
    """

    def __init__(self, directory: Path, port: int | None = None, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        argv = [
            find_executable("redis-server"),
            "--bind", host,
            "--port", str(self.port),
            "--dir", str(self.directory),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--protected-mode", "yes",
            "--daemonize", "no",
        ]  # fmt: skip
        super().__init__("redis-server", argv, self.directory / "redis.log", self._answers,
                         listens_on=[(host, self.port)])  # fmt: skip

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _answers(self) -> bool:
        try:
            return bool(redis_client(self.url, connect_timeout_s=0.2).ping())
        except redis.exceptions.RedisError:
            return False
