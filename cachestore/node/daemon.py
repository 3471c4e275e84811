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
from prefixcache.cachestore.host.processes import port_open
from prefixcache.cachestore.host.secret_files import PRIVATE_UMASK, load_or_create_secret, make_private_dir, secrets_dir
from prefixcache.cachestore.node.data_dir_lock import DataDirLock
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
from prefixcache.cachestore.tiers.nvme import NvmeStore
from prefixcache.cachestore.tiers.tier import StorageTier
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
        self.index: RedisIndex
        self.dram: MooncakeTier
        self.nvme: NvmeStore
        self.owner: SegmentOwner
        self.master_address: str
        self.metadata_url: str
        self.metrics_url: str | None = None
        #: the masters, with an etcd:// mooncake_master (high-availability mode)
        self.ha_masters: HaMasters | None = None
        self.write_behind: WriteBehind
        self.promoter: Promoter
        self.demoter: Demoter
        self.leases: Leases
        self.peers: PeerRegistry
        self.evictor: Evictor
        self.orders: OrderServer
        self.quotas: QuotaEnforcer
        self.admin: CacheAdmin
        self.nvme_evicted = 0
        #: the object tier, when one is set (``object_store_url``), and what copies chunks to it
        self.bucket: ObjectTier | None = None
        self.object_write_behind: ObjectWriteBehind
        self.extents: ExtentServer
        self.mac_key_file: Path
        self.mac_key: ChunkMacKey
        self.warmup_jobs: WarmupJobs
        self.admin_token: SecretStr
        #: the generated token's file; None when the operator set the token
        self.admin_token_file: Path | None = None
        self._services: list[BackgroundLoop] = []  # asked to stop together before each is joined
        self.supervisor = Supervisor()

    def start(self) -> None:
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
        self._load_admin_token()
        # asked to stop first (no restart while stopping), joined last: after the servers it may have restarted
        self._services.append(self.supervisor)
        self._stack.callback(self.supervisor.stop)
        engine_cpus = None  # where warm-up engines run: unbound, as the daemon
        if s.cpu_set is not None:
            engine_cpus = allowed_cpus()  # warm-up engines are vLLM engines: they keep the cores the daemon had
            # before any thread or server starts: each inherits the binding
            os.sched_setaffinity(0, s.cpu_set)
            log.info("daemon and its servers bound to CPUs %s", s.cpus)
        self._load_mac_key()
        self._start_index()
        keys = self.index.keyspace
        self.leases = Leases(redis_client(self.index.url), keys)
        self._start_mooncake()
        self.nvme = NvmeStore(
            s.nvme_path,
            s.nvme_bytes,
            pack_file_bytes=NVME_PACK_FILE_BYTES,
            is_pinned=self._protected,
            on_evict=self._evicted,
        )
        self._stack.callback(self.nvme.close)
        # The segment owner starts empty every time, so DRAM locations naming this node are stale.
        reconcile(self.index, self.nvme, s.node, dram_is_new=True)
        self.write_behind = WriteBehind(
            self.index, self.dram, self.nvme, s.node, hold_s=s.write_behind_hold_s, mac_key=self.mac_key
        )
        self.bucket = self._open_bucket()
        self.promoter = Promoter(
            self._waiting_redis(),
            keys,
            self.index,
            self.dram,
            self.nvme,
            s.node,
            mac_key=self.mac_key,
            bucket=self.bucket,
        )
        self.extents = ExtentServer(self._waiting_redis(), keys, self.nvme, s.node)
        if self.bucket is not None:
            self.object_write_behind = ObjectWriteBehind(self.index, self.nvme, self.bucket, s.node)
            self._start_service(self.object_write_behind)
            # what the bucket holds and the index lost (a flushed Redis, a lost node's registrations)
            limits = BucketLimits(
                None if s.object_store_bytes is None else int(s.object_store_bytes), s.object_store_max_age_s
            )
            self._start_service(
                BucketReconciler(self.index, self.bucket, s.node, limits=limits, is_protected=self._protected)
            )
        self.demoter = Demoter(
            self.index,
            self.dram,
            self.write_behind,
            s.node,
            self._protected,
            s.dram_high_watermark,
            s.dram_low_watermark,
        )
        self.write_behind.on_persisted = self.demoter.poke
        for service in (self.write_behind, self.promoter, self.extents, self.demoter):
            self._start_service(service)
        if s.kv_events_endpoint:
            self._start_service(
                KvEventPublisher(
                    self.index.url,
                    keys,
                    s.node,
                    s.kv_events_endpoint,
                    s.kv_events_topic,
                    block_size=s.chunk_tokens,
                    replay_endpoint=s.kv_events_replay_endpoint,
                )
            )
            log.info("publishing KV events on %s", s.kv_events_endpoint)
        self.evictor = Evictor(
            self.index,
            self.dram,
            self.nvme,
            s.node,
            EvictionOrders(self._waiting_redis(), keys),
            bucket=self.bucket,
        )
        # after reconcile: orders queued while this node was down remove copies the index still names
        self.orders = orders = OrderServer(
            self._waiting_redis(),
            keys,
            s.node,
            self.index,
            lambda entries: self.evictor.evict_here(entries).removed,
        )
        self._start_service(orders)
        self.quotas = QuotaEnforcer(
            self.index,
            QuotaStore(redis_client(self.index.url), keys),
            self.evictor,
            s.node,
            self._protected,
            configured=s.quotas,
            default_tenant_bytes=None if s.default_tenant_quota is None else int(s.default_tenant_quota),
            low=s.quota_low_watermark,
            scan_entries=s.quota_scan_entries,
        )
        self._start_service(self.quotas)
        self.admin = CacheAdmin(self.index, self.evictor)
        policy = WarmupPolicy(tuple(s.warmup_roots), s.warmup_allow_trust_remote_code)
        self.warmup_jobs = WarmupJobs(
            s.data_dir / "warmup" / "jobs",
            local_url(s.host, s.port),
            s.data_dir / "warmup",
            engine_cpus=engine_cpus,
            policy=policy,
            redis_password=self._redis_password(),
        )
        self.warmup_jobs.start()
        self._stack.callback(self.warmup_jobs.stop)
        self.supervisor.start()
        # last: other nodes read from this one once it beats, and the first thing stopped says it has left
        self.peers = PeerRegistry(redis_client(self.index.url), self.index.keyspace)
        self._start_service(Heartbeat(self.peers, s.node))
        if s.owner_nice < CALM_NICE:  # the owner yields its raised priority while a peer is lost
            self._start_service(OwnerPriority(self.peers, s.node, lambda: self.owner.pid, s.owner_nice))

    def _load_mac_key(self) -> None:
        """The cluster's chunk-signing key: the operator's file, or this node's own, generated at first start."""
        s = self.settings
        if s.chunk_key_file is not None:
            self.mac_key_file = s.chunk_key_file.absolute()
            self.mac_key = ChunkMacKey.read(s.chunk_key_file)
            return
        self.mac_key_file = (secrets_dir(s.data_dir) / KEY_FILE_NAME).absolute()
        self.mac_key = ChunkMacKey.load_or_create(self.mac_key_file)
        if not (s.embedded_redis and s.embedded_mooncake):
            log.warning(
                "this node signs chunks with a key of its own (%s): other nodes can use its chunks only if "
                "every node is given the same PREFIXCACHE_CHUNK_KEY_FILE",
                self.mac_key_file,
            )

    def _load_admin_token(self) -> None:
        """The operator's token, or the one generated at this data dir's first start (kept, 0600, for the CLI)."""
        if self.settings.admin_token is not None:
            self.admin_token = self.settings.admin_token
            return
        path = admin_token_path(secrets_dir(self.settings.data_dir))
        self.admin_token = SecretStr(load_or_create_secret(path))
        self.admin_token_file = path.absolute()
        log.info(
            "admin token in %s (readable by this user only; `prefixcache stats` and the other admin commands "
            "read it from there)",
            path,
        )

    def _redis_password(self) -> str | None:
        """The index's password, for warm-up children (on their stdin): from the URL, else the environment."""
        return urlsplit(self.index.url).password or redis_password_from_environment()

    def _start_service(self, service: BackgroundLoop) -> None:
        service.start()
        self._services.append(service)
        self._stack.callback(service.stop)

    def _start_index(self) -> None:
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
        self.index = RedisIndex(redis_url, key_prefix=s.key_prefix)
        self._stack.callback(self.index.close)
        self.index.ping()
        if problem := self.index.deployment_problem():
            raise ConfigError(f"the index cannot live there: {problem}")
        log.info("index ready at %s", public_redis_url(redis_url)[0])

    @property
    def redis_password_file(self) -> Path:
        return (secrets_dir(self.settings.data_dir) / REDIS_PASSWORD_FILE).absolute()

    def _waiting_redis(self) -> RedisClient:
        """A connection of the index's Redis for a service that waits on queues (``BLPOP``)."""
        return redis_client(self.index.url, socket_timeout_s=WAITING_SOCKET_TIMEOUT_S)

    def _start_mooncake(self) -> None:
        s = self.settings
        logs = s.data_dir / "logs"
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
            self.supervisor.watch(master, before_restart=self._forget_dram)
            self.master_address, self.metadata_url = master.address, master.metadata_url
            self.metrics_url = f"http://{master.host}:{master.metrics_port}/metrics"
            log.info("embedded mooncake_master ready at %s", master.address)
        elif (ha := s.mooncake_ha) is not None:
            # the owner finds the leader in etcd; the transfer endpoints are kept there too unless told otherwise
            self.master_address, self.metadata_url = ha.address, s.mooncake_metadata_url or ha.address
            self.ha_masters = HaMasters([url.removesuffix("/metrics") for url in s.mooncake_metrics_urls])
            log.info("Mooncake masters in high-availability mode, found through %s", s.mooncake_master)
            if not s.mooncake_metrics_urls:
                log.warning(
                    "PREFIXCACHE_MOONCAKE_METRICS_URL is not set (every master's, comma-separated): demotion cannot "
                    "see this node's DRAM use, and /v1/health cannot tell which master leads"
                )
        else:
            assert s.mooncake_master and s.mooncake_metadata_url
            self.master_address, self.metadata_url = s.mooncake_master, s.mooncake_metadata_url
            self.metrics_url = s.mooncake_metrics_url
            if self.metrics_url is None:
                log.warning(
                    "PREFIXCACHE_MOONCAKE_METRICS_URL is not set: demotion cannot see this node's "
                    "DRAM use, and a restart cannot wait for the master to forget its old segment owner"
                )
        self.owner = SegmentOwner(
            logs,
            segment_bytes=s.dram_bytes,
            master=self.master_address,
            metadata_url=self.metadata_url,
            host=s.mooncake_host,
            segment_port=s.derived_port("segment_port"),
            shm_port=s.derived_port("shm_port"),
            protocol=s.mooncake_protocol,
            device_names=s.mooncake_device_names,
            master_admin_url=self.ha_masters.leader if self.ha_masters else self.master_admin_url,
            nice=s.owner_nice,
            cluster_id=s.mooncake_ha.cluster_id if s.mooncake_ha else None,
        )
        self.owner.start()
        self._stack.callback(self.owner.stop)
        # a new owner starts empty; attached tiers (this daemon's too) re-register their memory with it by themselves
        self.supervisor.watch(self.owner, before_restart=self._forget_dram)
        options: dict[str, Any] = {
            "arena_bytes": DAEMON_ARENA_BYTES,
            "object_prefix": s.key_prefix,
            "preferred_segment": self.owner.segment,
        }
        if self.ha_masters is None:
            self.dram = MooncakeTier(self.owner.shm_address, metrics_url=self.metrics_url, **options)
        else:
            self.dram = LeaderMetricsTier(self.owner.shm_address, self.ha_masters, **options)
        self._stack.callback(self.dram.close)
        self._warm_segment()
        log.info(
            "DRAM segment %s (%d MiB) ready; clients attach at %s",
            self.owner.segment,
            s.dram_bytes >> 20,
            self.owner.shm_address,
        )

    @property
    def master_admin_url(self) -> str | None:
        """The master's HTTP port (``/metrics``, ``/health``, ``/get_all_segments``), when known."""
        return self.metrics_url.rsplit("/", 1)[0] if self.metrics_url else None

    def _warm_segment(self) -> None:
        """Touch the new segment's pages once: first writes to fresh shared memory run several times slower."""
        started = time.monotonic()
        slot = self.dram.arena.alloc(WARMUP_OBJECT_BYTES)
        count = int(self.settings.dram_bytes * 0.8) // WARMUP_OBJECT_BYTES
        keys = [f"warmup-{i}".encode().ljust(16, b"\0")[:16] for i in range(count)]
        try:
            for start in range(0, count, 32):
                self.dram.put([(k, slot) for k in keys[start : start + 32]])
            self.dram.delete(keys)
        finally:
            self.dram.arena.free(slot)
        log.info("DRAM segment warmed in %.1fs", time.monotonic() - started)

    def _protected(self, keys: Sequence[bytes]) -> list[bool]:
        """Chunks capacity pressure must not move: pinned by an operator, or leased to a scheduler."""
        try:
            now = self.index.clock_s()  # pins are deadlines in the index's clock
            pinned = [e is not None and e.pinned(now) for e in self.index.get(keys)]
            return [p or leased for p, leased in zip(pinned, self.leases.held(keys), strict=True)]
        except IndexUnavailableError:
            return [True] * len(keys)  # cannot tell: move nothing rather than a protected chunk

    def _forget_dram(self) -> None:
        """DRAM copies went with a dead segment owner or master: drop their locations, as a start does."""
        log.warning("dropped the DRAM locations of %d chunks of this node", self.write_behind.forget_resident())

    def _evicted(self, keys: list[bytes]) -> None:
        self.nvme_evicted += len(keys)
        self.index.drop_location(keys, Location("nvme", self.settings.node))

    def stop(self) -> None:
        for service in self._services:
            service.request_stop()
        self._stack.close()

    def client_config(self) -> ClientConfig:
        url, needs_password = public_redis_url(self.index.url)
        s = self.settings
        return ClientConfig(
            node=s.node,
            redis_url=url,
            redis_password_required=needs_password,
            key_prefix=s.key_prefix,
            chunk_tokens=s.chunk_tokens,
            mooncake=MooncakeConfig(
                master=self.master_address,
                metadata_url=self.metadata_url,
                protocol=s.mooncake_protocol,
                device_names=s.mooncake_device_names,
                shm_address=self.owner.shm_address,
                segment=self.owner.segment,
            ),
            secret_files=SecretFiles(
                chunk_key=str(self.mac_key_file),
                redis_password=str(self.redis_password_file) if s.embedded_redis else None,
                admin_token=str(self.admin_token_file) if self.admin_token_file else None,
            ),
        )

    def stats(self) -> Stats:
        dram, nvme, wb = self.dram.usage(), self.nvme.usage(), self.write_behind.stats
        client_stats = self.client_stats()
        clients = all_client_stats(client_stats)
        delays = sorted(wb.delays_s) or [0.0]
        usage, tenants = self.index.usage(), self.index.tenant_usage()  # read once for the figures and the quotas
        refused = [wb.corrupt, self.promoter.corrupt, *([self.bucket.rejected] if self.bucket is not None else [])]
        return Stats(
            node=self.settings.node,
            dram=TierStats(
                bytes_used=dram.bytes_used, capacity_bytes=dram.capacity_bytes, chunks=len(self.write_behind.resident)
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
            promoted=self.promoter.promoted,
            promotion_failures=self.promoter.failed,
            demoted=self.demoter.demoted,
            evictions=EvictionStats(
                requested_chunks=self.evictor.evicted_chunks,
                requested_bytes=self.evictor.evicted_bytes,
                nvme_capacity=self.nvme_evicted,
                dram_demoted=self.demoter.demoted,
            ),
            corrupt_chunks=sum(counts.total for counts in refused) + clients.corrupt_chunks,
            corrupt_by_reason=corrupt_by_reason(clients, *refused),
            persist_failures={str(reason): n for reason, n in wb.failures.counts.items()},
            queues=QueueDepths(
                promotion=self.promoter.client.llen(self.promoter.queue),
                write_behind=self.index.feed_backlog(self.settings.node, WRITE_BEHIND_GROUP),
                eviction_orders=self.orders.client.llen(self.orders.queue),
            ),
            clients=clients,
            namespaces=namespace_stats(usage, client_stats),
            tenants={t or NO_TENANT: u for t, u in tenants.items()},
            quotas=[quota(state) for state in self.quotas.states(usage, tenants)],
            child_restarts=self.supervisor.restarts,
            peers=self._peer_stats(),
            master_failovers=self.ha_masters.failovers if self.ha_masters else 0,
            object_store=self._object_stats(self.bucket, usage) if self.bucket is not None else None,
        )

    def _object_stats(self, bucket: ObjectTier, usage: dict[bytes, NamespaceUsage]) -> ObjectStats:
        """The bucket's chunks from the index's counters (no listing of the bucket), and this node's copies."""
        held = [u.tiers["object"] for u in usage.values() if "object" in u.tiers]
        copies = self.object_write_behind
        return ObjectStats(
            chunks=sum(u.chunks for u in held),
            bytes=sum(u.bytes for u in held),
            copied=copies.copied,
            backlog=self.index.feed_backlog(self.settings.node, OBJECT_GROUP),
            copy_failures={reason: n for reason, n in copies.failures.counts.items()},
            rejected=bucket.rejected.total,
            late_reads=bucket.late_reads,
            reachable=bucket.available,
        )

    def _peer_stats(self) -> dict[str, PeerStats]:
        """The other nodes as the table of peers has them (none while the index does not answer)."""
        try:
            table = self.peers.read()
        except IndexUnavailableError:
            return {}
        return {
            peer: PeerStats(down=peer in table.down, stopped=peer in table.left, suspect_marks=table.marks.get(peer, 0))
            for peer in table.others(self.settings.node)
        }

    def client_stats(self) -> dict[bytes, ClientStatsRecord]:
        """The client stats of this node (what clients attached to it recorded), per namespace."""
        return read_client_stats(self.promoter.client, self.index.keyspace, self.settings.node)

    def _open_bucket(self) -> ObjectTier | None:
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
        bucket = ObjectTier(address, ChunkSealer(self.mac_key))
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
        if self.bucket is not None:
            probes["object"] = functools.partial(self._object_health, self.bucket)
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
            self.index.ping()
            problem = self.index.deployment_problem()  # a primary demoted to a replica answers, but refuses writes
        except IndexUnavailableError as exc:
            return ComponentHealth(ok=False, detail=str(exc))
        return ComponentHealth(ok=False, detail=problem) if problem else ComponentHealth(ok=True, detail="answering")

    def _master_health(self) -> ComponentHealth:
        if self.ha_masters is not None:
            return self._ha_masters_health(self.ha_masters)
        if self.master_admin_url:
            health_url = self.master_admin_url + "/health"
            try:
                urllib.request.urlopen(health_url, timeout=2).close()
                return ComponentHealth(ok=True, detail=f"{self.master_address} serving")
            except OSError as exc:
                return ComponentHealth(ok=False, detail=f"{self.master_address}: {exc}")
        host, _, port = self.master_address.rpartition(":")
        ok = port_open(host, int(port))
        return ComponentHealth(
            ok=ok, detail=f"{self.master_address} {'accepting' if ok else 'not accepting'} connections"
        )

    def _ha_masters_health(self, masters: HaMasters) -> ComponentHealth:
        """Down while no master leads (an election takes about 10 s); degraded while none stands by to take over,
        or one does not answer."""
        if not masters.admin_urls:
            etcd = self.settings.mooncake_ha.endpoints if self.settings.mooncake_ha else ()
            up = [endpoint for endpoint in etcd if port_open(*_host_port(endpoint))]
            return ComponentHealth(
                ok=bool(up),
                detail=f"found through {self.master_address} ({'reachable' if up else 'unreachable'}); set "
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
        if not self.owner.alive():
            return ComponentHealth(ok=False, detail=f"segment owner exited (log: {self.owner.log_path})")
        return ComponentHealth(**dataclasses.asdict(self.dram.health()))

    def _nvme_health(self) -> ComponentHealth:
        """The tier's own health, degraded too while the write-behind fails to persist chunks (they wait in
        DRAM), naming why."""
        health = self.nvme.health()
        failures = self.write_behind.stats.failures
        if failures.failing is None:
            return ComponentHealth(**dataclasses.asdict(health))
        why = f"persisting fails ({failures.failing}: {failures.detail}); unpersisted chunks wait in DRAM"
        return ComponentHealth(ok=health.ok, degraded=True, detail=f"{why}; {health.detail}")

    def _object_health(self, bucket: StorageTier) -> ComponentHealth:
        """The bucket's own health (degraded while unreachable: the node serves without it), degraded too while
        copies to it fail (the chunks stay on NVMe and are copied once it takes them)."""
        health = bucket.health()
        failures = self.object_write_behind.failures
        if failures.failing is None:
            return ComponentHealth(**dataclasses.asdict(health))
        why = f"copying to the bucket fails ({failures.failing}: {failures.detail}); the chunks stay on NVMe"
        return ComponentHealth(ok=health.ok, degraded=True, detail=f"{why}; {health.detail}")

    def _peers_health(self) -> ComponentHealth:
        """The other nodes this one's clients skip (indexer/peers.py), named with why: degraded while any is down,
        since chunks only they hold are recomputed meanwhile."""
        try:
            table = self.peers.read()
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
            s = self.settings
            probes = self.probes()
            routers = [
                *admin_routers(self.admin),
                quota_router(self.quotas),
                metrics_router(self.stats, self.client_stats, probes),
                warmup_router(self.warmup_jobs),
                liveness_router(self.supervisor.alive),
            ]
            hosts = trusted_hosts(s.host, s.node, extra=s.allowed_hosts)
            app = create_app(
                self.client_config(),
                probes,
                self.stats,
                routers=routers,
                access=AccessPolicy(admin_token=self.admin_token, open_reads=s.open_reads),
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
