"""The node daemon behind ``prefixcache serve``.

It owns this node's share of the cache: the Mooncake segment (through a standalone segment owner),
the NVMe tier, and the services that keep them and the index consistent (write-behind, promotion,
demotion). With no external addresses it also runs the index (redis-server) and the Mooncake master.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import signal
import stat
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import uvicorn
from pydantic import SecretStr

from prefixcache.cachestore.api.admin_routes import admin_routers
from prefixcache.cachestore.api.app import (
    ComponentHealth,
    EvictionStats,
    ObjectStats,
    PeerStats,
    QueueDepths,
    Stats,
    TierStats,
    WriteBehindStats,
    create_app,
)
from prefixcache.cachestore.api.auth import AccessPolicy, admin_token_path
from prefixcache.cachestore.api.http_guards import trusted_hosts
from prefixcache.cachestore.api.liveness import liveness_router
from prefixcache.cachestore.api.metrics import metrics_router
from prefixcache.cachestore.api.quota_routes import quota, quota_router
from prefixcache.cachestore.api.stats_report import all_client_stats, corrupt_by_reason, namespace_stats
from prefixcache.cachestore.api.warmup_routes import warmup_router
from prefixcache.cachestore.chunks.mac import KEY_FILE_NAME, ChunkMacKey
from prefixcache.cachestore.client.client_stats import ClientStatsRecord, read_client_stats
from prefixcache.cachestore.client.config import ClientConfig, MooncakeConfig, SecretFiles
from prefixcache.cachestore.host.cpus import allowed_cpus
from prefixcache.cachestore.host.listeners import check_listeners
from prefixcache.cachestore.host.processes import ManagedProcess, port_open
from prefixcache.cachestore.host.secret_files import PRIVATE_UMASK, load_or_create_secret, make_private_dir, secrets_dir
from prefixcache.cachestore.node.data_dir_lock import DataDirLock
from prefixcache.cachestore.node.node_parts import BucketParts, MooncakeParts, NodeParts, NodeSecrets, master_admin_url
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.cachestore.node.settings import NVME_PACK_FILE_BYTES, Settings, redis_password_from_environment
from prefixcache.cachestore.node.supervisor import Supervisor
from prefixcache.cachestore.services.bucket_reconcile import BucketLimits, BucketReconciler
from prefixcache.cachestore.services.cache_admin import CacheAdmin
from prefixcache.cachestore.services.demotion import Demoter
from prefixcache.cachestore.services.eviction import Evictor
from prefixcache.cachestore.services.eviction_orders import EvictionOrders, OrderServer
from prefixcache.cachestore.services.heartbeat import Heartbeat
from prefixcache.cachestore.services.kv_events import KvEventPublisher
from prefixcache.cachestore.services.nvme_extents import ExtentServer
from prefixcache.cachestore.services.object_write_behind import GROUP as OBJECT_GROUP
from prefixcache.cachestore.services.object_write_behind import ObjectWriteBehind
from prefixcache.cachestore.services.owner_priority import CALM_NICE, OwnerPriority
from prefixcache.cachestore.services.promotion import Promoter
from prefixcache.cachestore.services.quotas import QuotaEnforcer
from prefixcache.cachestore.services.reconcile import reconcile
from prefixcache.cachestore.services.write_behind import GROUP as WRITE_BEHIND_GROUP
from prefixcache.cachestore.services.write_behind import WriteBehind
from prefixcache.cachestore.tiers.dram import MooncakeTier
from prefixcache.cachestore.tiers.mooncake_servers import HaMasters, MooncakeMaster, SegmentOwner, leads
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.tiers.usage import TierUsage
from prefixcache.cachestore.warmup.jobs import WarmupJobs, local_url
from prefixcache.cachestore.warmup.policy import WarmupPolicy
from prefixcache.indexer.background_loop import BackgroundLoop
from prefixcache.indexer.errors import ConfigError, IndexUnavailableError
from prefixcache.indexer.index import Location, NamespaceUsage
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.peers import HEARTBEAT_TTL_S, PeerRegistry, PeerTable
from prefixcache.indexer.quotas import NO_TENANT, QuotaStore
from prefixcache.indexer.redis_clients import WAITING_SOCKET_TIMEOUT_S, RedisClient, public_redis_url, redis_client
from prefixcache.indexer.redis_index import RedisIndex

if TYPE_CHECKING:  # the object extra's: imported where a bucket is set (``_open_bucket``)
    from prefixcache.cachestore.tiers.object_store import ObjectTier

log = logging.getLogger("prefixcache.daemon")
#: The embedded redis-server's password, under ``secrets_dir(data_dir)``.
REDIS_PASSWORD_FILE = "redis-password"
#: What the daemon keeps under its data dir (besides the NVMe tier), made private at each start.
PRIVATE_SUBDIRS = ("redis", "logs", "warmup", "secrets")
DAEMON_ARENA_BYTES = 256 << 20
WARMUP_OBJECT_BYTES = 8 << 20
#: The health component that reports each server the daemon supervises.
SERVER_OF_COMPONENT = {"redis": "redis-server", "mooncake_master": "mooncake_master", "dram": "mooncake_client"}


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _make_private(directory: Path) -> None:
    """``directory`` (created if missing) and everything under it the daemon's user's alone (0700 directories,
    files without group or other bits): what an older build left, or a directory someone else created."""
    try:
        make_private_dir(directory)
        for root, dirs, files in os.walk(directory):
            for name in dirs:
                make_private_dir(Path(root, name))
            for name in files:
                path = Path(root, name)
                mode = path.lstat().st_mode
                if stat.S_ISREG(mode) and mode & 0o077:
                    os.chmod(path, stat.S_IMODE(mode) & ~0o077)
    except OSError as exc:
        log.warning("cannot make %s private to this user (%s): other users may read its chunks", directory, exc)


def peers_health(table: PeerTable, node: str) -> ComponentHealth:
    """The health of the cluster's other nodes as ``node`` sees them in ``table``: degraded while one that did not
    stop on purpose is down, since the chunks only it holds are recomputed meanwhile."""
    others = table.others(node)
    lost = [
        f"{peer} (marked suspect)"
        if peer in table.suspect
        else f"{peer} (no heartbeat for {(table.now_ms - table.beats[peer]) / 1000 + HEARTBEAT_TTL_S:.1f} s)"
        for peer in others
        if peer in table.down and peer not in table.left
    ]
    parts = [f"{len([peer for peer in others if peer in table.alive])} other node(s) answering"]
    if stopped := [peer for peer in others if peer in table.left]:
        parts.append(f"stopped: {', '.join(stopped)}")
    if not lost:
        return ComponentHealth(ok=True, detail="; ".join(parts))
    parts.insert(0, f"unreachable: {', '.join(lost)}; their chunks are recomputed")
    return ComponentHealth(ok=True, degraded=True, detail="; ".join(parts))


def _protected(index: RedisIndex, leases: Leases, keys: Sequence[bytes]) -> list[bool]:
    """Chunks capacity pressure must not move: pinned by an operator, or leased to a scheduler."""
    try:
        now = index.clock_s()  # pins are deadlines in the index's clock
        pinned = [e is not None and e.pinned(now) for e in index.get(keys)]
        return [p or leased for p, leased in zip(pinned, leases.held(keys), strict=True)]
    except IndexUnavailableError:
        return [True] * len(keys)  # cannot tell: move nothing rather than a protected chunk


def _forget_dram(write_behind: WriteBehind) -> None:
    """DRAM copies went with a dead segment owner or master: drop their locations, as a start does."""
    log.warning("dropped the DRAM locations of %d chunks of this node", write_behind.forget_resident())


def _warm_segment(dram: MooncakeTier, dram_bytes: int) -> None:
    """Touch the new segment's pages once: first writes to fresh shared memory run several times slower."""
    started = time.monotonic()
    slot = dram.arena.alloc(WARMUP_OBJECT_BYTES)
    count = int(dram_bytes * 0.8) // WARMUP_OBJECT_BYTES
    keys = [f"warmup-{i}".encode().ljust(16, b"\0")[:16] for i in range(count)]
    try:
        for start in range(0, count, 32):
            dram.put([(k, slot) for k in keys[start : start + 32]])
        dram.delete(keys)
    finally:
        dram.arena.free(slot)
    log.info("DRAM segment warmed in %.1fs", time.monotonic() - started)


def _restart_owner(owner: SegmentOwner) -> None:
    """Kill the segment owner that dropped this daemon's attachment and would not take it back: the supervisor
    restarts it, and Mooncake's reconnection registers the daemon's memory with the new one (every attached
    worker's too). The DRAM copies go with the old owner; NVMe keeps the persisted ones."""
    log.error("restarting the Mooncake segment owner to attach again: DRAM copies are lost, NVMe keeps persisted ones")
    owner.kill()


class LeaderMetricsTier(MooncakeTier):
    """The DRAM tier of a node whose masters run in high-availability mode: its use is read from the ``/metrics``
    of whichever master leads (a standby knows no segments)."""

    def __init__(self, shm_address: str, masters: HaMasters, **options: Any) -> None:
        super().__init__(shm_address, **options)
        self.masters = masters

    def usage(self) -> TierUsage:
        self._metrics_url = self.masters.metrics_url()
        return super().usage()


class NodeDaemon:
    """Owns this node's servers, tiers and services for the daemon's lifetime."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stack = ExitStack()
        #: what ``start`` built, all of it or nothing
        self._parts: NodeParts | None = None
        self.nvme_evicted = 0
        self._services: list[BackgroundLoop] = []  # asked to stop together before each is joined
        self.supervisor = Supervisor()

    @property
    def parts(self) -> NodeParts:
        """The started node's index, tiers and services."""
        if self._parts is None:
            raise RuntimeError("the node daemon is not started")
        return self._parts

    def start(self) -> None:
        self._parts = self._build()

    def _build(self) -> NodeParts:
        """Start the node's servers, tiers and services, in order; each is stopped (in reverse) by ``stop``."""
        s = self.settings
        # before anything is created: every file the daemon and its children (redis-server, Mooncake, warm-up
        # jobs) write is the daemon's user's alone, as are the data dir and the NVMe tier
        os.umask(PRIVATE_UMASK)
        # before anything starts: a second daemon on this data dir or this NVMe tier must change nothing
        for lock in (DataDirLock(s.data_dir), DataDirLock(s.nvme_path, "NVMe tier dir", "--nvme-dir")):
            lock.acquire(s.port)
            self._stack.callback(lock.release)
        make_private_dir(s.data_dir)
        for directory in (s.nvme_path, *(s.data_dir / name for name in PRIVATE_SUBDIRS)):
            _make_private(directory)
        admin_token, admin_token_file = self._load_admin_token()
        # asked to stop first (no restart while stopping), joined last: after the servers it may have restarted
        self._services.append(self.supervisor)
        self._stack.callback(self.supervisor.stop)
        engine_cpus = None  # where warm-up engines run: unbound, as the daemon
        if s.cpu_set is not None:
            engine_cpus = allowed_cpus()  # warm-up engines are vLLM engines: they keep the cores the daemon had
            # before any thread or server starts: each inherits the binding
            os.sched_setaffinity(0, s.cpu_set)
            log.info("daemon and its servers bound to CPUs %s", s.cpus)
        mac_key_file, mac_key = self._load_mac_key()
        secrets = NodeSecrets(mac_key, mac_key_file, admin_token, admin_token_file)
        index = self._start_index()
        keys = index.keyspace
        leases = Leases(redis_client(index.url), keys)
        protected = functools.partial(_protected, index, leases)
        mooncake = self._start_mooncake()
        dram = mooncake.dram
        nvme = NvmeTier(
            s.nvme_path,
            s.nvme_bytes,
            pack_file_bytes=NVME_PACK_FILE_BYTES,
            is_pinned=protected,
            on_evict=functools.partial(self._evicted, index),
        )
        self._stack.callback(nvme.close)
        # The segment owner starts empty every time, so DRAM locations naming this node are stale.
        reconcile(index, nvme, s.node, dram_is_new=True)
        write_behind = WriteBehind(index, dram, nvme, s.node, hold_s=s.write_behind_hold_s, mac_key=mac_key)
        for server in mooncake.servers:  # the supervisor starts at the end of this start
            self.supervisor.watch(server, before_restart=functools.partial(_forget_dram, write_behind))
        bucket = self._open_bucket(mac_key)
        promoter = Promoter(self._waiting_redis(index), keys, index, dram, nvme, s.node, mac_key=mac_key, bucket=bucket)
        extents = ExtentServer(self._waiting_redis(index), keys, nvme, s.node)
        bucket_parts = None
        if bucket is not None:
            bucket_parts = BucketParts(bucket, ObjectWriteBehind(index, nvme, bucket, s.node))
            self._start_service(bucket_parts.copies)
            # what the bucket holds and the index lost (a flushed Redis, a lost node's registrations)
            limits = BucketLimits(
                None if s.object_store_bytes is None else int(s.object_store_bytes), s.object_store_max_age_s
            )
            self._start_service(BucketReconciler(index, bucket, s.node, limits=limits, is_protected=protected))
        demoter = Demoter(index, dram, write_behind, s.node, protected, s.dram_high_watermark, s.dram_low_watermark)
        write_behind.on_persisted = demoter.poke
        for service in (write_behind, promoter, extents, demoter):
            self._start_service(service)
        if s.kv_events_endpoint:
            self._start_service(
                KvEventPublisher(
                    index.url,
                    keys,
                    s.node,
                    s.kv_events_endpoint,
                    s.kv_events_topic,
                    block_size=s.chunk_tokens,
                    replay_endpoint=s.kv_events_replay_endpoint,
                )
            )
            log.info("publishing KV events on %s", s.kv_events_endpoint)
        evictor = Evictor(index, dram, nvme, s.node, EvictionOrders(self._waiting_redis(index), keys), bucket=bucket)
        # after reconcile: orders queued while this node was down remove copies the index still names
        orders = OrderServer(
            self._waiting_redis(index), keys, s.node, index, lambda entries: evictor.evict_here(entries).removed
        )
        self._start_service(orders)
        quotas = QuotaEnforcer(
            index,
            QuotaStore(redis_client(index.url), keys),
            evictor,
            s.node,
            protected,
            configured=s.quotas,
            default_tenant_bytes=None if s.default_tenant_quota is None else int(s.default_tenant_quota),
            low=s.quota_low_watermark,
            scan_entries=s.quota_scan_entries,
        )
        self._start_service(quotas)
        policy = WarmupPolicy(tuple(s.warmup_roots), s.warmup_allow_trust_remote_code)
        warmup_jobs = WarmupJobs(
            s.data_dir / "warmup" / "jobs",
            local_url(s.host, s.port),
            s.data_dir / "warmup",
            engine_cpus=engine_cpus,
            policy=policy,
            redis_password=self._redis_password(index),
        )
        warmup_jobs.start()
        self._stack.callback(warmup_jobs.stop)
        self.supervisor.start()
        # last: other nodes read from this one once it beats, and the first thing stopped says it has left
        peers = PeerRegistry(redis_client(index.url), keys)
        self._start_service(Heartbeat(peers, s.node))
        if s.owner_nice < CALM_NICE:  # the owner yields its raised priority while a peer is lost
            owner = mooncake.owner
            self._start_service(OwnerPriority(peers, s.node, lambda: owner.pid, s.owner_nice))
        return NodeParts(
            secrets=secrets,
            index=index,
            leases=leases,
            mooncake=mooncake,
            nvme=nvme,
            bucket=bucket_parts,
            write_behind=write_behind,
            promoter=promoter,
            extents=extents,
            demoter=demoter,
            evictor=evictor,
            orders=orders,
            quotas=quotas,
            admin=CacheAdmin(index, evictor),
            warmup_jobs=warmup_jobs,
            peers=peers,
        )

    def _load_mac_key(self) -> tuple[Path, ChunkMacKey]:
        """The cluster's chunk-signing key and its file: the operator's, or this node's own, generated at first
        start."""
        s = self.settings
        if s.chunk_key_file is not None:
            return s.chunk_key_file.absolute(), ChunkMacKey.read(s.chunk_key_file)
        path = (secrets_dir(s.data_dir) / KEY_FILE_NAME).absolute()
        mac_key = ChunkMacKey.load_or_create(path)
        if not (s.embedded_redis and s.embedded_mooncake):
            log.warning(
                "this node signs chunks with a key of its own (%s): other nodes can use its chunks only if "
                "every node is given the same PREFIXCACHE_CHUNK_KEY_FILE",
                path,
            )
        return path, mac_key

    def _load_admin_token(self) -> tuple[SecretStr, Path | None]:
        """The operator's token, or the one generated at this data dir's first start (kept, 0600, for the CLI),
        with that file."""
        if self.settings.admin_token is not None:
            return self.settings.admin_token, None
        path = admin_token_path(secrets_dir(self.settings.data_dir))
        token = SecretStr(load_or_create_secret(path))
        log.info(
            "admin token in %s (readable by this user only; `prefixcache stats` and the other admin commands "
            "read it from there)",
            path,
        )
        return token, path.absolute()

    @staticmethod
    def _redis_password(index: RedisIndex) -> str | None:
        """The index's password, for warm-up children (on their stdin): from the URL, else the environment."""
        return urlsplit(index.url).password or redis_password_from_environment()

    def _start_service(self, service: BackgroundLoop) -> None:
        service.start()
        self._services.append(service)
        self._stack.callback(service.stop)

    def _start_index(self) -> RedisIndex:
        s = self.settings
        redis_url = s.redis_url
        if redis_url is None:
            password = load_or_create_secret(self.redis_password_file)
            server = EmbeddedRedis(s.data_dir / "redis", port=s.derived_port("redis_port"), password=password)
            server.start()
            self._stack.callback(server.stop)
            self.supervisor.watch(server)  # redis-py clients reconnect by themselves; Redis replays its AOF
            redis_url = server.url
            log.info(
                "embedded redis-server ready at %s (AOF in %s; password in %s)",
                public_redis_url(redis_url)[0],
                server.directory,
                self.redis_password_file,
            )
        index = RedisIndex(redis_url, key_prefix=s.key_prefix)
        self._stack.callback(index.close)
        index.ping()
        if problem := index.deployment_problem():
            raise ConfigError(f"the index cannot live there: {problem}")
        log.info("index ready at %s", public_redis_url(redis_url)[0])
        return index

    @property
    def redis_password_file(self) -> Path:
        return (secrets_dir(self.settings.data_dir) / REDIS_PASSWORD_FILE).absolute()

    @staticmethod
    def _waiting_redis(index: RedisIndex) -> RedisClient:
        """A connection of the index's Redis for a service that waits on queues (``BLPOP``)."""
        return redis_client(index.url, socket_timeout_s=WAITING_SOCKET_TIMEOUT_S)

    def _start_mooncake(self) -> MooncakeParts:
        s = self.settings
        logs = s.data_dir / "logs"
        servers: list[ManagedProcess] = []
        metrics_url: str | None = None
        ha_masters: HaMasters | None = None
        if s.embedded_mooncake:
            master = MooncakeMaster(
                logs,
                rpc_port=s.derived_port("master_port"),
                metadata_port=s.derived_port("metadata_port"),
                metrics_port=s.derived_port("metrics_port"),
            )
            master.start()
            self._stack.callback(master.stop)
            # a new master knows no objects (the owner mounts its segment on it again by itself)
            servers.append(master)
            master_address, metadata_url = master.address, master.metadata_url
            metrics_url = f"http://{master.host}:{master.metrics_port}/metrics"
            log.info("embedded mooncake_master ready at %s", master.address)
        elif (ha := s.mooncake_ha) is not None:
            # the owner finds the leader in etcd; the transfer endpoints are kept there too unless told otherwise
            master_address, metadata_url = ha.address, s.mooncake_metadata_url or ha.address
            ha_masters = HaMasters([url.removesuffix("/metrics") for url in s.mooncake_metrics_urls])
            log.info("Mooncake masters in high-availability mode, found through %s", s.mooncake_master)
            if not s.mooncake_metrics_urls:
                log.warning(
                    "PREFIXCACHE_MOONCAKE_METRICS_URL is not set (every master's, comma-separated): demotion cannot "
                    "see this node's DRAM use, and /v1/health cannot tell which master leads"
                )
        else:
            assert s.mooncake_master and s.mooncake_metadata_url
            master_address, metadata_url = s.mooncake_master, s.mooncake_metadata_url
            metrics_url = s.mooncake_metrics_url
            if metrics_url is None:
                log.warning(
                    "PREFIXCACHE_MOONCAKE_METRICS_URL is not set: demotion cannot see this node's "
                    "DRAM use, and a restart cannot wait for the master to forget its old segment owner"
                )
        owner = SegmentOwner(
            logs,
            segment_bytes=s.dram_bytes,
            master=master_address,
            metadata_url=metadata_url,
            host=s.mooncake_host,
            segment_port=s.derived_port("segment_port"),
            shm_port=s.derived_port("shm_port"),
            protocol=s.mooncake_protocol,
            device_names=s.mooncake_device_names,
            master_admin_url=ha_masters.leader if ha_masters else master_admin_url(metrics_url),
            nice=s.owner_nice,
            cluster_id=s.mooncake_ha.cluster_id if s.mooncake_ha else None,
        )
        owner.start()
        self._stack.callback(owner.stop)
        # a new owner starts empty; attached tiers (this daemon's too) re-register their memory with it by themselves
        servers.append(owner)
        options: dict[str, Any] = {
            "arena_bytes": DAEMON_ARENA_BYTES,
            "object_prefix": s.key_prefix,
            "preferred_segment": owner.segment,
            "on_unrepaired": functools.partial(_restart_owner, owner),
        }
        dram: MooncakeTier
        if ha_masters is None:
            dram = MooncakeTier(owner.shm_address, metrics_url=metrics_url, **options)
        else:
            dram = LeaderMetricsTier(owner.shm_address, ha_masters, **options)
        self._stack.callback(dram.close)
        _warm_segment(dram, s.dram_bytes)
        log.info(
            "DRAM segment %s (%d MiB) ready; clients attach at %s", owner.segment, s.dram_bytes >> 20, owner.shm_address
        )
        return MooncakeParts(master_address, metadata_url, metrics_url, ha_masters, owner, dram, tuple(servers))

    def _evicted(self, index: RedisIndex, keys: list[bytes]) -> None:
        self.nvme_evicted += len(keys)
        index.drop_location(keys, Location("nvme", self.settings.node))

    def stop(self) -> None:
        for service in self._services:
            service.request_stop()
        self._stack.close()

    def client_config(self) -> ClientConfig:
        p, s = self.parts, self.settings
        url, needs_password = public_redis_url(p.index.url)
        return ClientConfig(
            node=s.node,
            redis_url=url,
            redis_password_required=needs_password,
            key_prefix=s.key_prefix,
            chunk_tokens=s.chunk_tokens,
            mooncake=MooncakeConfig(
                master=p.mooncake.master_address,
                metadata_url=p.mooncake.metadata_url,
                protocol=s.mooncake_protocol,
                device_names=s.mooncake_device_names,
                shm_address=p.mooncake.owner.shm_address,
                segment=p.mooncake.owner.segment,
            ),
            secret_files=SecretFiles(
                chunk_key=str(p.secrets.mac_key_file),
                redis_password=str(self.redis_password_file) if s.embedded_redis else None,
                admin_token=str(p.secrets.admin_token_file) if p.secrets.admin_token_file else None,
            ),
        )

    def stats(self) -> Stats:
        p = self.parts
        dram, nvme, wb = p.mooncake.dram.usage(), p.nvme.usage(), p.write_behind.stats
        client_stats = self.client_stats()
        clients = all_client_stats(client_stats)
        delays = sorted(wb.delays_s) or [0.0]
        usage, tenants = p.index.usage(), p.index.tenant_usage()  # read once for the figures and the quotas
        refused = [wb.corrupt, p.promoter.corrupt, *([p.bucket.tier.rejected] if p.bucket is not None else [])]
        return Stats(
            node=self.settings.node,
            dram=TierStats(
                bytes_used=dram.bytes_used, capacity_bytes=dram.capacity_bytes, chunks=len(p.write_behind.resident)
            ),
            nvme=TierStats(bytes_used=nvme.bytes_used, capacity_bytes=nvme.capacity_bytes, chunks=nvme.chunks),
            write_behind=WriteBehindStats(
                persisted=wb.persisted,
                corrupt=wb.corrupt.total,
                vanished=wb.vanished,
                delay_p50_s=delays[len(delays) // 2],
                delay_p99_s=delays[min(len(delays) - 1, len(delays) * 99 // 100)],
                delay_max_s=wb.max_delay_s,
            ),
            promoted=p.promoter.promoted,
            promotion_failures=p.promoter.failed,
            demoted=p.demoter.demoted,
            evictions=EvictionStats(
                requested_chunks=p.evictor.evicted_chunks,
                requested_bytes=p.evictor.evicted_bytes,
                nvme_capacity=self.nvme_evicted,
                dram_demoted=p.demoter.demoted,
            ),
            corrupt_chunks=sum(counts.total for counts in refused) + clients.corrupt_chunks,
            corrupt_by_reason=corrupt_by_reason(clients, *refused),
            persist_failures={str(reason): n for reason, n in wb.failures.counts.items()},
            queues=QueueDepths(
                promotion=p.promoter.client.llen(p.promoter.queue),
                write_behind=p.index.feed_backlog(self.settings.node, WRITE_BEHIND_GROUP),
                eviction_orders=p.orders.client.llen(p.orders.queue),
            ),
            clients=clients,
            namespaces=namespace_stats(usage, client_stats),
            tenants={t or NO_TENANT: u for t, u in tenants.items()},
            quotas=[quota(state) for state in p.quotas.states(usage, tenants)],
            child_restarts=self.supervisor.restarts,
            peers=self._peer_stats(),
            master_failovers=p.mooncake.ha_masters.failovers if p.mooncake.ha_masters else 0,
            object_store=self._object_stats(p.bucket, usage) if p.bucket is not None else None,
        )

    def _object_stats(self, bucket: BucketParts, usage: dict[bytes, NamespaceUsage]) -> ObjectStats:
        """The bucket's chunks from the index's counters (no listing of the bucket), and this node's copies."""
        held = [u.tiers["object"] for u in usage.values() if "object" in u.tiers]
        copies, tier = bucket.copies, bucket.tier
        return ObjectStats(
            chunks=sum(u.chunks for u in held),
            bytes=sum(u.bytes for u in held),
            copied=copies.copied,
            backlog=self.parts.index.feed_backlog(self.settings.node, OBJECT_GROUP),
            copy_failures={reason: n for reason, n in copies.failures.counts.items()},
            rejected=tier.rejected.total,
            late_reads=tier.late_reads,
            reachable=tier.available,
        )

    def _peer_stats(self) -> dict[str, PeerStats]:
        """The other nodes as the table of peers has them (none while the index does not answer)."""
        try:
            table = self.parts.peers.read()
        except IndexUnavailableError:
            return {}
        return {
            peer: PeerStats(down=peer in table.down, stopped=peer in table.left, suspect_marks=table.marks.get(peer, 0))
            for peer in table.others(self.settings.node)
        }

    def client_stats(self) -> dict[bytes, ClientStatsRecord]:
        """The client stats of this node (what clients attached to it recorded), per namespace."""
        return read_client_stats(self.parts.promoter.client, self.parts.index.keyspace, self.settings.node)

    def _open_bucket(self, mac_key: ChunkMacKey) -> ObjectTier | None:
        """The object tier, when ``object_store_url`` names one (imported only then: it needs the ``object`` extra);
        its objects are sealed with a key derived from the chunk-signing key."""
        s = self.settings
        if s.object_store_url is None:
            return None
        try:
            from prefixcache.cachestore.chunks.seal import ChunkSealer
            from prefixcache.cachestore.tiers.object_store import ObjectStoreAddress, ObjectTier
        except ImportError as exc:
            missing = (exc.name or "a module").split(".")[0]
            raise ConfigError(
                f"object_store_url needs the object extra: pip install 'prefixcache[object]' ({missing} is missing)"
            ) from exc

        address = ObjectStoreAddress.parse(
            s.object_store_url,
            endpoint=s.object_store_endpoint,
            region=s.object_store_region,
            path_style=s.object_store_path_style,
        )
        bucket = ObjectTier(address, ChunkSealer(mac_key))
        self._stack.callback(bucket.close)
        log.info("object tier: s3://%s/%s", address.bucket, address.prefix)
        return bucket

    def probes(self) -> dict[str, Callable[[], ComponentHealth]]:
        probes = {
            "redis": self._index_health,
            "mooncake_master": self._master_health,
            "dram": self._dram_health,
            "nvme": self._nvme_health,
            "peers": self._peers_health,
        }
        if (bucket := self.parts.bucket) is not None:
            probes["object"] = functools.partial(self._object_health, bucket)
        return {name: self._unless_restarting(SERVER_OF_COMPONENT.get(name), probe) for name, probe in probes.items()}

    def _unless_restarting(
        self, server: str | None, probe: Callable[[], ComponentHealth]
    ) -> Callable[[], ComponentHealth]:
        """``probe``, but down while the supervisor is bringing back ``server`` (its hooks may still be running)."""

        def health() -> ComponentHealth:
            trouble = self.supervisor.trouble(server) if server else None
            return ComponentHealth(ok=False, detail=trouble) if trouble else probe()

        return health

    def _index_health(self) -> ComponentHealth:
        try:
            index = self.parts.index
            index.ping()
            problem = index.deployment_problem()  # a primary demoted to a replica answers, but refuses writes
        except IndexUnavailableError as exc:
            return ComponentHealth(ok=False, detail=str(exc))
        return ComponentHealth(ok=False, detail=problem) if problem else ComponentHealth(ok=True, detail="answering")

    def _master_health(self) -> ComponentHealth:
        mooncake = self.parts.mooncake
        address = mooncake.master_address
        if mooncake.ha_masters is not None:
            return self._ha_masters_health(mooncake.ha_masters, address)
        if mooncake.master_admin_url:
            health_url = mooncake.master_admin_url + "/health"
            try:
                urllib.request.urlopen(health_url, timeout=2).close()
                return ComponentHealth(ok=True, detail=f"{address} serving")
            except OSError as exc:
                return ComponentHealth(ok=False, detail=f"{address}: {exc}")
        host, _, port = address.rpartition(":")
        ok = port_open(host, int(port))
        return ComponentHealth(ok=ok, detail=f"{address} {'accepting' if ok else 'not accepting'} connections")

    def _ha_masters_health(self, masters: HaMasters, address: str) -> ComponentHealth:
        """Down while no master leads (an election takes about 10 s); degraded while none stands by to take over,
        or one does not answer."""
        if not masters.admin_urls:
            etcd = self.settings.mooncake_ha.endpoints if self.settings.mooncake_ha else ()
            up = [endpoint for endpoint in etcd if port_open(*_host_port(endpoint))]
            return ComponentHealth(
                ok=bool(up),
                detail=f"found through {address} ({'reachable' if up else 'unreachable'}); set "
                "PREFIXCACHE_MOONCAKE_METRICS_URL (every master's) to see which master leads",
            )
        states = masters.states()
        leader = next((state for state in states.values() if leads(state)), None)
        standing_by = [url for url, state in states.items() if isinstance(state, dict) and not leads(state)]
        unreachable = [f"{url} ({state})" for url, state in states.items() if isinstance(state, str)]
        parts = [f"{len(standing_by)} standing by"]
        if unreachable:
            parts.append(f"unreachable: {', '.join(unreachable)}")
        if not isinstance(leader, dict):
            return ComponentHealth(ok=False, detail="; ".join(["no master leads (an election takes ~10 s)", *parts]))
        parts.insert(0, f"leader {leader.get('leader_address')} serving")
        return ComponentHealth(ok=True, degraded=bool(unreachable) or not standing_by, detail="; ".join(parts))

    def _dram_health(self) -> ComponentHealth:
        mooncake = self.parts.mooncake
        if not mooncake.owner.alive():
            return ComponentHealth(ok=False, detail=f"segment owner exited (log: {mooncake.owner.log_path})")
        return ComponentHealth(**dataclasses.asdict(mooncake.dram.health()))

    def _nvme_health(self) -> ComponentHealth:
        """The tier's own health, degraded too while the write-behind fails to persist chunks (they wait in
        DRAM), naming why."""
        health = self.parts.nvme.health()
        failures = self.parts.write_behind.stats.failures
        if failures.failing is None:
            return ComponentHealth(**dataclasses.asdict(health))
        why = f"persisting fails ({failures.failing}: {failures.detail}); unpersisted chunks wait in DRAM"
        return ComponentHealth(ok=health.ok, degraded=True, detail=f"{why}; {health.detail}")

    @staticmethod
    def _object_health(bucket: BucketParts) -> ComponentHealth:
        """The bucket's own health (degraded while unreachable: the node serves without it), degraded too while
        copies to it fail (the chunks stay on NVMe and are copied once it takes them)."""
        health = bucket.tier.health()
        failures = bucket.copies.failures
        if failures.failing is None:
            return ComponentHealth(**dataclasses.asdict(health))
        why = f"copying to the bucket fails ({failures.failing}: {failures.detail}); the chunks stay on NVMe"
        return ComponentHealth(ok=health.ok, degraded=True, detail=f"{why}; {health.detail}")

    def _peers_health(self) -> ComponentHealth:
        """The other nodes this one's clients skip (indexer/peers.py), named with why: degraded while any is down,
        since chunks only they hold are recomputed meanwhile."""
        try:
            table = self.parts.peers.read()
        except IndexUnavailableError as exc:
            return ComponentHealth(ok=True, detail=f"unknown: {exc}")
        return peers_health(table, self.settings.node)

    def check_listeners(self) -> None:
        """Refuse to serve if a process of the daemon's tree listens beyond the node's addresses: loopback, the
        pool address (``mooncake_host``), the REST API on ``host`` and a configured KV-events endpoint
        (cachestore/host/listeners.py). Mooncake ignores some bind addresses (cachestore/tiers/bind_shim.py)."""
        s = self.settings
        endpoints = [(s.host, s.port), *s.kv_events_tcp_addresses]
        check_listeners(os.getpid(), [s.mooncake_host], endpoints)
        log.info("every listener of this node is on loopback or %s", s.mooncake_host)

    def serve(self) -> None:
        """Start everything, serve until SIGINT/SIGTERM, then stop everything.

        uvicorn re-raises the signal that stopped it; SIGTERM's default action would end the process
        before the child servers are stopped, so it is turned into SystemExit like SIGINT's
        KeyboardInterrupt.
        """
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            self.start()
            self.check_listeners()
            p, s = self.parts, self.settings
            probes = self.probes()
            routers = [
                *admin_routers(p.admin),
                quota_router(p.quotas),
                metrics_router(self.stats, self.client_stats, probes),
                warmup_router(p.warmup_jobs),
                liveness_router(self.supervisor.alive),
            ]
            hosts = trusted_hosts(s.host, s.node, extra=s.allowed_hosts)
            app = create_app(
                self.client_config(),
                probes,
                self.stats,
                routers=routers,
                access=AccessPolicy(admin_token=p.secrets.admin_token, open_reads=s.open_reads),
                allowed_hosts=hosts,
                max_body_bytes=int(s.max_body_bytes),
            )
            if s.open_reads and s.host not in ("127.0.0.1", "localhost", "::1"):
                log.warning(
                    "open reads: anyone who reaches %s:%d can list the cache's chunks and stats", s.host, s.port
                )
            log.info("answering Host names %s", ", ".join(hosts))
            if not s.warmup_roots:
                log.info("no warm-up roots: POST /v1/warmup refuses every job (set --warmup-root)")
            log.info("prefixcache serving on http://%s:%d (node %s)", s.host, s.port, s.node)
            uvicorn.run(app, host=s.host, port=s.port, log_level="warning")
        finally:
            self.stop()
            log.info("prefixcache stopped")
