"""The Mooncake processes a node runs: the master (embedded default) and the segment owner.

The segment owner is a standalone ``mooncake_client`` that contributes this node's DRAM to the pool.
Every local process (vLLM workers, the daemon itself) attaches to it with ``setup_dummy`` and moves
bytes through shared memory at memcpy speed, several times what TCP moves. Because the
owner is a process of its own, objects outlive whichever process put them.

Both listen only on the host they are given: Mooncake binds some of its listeners to the wildcard whatever
its flags say, so each runs with the bind shim (cachestore/tiers/bind_shim.py), through ``mooncake_env``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefixcache.cachestore.host.processes import (
    ManagedProcess,
    ServerStartError,
    find_executable,
    free_port_block,
    port_open,
)
from prefixcache.cachestore.tiers.bind_shim import bind_env, numeric_address
from prefixcache.cachestore.tiers.mooncake_import import mooncake

#: Every Mooncake RPC gives up after this long instead of the library's 30 s default, so a hung
#: master costs a caller at most this once (the tier then fails fast until it answers again).
RPC_TIMEOUT_MS = 3000
#: How long a start waits for the master to forget this node's previous segment owner: the master
#: expires a client it has not heard from for 10 s (its default client TTL).
PREVIOUS_OWNER_WAIT_S = 30.0
#: How often a segment owner fetches again, from the metadata server, the transfer endpoints of the other nodes'
#: segments it has read from (``MC_TE_METADATA_REFRESH_INTERVAL_SECONDS``; a user's value wins). Mooncake
#: otherwise keeps the first endpoints it got for good: a node whose owner restarted (the same segment name, new
#: ports) could never again be read by a node that had read from it before, every such read a failed transfer.
PEER_ENDPOINTS_REFRESH_S = 2
#: The segment owner's RPC threads. Mooncake's default, one, runs a read into an attached process's memory on that
#: thread, so one read stuck on a lost node held every other call of every process of the node for 30 s.
OWNER_RPC_THREADS = 4
#: How long a TCP transfer of the owner may make no progress before it fails (``MC_TCP_PROGRESS_TIMEOUT_SEC``, whole
#: seconds; a user's value wins). Mooncake's 30 s equals an attached process's RPC timeout, which then gave up first,
#: with a -900 that reads as the owner being down, and left the transfer running. And the owner busy-polls a stuck
#: transfer, at its raised priority, on the cores vLLM computes on: a frozen node's first lost read cost the
#: surviving node's recompute 8 s with 5 s here, 1.8 s with 1 s (benchmarks/node_loss.py).
TCP_PROGRESS_TIMEOUT_S = 1
_PACKAGE_DIR = Path(mooncake.__file__).parent
log = logging.getLogger("prefixcache.daemon")


def bound_rpc_timeouts() -> None:
    """Set the RPC timeout the Mooncake client library reads from the environment (a user's value wins)."""
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", str(RPC_TIMEOUT_MS))


def mooncake_env(host: str) -> dict[str, str]:
    """The environment of a Mooncake server that must listen on ``host`` only.

    ``MC_TCP_BIND_ADDRESS`` is the address a transfer engine advertises for its handshake and data ports
    (by default the first non-loopback interface's); the shim makes it the one they are bound to as well.
    """
    bound_rpc_timeouts()
    return {**os.environ, **bind_env(host), "MC_TCP_BIND_ADDRESS": numeric_address(host)}


#: How long a segment owner's start keeps trying while masters in high-availability mode have no leader yet (an
#: owner that finds none exits): an election takes about 10 s after a leader is lost.
LEADER_WAIT_S = 60.0


class MooncakeMaster(ManagedProcess):
    """``mooncake_master`` with its HTTP metadata server, on ``host`` (loopback unless told).

    Given ``etcd_endpoints``, one master of a high-availability group instead: the masters elect a leader in
    etcd (``cluster_id`` names the group there; None: Mooncake's default), the others stand by and replay the
    leader's operation log (``-enable_oplog``), so that the one elected when the leader is lost knows its objects.
    The transfer endpoints are then kept in the same etcd (``metadata_url``), not in a master's HTTP metadata
    server, which would be lost with its master.

    Leases last 2 s, not 10: every read grants one and a leased object can be neither evicted nor
    removed. The master's own eviction starts at 95% so that the daemon's demotion (which keeps the
    NVMe copy and updates the index) normally acts first, and it never takes soft-pinned objects:
    publishers soft-pin new chunks, which exist nowhere else until the write-behind persists them.
    When DRAM is full of unpersisted chunks, puts wait briefly and then fail (the chunk is simply
    not cached) instead of evicting data that would be lost.
    """

    def __init__(
        self,
        log_dir: Path,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        metadata_port: int | None = None,
        metrics_port: int | None = None,
        *,
        etcd_endpoints: Sequence[str] = (),
        cluster_id: str | None = None,
        log_name: str = "mooncake_master.log",
    ) -> None:
        self.host = host
        self.etcd_endpoints = tuple(etcd_endpoints)
        self.cluster_id = cluster_id
        # the ports not given, three distinct ones at once: ports picked one by one may repeat
        given = (rpc_port, metrics_port) if self.etcd_endpoints else (rpc_port, metrics_port, metadata_port)
        base = 0 if all(given) else free_port_block(3, host)
        self.rpc_port = rpc_port or base
        self.metadata_port = None if self.etcd_endpoints else metadata_port or base + 1
        self.metrics_port = metrics_port or base + 2
        if self.etcd_endpoints:
            served = [
                "-enable_ha=true",
                "-ha_backend_type=etcd",
                f"-ha_backend_connstring={';'.join(self.etcd_endpoints)}",
                *([f"-cluster_id={cluster_id}"] if cluster_id else []),
                "-enable_oplog=true",
            ]
        else:
            served = [
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_host={host}",
                f"-http_metadata_server_port={self.metadata_port}",
            ]
        argv = [
            find_executable("mooncake_master", [_PACKAGE_DIR]),
            *served,
            f"-rpc_address={host}",
            f"-rpc_port={self.rpc_port}",
            f"-metrics_host={host}",
            f"-metrics_port={self.metrics_port}",
            "-default_kv_lease_ttl=2000",
            "-eviction_high_watermark_ratio=0.95",
            "-allow_evict_soft_pinned_objects=false",
            "-logtostderr",
        ]
        ports = [port for port in (self.rpc_port, self.metadata_port, self.metrics_port) if port is not None]
        super().__init__(
            "mooncake_master",
            argv,
            Path(log_dir) / log_name,
            self._answers,
            env=mooncake_env(host),
            listens_on=[(host, port) for port in ports],
        )

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        if self.etcd_endpoints:
            return "etcd://" + ";".join(self.etcd_endpoints)
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @property
    def admin_url(self) -> str:
        """The master's HTTP port: ``/metrics``, ``/health`` (with ``role``, ``leader`` or ``standby``, in
        high-availability mode), ``/get_all_segments``."""
        return f"http://{self.host}:{self.metrics_port}"

    def _answers(self) -> bool:
        if self.metadata_port is None:  # a standby serves no RPC: its HTTP port answers once it runs
            return port_open(self.host, self.metrics_port)
        return port_open(self.host, self.rpc_port) and port_open(self.host, self.metadata_port)


def master_health(admin_url: str, timeout_s: float = 1.0) -> dict[str, Any] | str:
    """A master's ``/health`` at its HTTP port ``admin_url``: its answer, or why there was none."""
    try:
        with urllib.request.urlopen(f"{admin_url}/health", timeout=timeout_s) as answer:
            state = json.loads(answer.read())
    except (OSError, ValueError) as exc:
        return str(exc)
    return state if isinstance(state, dict) else f"unexpected answer {state!r}"


def leads(state: dict[str, Any] | str) -> bool:
    """Whether a master whose ``/health`` said ``state`` is the leader of its group, and serving."""
    return isinstance(state, dict) and state.get("role") == "leader" and bool(state.get("service_ready"))


class HaMasters:
    """The masters of a high-availability group, as a node reaches them: by their HTTP ports (``admin_urls``),
    where ``/health`` says which one leads. Only the leader knows the pool's segments and their use."""

    def __init__(self, admin_urls: Sequence[str]) -> None:
        self.admin_urls = list(admin_urls)
        self._leader: str | None = None  # asked first: the leader seldom changes
        self._last_leader: str | None = None
        self.failovers = 0  # times this node found another master leading than the one that led before

    def states(self) -> dict[str, dict[str, Any] | str]:
        """Each master's ``/health`` answer, or why it gave none, by HTTP port."""
        return {url: master_health(url) for url in self.admin_urls}

    def leader(self) -> str | None:
        """The HTTP port of the master that leads and serves; None while none does (an election under way)."""
        if self._leader is not None and leads(master_health(self._leader)):
            return self._leader
        self._leader = next((url for url in self.admin_urls if leads(master_health(url))), None)
        if self._leader is not None:
            self.failovers += self._last_leader not in (None, self._leader)
            self._last_leader = self._leader
        return self._leader

    def metrics_url(self) -> str | None:
        """The leader's ``/metrics`` (None while none leads)."""
        leader = self.leader()
        return f"{leader}/metrics" if leader else None


class SegmentOwner(ManagedProcess):
    """``mooncake_client`` owning ``segment_bytes`` of this node's DRAM under a fixed segment name.

    The fixed name (``host:segment_port``) lets publishers place objects on this node
    (``preferred_segment``). A killed owner leaves its name registered in the metadata server, which
    makes the next start fail, so stale entries are deleted before each start. A master that outlives
    the owner (any master but the daemon's embedded one) also keeps the old owner's segment mounted
    until it expires that client; an owner started before then mounts a name that exists already, and
    the expiry then unmounts it under the new owner, which exits. So a start first waits until the
    master, asked at ``master_admin_url`` (its HTTP port, beside ``/metrics``), no longer lists the name. The
    other nodes' owners learn the new owner's ports within ``PEER_ENDPOINTS_REFRESH_S``.

    With masters in high-availability mode (``master`` is ``etcd://...``, ``cluster_id`` their group's), the owner
    finds the leader in etcd, and follows a new one by itself; ``master_admin_url`` is then a function naming the
    leader's HTTP port, and a start retries, for up to ``LEADER_WAIT_S``, while no master leads yet.
    """

    def __init__(
        self,
        log_dir: Path,
        *,
        segment_bytes: int,
        master: str,
        metadata_url: str,
        host: str = "127.0.0.1",
        segment_port: int | None = None,
        shm_port: int | None = None,
        protocol: str = "tcp",
        device_names: str = "",
        master_admin_url: str | Callable[[], str | None] | None = None,
        nice: int = 0,
        cluster_id: str | None = None,
    ) -> None:
        """``nice``: the owner's CPU priority; it copies every DRAM hit (cachestore/host/cpu_priority.py)."""
        self.master_admin_url = master_admin_url
        self.ha = master.startswith("etcd://")
        self.host = host
        # the ports not given, two distinct ones at once: ports picked one by one may repeat
        base = 0 if segment_port and shm_port else free_port_block(2, host)
        self.segment_port = segment_port or base
        self.shm_port = shm_port or base + 1
        self.metadata_url = metadata_url
        argv = [
            find_executable("mooncake_client", [_PACKAGE_DIR]),
            f"-global_segment_size={segment_bytes // (1 << 20)}MB",
            "-local_buffer_size=0",
            f"-host={self.segment}",
            f"-port={self.shm_port}",
            f"-master_server_address={master}",
            f"-metadata_server={metadata_url}",
            f"-protocol={protocol}",
            f"-device_names={device_names}",
            f"-threads={OWNER_RPC_THREADS}",
            "-logtostderr",
        ]
        env = mooncake_env(host)
        env.setdefault("MC_TE_METADATA_REFRESH_INTERVAL_SECONDS", str(PEER_ENDPOINTS_REFRESH_S))
        env.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(TCP_PROGRESS_TIMEOUT_S))
        if cluster_id:
            env["MC_STORE_CLUSTER_ID"] = cluster_id  # the group whose leader it looks up in etcd
        super().__init__(
            "mooncake_client",
            argv,
            Path(log_dir) / "mooncake_client.log",
            self._answers,
            env=env,
            listens_on=[(host, self.shm_port)],
            nice=nice,
        )

    @property
    def segment(self) -> str:
        """The segment's name in the pool (what ``preferred_segment`` takes)."""
        return f"{self.host}:{self.segment_port}"

    @property
    def shm_address(self) -> str:
        """What local processes pass to ``setup_dummy``."""
        return f"{self.host}:{self.shm_port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self._wait_until_master_forgets_segment()
        self._forget_stale_registration()
        if not self.ha:
            super().start(timeout_s)
            return
        deadline = time.monotonic() + LEADER_WAIT_S
        while True:
            try:
                super().start(timeout_s)
                return
            except ServerStartError as exc:  # most likely no leader yet: the owner exits when it finds none
                if time.monotonic() > deadline:
                    raise
                log.warning("segment owner could not start (%s); trying again until a master leads", exc)
                time.sleep(1.0)

    def _admin_url(self) -> str | None:
        return self.master_admin_url() if callable(self.master_admin_url) else self.master_admin_url

    def _wait_until_master_forgets_segment(self) -> None:
        if self._admin_url() is None or not self._segment_mounted():
            return
        log.info("waiting for the Mooncake master to expire this node's previous segment owner (%s)", self.segment)
        deadline = time.monotonic() + PREVIOUS_OWNER_WAIT_S
        while self._segment_mounted():
            if time.monotonic() > deadline:
                log.warning(
                    "the master still lists segment %s after %.0fs; starting anyway",
                    self.segment,
                    PREVIOUS_OWNER_WAIT_S,
                )
                return
            time.sleep(0.5)

    def _segment_mounted(self) -> bool:
        """Whether the master lists this segment (False when it cannot be asked: nothing to wait for then)."""
        admin_url = self._admin_url()
        if admin_url is None:
            return False
        try:
            with urllib.request.urlopen(f"{admin_url}/get_all_segments", timeout=5) as answer:
                return self.segment in answer.read().decode().split()
        except OSError:
            return False

    def _answers(self) -> bool:
        return port_open(self.host, self.shm_port)

    def _forget_stale_registration(self) -> None:
        if not self.metadata_url.startswith("http"):
            return  # etcd/redis metadata: the operator's tooling owns cleanup
        for kind in ("rpc_meta", "ram"):
            key = urllib.parse.quote(f"mooncake/{kind}/{self.segment}", safe="")
            request = urllib.request.Request(f"{self.metadata_url}?key={key}", method="DELETE")
            with contextlib.suppress(urllib.error.HTTPError):  # nothing registered under that name: the normal case
                urllib.request.urlopen(request, timeout=5).close()
