"""The node daemon behind ``prefixcache serve``: starts what is embedded, serves the API, stops cleanly."""

from __future__ import annotations

import logging
import signal
import sys
from contextlib import ExitStack

import uvicorn

from cachestore.api import ClientConfig, ComponentHealth, create_app, public_redis_url
from cachestore.redis_server import EmbeddedRedis
from cachestore.settings import Settings
from indexer.errors import IndexUnavailableError
from indexer.redis_index import RedisIndex

log = logging.getLogger("prefixcache.daemon")


class NodeDaemon:
    """Owns this node's servers and index connection for the daemon's lifetime."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stack = ExitStack()
        self.index: RedisIndex | None = None

    def start(self) -> None:
        s = self.settings
        redis_url = s.redis_url
        if s.embedded_redis:
            server = EmbeddedRedis(s.data_dir / "redis", port=s.redis_port)
            server.start()
            self._stack.callback(server.stop)
            redis_url = server.url
            log.info("embedded redis-server ready at %s (AOF in %s)", redis_url, server.directory)
        assert redis_url is not None
        self.index = RedisIndex(redis_url, key_prefix=s.key_prefix)
        self._stack.callback(self.index.close)
        self.index.ping()
        log.info("index ready at %s", public_redis_url(redis_url)[0])

    def stop(self) -> None:
        self._stack.close()

    def client_config(self) -> ClientConfig:
        assert self.index is not None
        url, needs_password = public_redis_url(self.index.url)
        return ClientConfig(
            node=self.settings.node,
            redis_url=url,
            redis_password_required=needs_password,
            key_prefix=self.settings.key_prefix,
            chunk_tokens=self.settings.chunk_tokens,
        )

    def _index_health(self) -> ComponentHealth:
        try:
            assert self.index is not None
            self.index.ping()
            return ComponentHealth(ok=True, detail="answering")
        except IndexUnavailableError as exc:
            return ComponentHealth(ok=False, detail=str(exc))

    def serve(self) -> None:
        """Start everything, serve until SIGINT/SIGTERM, then stop everything.

        uvicorn re-raises the signal that stopped it; SIGTERM's default action would end the process
        before the child servers are stopped, so it is turned into SystemExit like SIGINT's
        KeyboardInterrupt.
        """
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            self.start()
            app = create_app(self.client_config(), {"redis": self._index_health})
            s = self.settings
            log.info("prefixcache serving on http://%s:%d (node %s)", s.host, s.port, s.node)
            uvicorn.run(app, host=s.host, port=s.port, log_level="warning")
        finally:
            self.stop()
            log.info("prefixcache stopped")
