"""This node's heartbeat in the index (indexer/peers.py): while it beats, every client reads from this node; once
it stops (the daemon stopped, crashed, frozen, or cut off from the index), every client skips it within about a
second, and a daemon that stops says so on its way out."""

from __future__ import annotations

import logging
from contextlib import suppress

from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.peers import HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, PeerRegistry

log = logging.getLogger("prefixcache.daemon")


class Heartbeat(BackgroundLoop):
    """Beats every ``interval_s`` on a thread of its own, so that a busy event loop or service never lets it lapse."""

    name = "prefixcache-heartbeat"
    retry_pause_s = HEARTBEAT_INTERVAL_S  # a failed beat (the index unreachable) is tried again at the next beat

    def __init__(
        self,
        registry: PeerRegistry,
        node: str,
        *,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        ttl_s: float = HEARTBEAT_TTL_S,
    ) -> None:
        super().__init__()
        self._registry = registry
        self._node = node
        self._interval_s = interval_s
        self._ttl_s = ttl_s

    def step(self) -> None:
        self._registry.beat(self._node, self._ttl_s)
        self.pause(self._interval_s)

    def stop(self) -> None:
        super().stop()
        with suppress(IndexUnavailableError):
            self._registry.leave(self._node)
            log.info("node %s left the cluster's table of peers", self._node)
