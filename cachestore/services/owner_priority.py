"""The segment owner gives up its raised priority while another node is lost, so that its busy polling does not
starve the engine core it shares the reserved cores with.

The owner runs at a raised priority (``owner_nice``, cachestore/host/cpu_priority.py) because it copies every DRAM
hit while the step waits. But a read of another node's DRAM that the link or the node leaves hanging is polled by
one of the owner's RPC threads without pause until Mooncake gives up on it: up to 20 s after a cable is pulled and
up to 60 s behind a slow link, whatever the read's caller abandoned meanwhile (Mooncake cannot cancel a transfer).
At nice -10 such threads take the reserved cores from vLLM's engine core, and every request of the node, hits and
recomputes alike, waits: in ``benchmarks.node_loss``, requests that loaded nothing took a second more than their cold
recompute for as long as the spin lasted.

So while the table of peers (indexer/peers.py) shows another node down, and for ``CALM_HOLD_S`` after, the owner
runs at the default priority; then it gets its own back. A node that left on purpose is not lost: nothing reads
from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prefixcache.cachestore.host.cpu_priority import set_process_nice
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.peers import VIEW_REFRESH_S, PeerRegistry

log = logging.getLogger("prefixcache.daemon")

#: How long after the last sight of a lost node the owner stays at the default priority: Mooncake's store waits
#: at most 60 s on a transfer.
CALM_HOLD_S = 60.0
#: The priority the owner runs at meanwhile.
CALM_NICE = 0


class OwnerPriority(BackgroundLoop):
    """Every ``VIEW_REFRESH_S``, the owner's nice: ``raised`` normally, ``CALM_NICE`` while a peer is lost."""

    name = "prefixcache-owner-priority"
    retry_pause_s = VIEW_REFRESH_S

    def __init__(
        self,
        registry: PeerRegistry,
        node: str,
        owner_pid: Callable[[], int | None],
        raised: int,
        *,
        hold_s: float = CALM_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._registry = registry
        self._node = node
        self._owner_pid = owner_pid
        self._raised = raised
        self._hold_s = hold_s
        self._clock = clock
        self._lost_seen = -float("inf")
        self._applied: tuple[int, int] | None = None  # (pid, nice) set last

    def step(self) -> None:
        table = self._registry.read()
        if table.down - table.left - {self._node}:
            self._lost_seen = self._clock()
        calm = self._clock() - self._lost_seen < self._hold_s
        nice = CALM_NICE if calm else self._raised
        pid = self._owner_pid()
        if pid is not None and self._applied != (pid, nice):
            # an owner (re)started runs at ``raised`` by itself: only one this loop calmed is raised again
            if calm or self._applied == (pid, CALM_NICE):
                set_process_nice(pid, nice)
                log.info("segment owner at nice %d: %s", nice, "a peer is lost" if calm else "no peer lost lately")
            self._applied = (pid, nice)
        self.pause(VIEW_REFRESH_S)
