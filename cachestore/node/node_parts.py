"""What a started node daemon is made of, as whole values: ``NodeDaemon.start`` builds them in one pass, so no part
exists half-built and a daemon either has all of them or none."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.host.processes import ManagedProcess
from prefixcache.cachestore.services.cache_admin import CacheAdmin
from prefixcache.cachestore.services.demotion import Demoter
from prefixcache.cachestore.services.eviction import Evictor
from prefixcache.cachestore.services.eviction_orders import OrderServer
from prefixcache.cachestore.services.nvme_extents import ExtentServer
from prefixcache.cachestore.services.object_write_behind import ObjectWriteBehind
from prefixcache.cachestore.services.promotion import Promoter
from prefixcache.cachestore.services.quotas import QuotaEnforcer
from prefixcache.cachestore.services.write_behind import WriteBehind
from prefixcache.cachestore.tiers.dram import MooncakeTier
from prefixcache.cachestore.tiers.mooncake_servers import HaMasters, SegmentOwner
from prefixcache.cachestore.tiers.nvme import NvmeTier
from prefixcache.cachestore.warmup.jobs import WarmupJobs
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.peers import PeerRegistry
from prefixcache.indexer.redis_index import RedisIndex

if TYPE_CHECKING:  # the object extra's: imported only where a bucket is set
    from prefixcache.cachestore.tiers.object_store import ObjectTier


@dataclasses.dataclass(frozen=True)
class NodeSecrets:
    """The chunk-signing key and the admin token, with the files clients and the CLI read them from."""

    mac_key: ChunkMacKey
    mac_key_file: Path
    admin_token: SecretStr
    #: the generated token's file; None when the operator set the token
    admin_token_file: Path | None


def master_admin_url(metrics_url: str | None) -> str | None:
    """The master's HTTP port (``/metrics``, ``/health``, ``/get_all_segments``), when its ``/metrics`` is known."""
    return metrics_url.rsplit("/", 1)[0] if metrics_url else None


@dataclasses.dataclass(frozen=True)
class MooncakeParts:
    """This node's DRAM tier: the segment owner, the master it mounts on, and the daemon's own attachment."""

    master_address: str
    metadata_url: str
    #: the master's ``/metrics``, when known (None in high-availability mode: ``ha_masters`` knows each master's)
    metrics_url: str | None
    #: the masters, with an etcd:// mooncake_master (high-availability mode)
    ha_masters: HaMasters | None
    owner: SegmentOwner
    dram: MooncakeTier
    #: the servers the daemon started here (an embedded master, the owner): a restart of one loses DRAM copies
    servers: tuple[ManagedProcess, ...]

    @property
    def master_admin_url(self) -> str | None:
        return master_admin_url(self.metrics_url)


@dataclasses.dataclass(frozen=True)
class BucketParts:
    """The object tier (``object_store_url``) and what copies this node's chunks to it."""

    tier: ObjectTier
    copies: ObjectWriteBehind


@dataclasses.dataclass(frozen=True)
class NodeParts:
    """A started node's index, tiers and services."""

    secrets: NodeSecrets
    index: RedisIndex
    leases: Leases
    mooncake: MooncakeParts
    nvme: NvmeTier
    #: the object tier, when one is set
    bucket: BucketParts | None
    write_behind: WriteBehind
    promoter: Promoter
    extents: ExtentServer
    demoter: Demoter
    evictor: Evictor
    orders: OrderServer
    quotas: QuotaEnforcer
    admin: CacheAdmin
    warmup_jobs: WarmupJobs
    peers: PeerRegistry
