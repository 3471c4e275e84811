"""The daemon's settings: one typed object filled from defaults < config file < environment < flags.

Environment variables are the field names upper-cased with the ``PREFIXCACHE_`` prefix
(``PREFIXCACHE_REDIS_URL``...). A config file is TOML or JSON with the same field names. Anything
invalid fails before a single server starts, with the field, the value's source and the reason.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ByteSize, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from prefixcache.cachestore.host.cpus import allowed_cpus, cpu_list, format_cpu_list
from prefixcache.indexer.chunking import DEFAULT_CHUNK_TOKENS, MAX_CHUNK_TOKENS
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.quotas import QuotaScope, ScopeKind
from prefixcache.indexer.redis_clients import check_redis_url

#: Size of one NVMe pack file: large sequential writes, and the unit compaction works in.
NVME_PACK_FILE_BYTES = 256 << 20
#: Largest request body the REST API reads by default (a 1M-token prompt as JSON is about 8 MB).
DEFAULT_MAX_BODY_BYTES = 16 << 20


def _scoped(quotas: dict[str, ByteSize], kind: ScopeKind) -> dict[str, ByteSize]:
    """``quotas`` with ids lower-cased, each checked as an id of ``kind``."""
    checked = {}
    for scope_id, limit in quotas.items():
        try:
            checked[QuotaScope(kind, scope_id.lower()).id] = limit
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
    return checked


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "prefixcache"


ETCD_SCHEME = "etcd://"


def _is_host_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep and host) and port.isdigit() and 0 < int(port) < 65536


@dataclass(frozen=True)
class EtcdMasters:
    """Mooncake masters in high-availability mode: the etcd they elect their leader in, and their cluster id.

    Written ``etcd://host:port[;host:port...][/cluster_id]``; Mooncake's clients take the etcd part alone
    (``address``) and the cluster id from ``MC_STORE_CLUSTER_ID``.
    """

    endpoints: tuple[str, ...]
    #: the masters' ``-cluster_id``; None: Mooncake's default
    cluster_id: str | None = None

    @classmethod
    def parse(cls, url: str) -> EtcdMasters:
        hosts, _, cluster_id = url.removeprefix(ETCD_SCHEME).partition("/")
        endpoints = tuple(part.strip() for part in re.split(r"[;,]", hosts) if part.strip())
        if not endpoints or not all(_is_host_port(endpoint) for endpoint in endpoints):
            raise ValueError("must name etcd's endpoints as etcd://host:port[;host:port...][/cluster_id]")
        if cluster_id and not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", cluster_id):
            raise ValueError(
                f"cluster id {cluster_id!r} must be 1 to 64 letters, digits, '_', '.' or '-' (the masters' -cluster_id)"
            )
        return cls(endpoints, cluster_id or None)

    @property
    def address(self) -> str:
        """What Mooncake's clients take as the master and, unless told otherwise, as the metadata server."""
        return ETCD_SCHEME + ";".join(self.endpoints)


class Settings(BaseSettings):
    """Everything ``prefixcache serve`` needs. Unknown keys in a file or flags are errors, not ignored."""

    model_config = SettingsConfigDict(env_prefix="PREFIXCACHE_", extra="forbid", validate_default=True)

    host: str = Field(
        json_schema_extra={"short": "REST API address"},
        default="127.0.0.1",
        description="Address the REST API binds to: loopback unless told. In Kubernetes, the node's IP (the vLLM "
        "pods on the node call the daemon there).",
    )
    port: int = Field(
        json_schema_extra={"short": "REST API port"},
        default=8600,
        ge=1,
        le=65535,
        description="REST API port. The daemon's other ports are fixed and derived from it (`port`+1 to `port`+6, "
        "unless set), so that attached clients reconnect to a restarted daemon; it must leave room for those six. "
        "With several daemons on one host, give each its own `port` and `data_dir`.",
    )
    data_dir: Path = Field(
        json_schema_extra={"short": "State dir"},
        default_factory=default_data_dir,
        description="Where the daemon keeps its embedded servers' files, its logs, its secrets and warm-up jobs "
        "(`redis/`, `logs/`, `secrets/`, `warmup/`), and the NVMe tier unless `nvme_dir` is set.",
    )
    node: str = Field(
        json_schema_extra={"short": "Node name"},
        default_factory=socket.gethostname,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="This node's name in chunk locations and in its change feed: unique in the cluster, and "
        "stable across restarts.",
    )
    redis_url: str | None = Field(
        json_schema_extra={"short": "The shared index's URL"},
        default=None,
        description="The shared index: `redis://[user:password@]host:6379/0`, `rediss://` (TLS) or `unix://`; "
        "`redis+sentinel://[user:password@]host:26379[,host:port...]/SERVICE` for the primary Sentinel names; "
        "`redis+cluster://[user:password@]host:port[,host:port...]` for a Redis or Valkey Cluster (any of its "
        "nodes). Give prefixcache a Redis user of its own (docs/operations.md, Security). Never echoed, since it "
        "may hold a password. Unset: the daemon starts an embedded redis-server under `data_dir`.",
    )
    redis_port: int | None = Field(
        json_schema_extra={"short": "Embedded redis-server's port"},
        default=None,
        ge=1,
        le=65535,
        description="Port of the embedded redis-server (no `redis_url`), on loopback; unset: `port`+1. It needs "
        "the password the daemon generates at its first start into `data_dir`/secrets/redis-password (0600).",
    )
    key_prefix: str = Field(
        json_schema_extra={"short": "Prefix of every index key"},
        default="pc",
        min_length=1,
        max_length=32,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="Prefix of every index key in Redis, so that several deployments can share one Redis.",
    )
    chunk_tokens: int = Field(
        json_schema_extra={"short": "Tokens per chunk"},
        default=DEFAULT_CHUNK_TOKENS,
        gt=0,
        le=MAX_CHUNK_TOKENS,
        description="Tokens per chunk, the unit the cache keys, stores and loads: a multiple of vLLM's block size "
        "(16 on CUDA, 128 on CPU).",
    )

    dram_bytes: ByteSize = Field(
        json_schema_extra={"short": "DRAM this node adds to the pool"},
        default=ByteSize(2 << 30),
        description="DRAM this node adds to the Mooncake pool (at least 64 MiB).",
    )
    nvme_bytes: ByteSize = Field(
        json_schema_extra={"short": "NVMe tier capacity"},
        default=ByteSize(16 << 30),
        description="Capacity of this node's NVMe tier (at least two 256 MiB segments).",
    )
    nvme_dir: Path | None = Field(
        json_schema_extra={"short": "NVMe tier directory"},
        default=None,
        description="NVMe tier directory: a local NVMe file system that supports O_DIRECT; unset: `data_dir`/nvme.",
    )
    object_store_url: str | None = Field(
        default=None,
        description="The object tier: `s3://BUCKET/PREFIX`, a bucket every node of the cluster shares. Chunks "
        "persisted to NVMe are copied to it behind, sealed. Credentials come from the standard AWS chain "
        "(environment, shared credentials file, web identity, container and instance-role credentials), never "
        "from a setting. Needs the "
        "`object` extra; unset: no object tier.",
        json_schema_extra={"short": "Object tier, s3://BUCKET/PREFIX"},
    )
    object_store_endpoint: str | None = Field(
        default=None,
        description="URL of an S3-compatible server for `object_store_url` (`https://` is reached over TLS, "
        "`http://` in the clear); unset: AWS.",
        json_schema_extra={"short": "S3-compatible server URL"},
    )
    object_store_region: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9\-]+$",
        description="The bucket's region; unset: the AWS chain's (`AWS_REGION`).",
        json_schema_extra={"short": "The bucket's region"},
    )
    object_store_path_style: bool = Field(
        default=False,
        description="Address the bucket as `ENDPOINT/BUCKET/KEY` rather than `BUCKET.ENDPOINT/KEY` (most "
        "S3-compatible servers need it).",
        json_schema_extra={"short": "Path-style bucket addresses"},
    )
    object_store_bytes: ByteSize | None = Field(
        default=None,
        description="The object tier's capacity: above it, the bucket's oldest chunks go (pinned and leased ones "
        "never), checked on every pass over the bucket (at start, then every 5 minutes); unset: no limit.",
        json_schema_extra={"short": "Object tier capacity"},
    )
    object_store_max_age_s: float | None = Field(
        default=None,
        gt=0,
        description="Chunks in the bucket older than this go (pinned and leased ones never), checked on every pass "
        "over the bucket; unset: no limit.",
        json_schema_extra={"short": "Oldest age kept in the bucket"},
    )
    dram_high_watermark: float = Field(
        default=0.85,
        gt=0,
        lt=1,
        description="Above this DRAM fill, persisted chunks are demoted from DRAM (their NVMe copy stays); it must "
        "be above `dram_low_watermark`.",
    )
    dram_low_watermark: float = Field(
        default=0.70,
        gt=0,
        lt=1,
        description="Demotion takes DRAM down to this fill.",
    )
    write_behind_hold_s: float = Field(
        default=0.25,
        ge=0,
        le=10,
        description="Seconds a published chunk stays in DRAM alone before the write-behind copies it to NVMe "
        "(0: at once). Its first reads come right after its publish (a decode instance's after a prefill "
        "instance's, an agent's next turn), and the copy would share the node with them; chunks already older "
        "(a backlog) are copied at once (cachestore/services/write_behind.py).",
    )

    mooncake_master: str | None = Field(
        json_schema_extra={"short": "External master or etcd:// (HA)"},
        default=None,
        description="External Mooncake master, `host:port` (its RPC port, 50051 by convention; needs "
        "`mooncake_metadata_url`), or masters in high-availability mode, found through etcd: "
        "`etcd://etcd-0:2379;etcd-1:2379;etcd-2:2379/CLUSTER_ID` (`,` also separates; `/CLUSTER_ID`, the masters' "
        "`-cluster_id`, may be left out when they run with Mooncake's default). Unset: the daemon starts an embedded "
        "master. Nodes that share a pool need an external master on an address they all reach.",
    )
    mooncake_metadata_url: str | None = Field(
        json_schema_extra={"short": "Metadata server URL"},
        default=None,
        description="Mooncake metadata server, which maps segment names to their transfer endpoints; required "
        "with a `host:port` master: `http://master:8080/metadata` (the master's built-in server), "
        "`etcd://etcd-0:2379` (or `etcd://a:2379,b:2379`) or `redis://host:6379` (another database or instance "
        "than the index's). With `etcd://` masters, unset: the same etcd. With an embedded master the daemon uses "
        "the master's own (`port`+5) and ignores this.",
    )
    mooncake_metrics_url: str | None = Field(
        default=None,
        description="An external master's `/metrics`: DRAM usage for demotion, the master's health for "
        "`/v1/health`, and its segment list, where a restarting daemon waits (up to 30 s) until the master has "
        "forgotten its previous segment owner. Set it on every node of a shared master: without that wait, a "
        "daemon restarted within seconds loses its DRAM tier. With `etcd://` masters, every master's, "
        "comma-separated: the daemon reads the one whose `/health` says it leads. Unset with an external master, "
        "demotion cannot see this node's DRAM use (the daemon warns); with an embedded master the daemon reads the "
        "master's own (`port`+6).",
    )
    mooncake_host: str = Field(
        json_schema_extra={"short": "Pool address"},
        default="127.0.0.1",
        description="This node's address in the Mooncake pool: with more than one node, its IP on the transfer "
        "network (the RDMA network, with `rdma`), where its segment is advertised.",
    )
    mooncake_protocol: Literal["tcp", "rdma"] = Field(
        json_schema_extra={"short": "tcp or rdma"},
        default="tcp",
        description="How the pool moves data between nodes: `tcp`, or `rdma` over `mooncake_device_names`. "
        "Every daemon and connector uses the protocol the daemon advertises; local attach is always shared "
        "memory.",
    )
    mooncake_device_names: str = Field(
        json_schema_extra={"short": "RDMA NICs, comma-separated"},
        default="",
        description="RDMA NICs (HCAs) to use, comma-separated, as `ibv_devices` names them: `mlx5_0`, or "
        "`mlx5_0,mlx5_1` to stripe over two ports.",
    )
    shm_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Where local clients attach to the segment owner; unset: `port`+2.",
    )
    segment_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Names this node's segment (`mooncake_host:segment_port`); unset: `port`+3.",
    )
    master_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="The embedded master's RPC port; unset: `port`+4 (its metadata server listens on `port`+5, "
        "its metrics on `port`+6).",
    )
    chunk_key_file: Path | None = Field(
        json_schema_extra={"short": "Chunk-signing key file"},
        default=None,
        description="File holding the key every chunk is signed with (64 hex digits, keyed BLAKE3). One node "
        "needs nothing: unset, the daemon generates `data_dir`/secrets/chunk-key (0600) at its first start, and "
        "local connectors read its path from `/v1/config`. Every node of a cluster must be given the same file "
        "(a Kubernetes Secret): a chunk signed with another key is a miss.",
    )
    admin_token: SecretStr | None = Field(
        json_schema_extra={"short": "Bearer token of admin calls"},
        default=None,
        description="Bearer token (16 characters or more) every admin call needs: mutating ones and warm-up jobs "
        "always, reading ones unless `open_reads`. Never echoed. Unset: generated at the first start into "
        "`data_dir`/secrets/admin-token (0600), and kept.",
    )
    open_reads: bool = Field(
        json_schema_extra={"short": "Read-only calls need no token"},
        default=False,
        description="Read-only REST endpoints (stats, metrics, listings, lookups, warm-up job status) answer "
        "without the admin token; writes and warm-up jobs never do.",
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        json_schema_extra={"short": "Another Host name"},
        default=[],
        description="Host header names the REST API answers besides `localhost`, `127.0.0.1`, `::1`, `host` and "
        "`node`: a DNS name clients reach the daemon by, a load balancer's name, `*.example.internal` for a "
        "domain. Any other Host header gets 400. Comma-separated in the environment.",
    )
    max_body_bytes: ByteSize = Field(
        json_schema_extra={"short": "Largest request body"},
        default=ByteSize(DEFAULT_MAX_BODY_BYTES),
        ge=1024,
        description="A REST request body larger than this gets 413 before it is read (a 1M-token lookup is "
        "about 8 MB of JSON).",
    )
    warmup_roots: Annotated[list[Path], NoDecode] = Field(
        json_schema_extra={"short": "Jobs' root folder"},
        default=[],
        description="Folders (absolute) the models, tokenizers and corpora of `POST /v1/warmup` jobs must lie "
        "in; `:`-separated in the environment. With none, the daemon refuses every warm-up job. `prefixcache "
        "warmup` run by hand is not bound by it.",
    )
    warmup_allow_trust_remote_code: bool = Field(
        json_schema_extra={"short": "Allow --trust-remote-code"},
        default=False,
        description="`POST /v1/warmup` jobs may pass `--trust-remote-code`, which runs Python shipped with the "
        "model: allow it only for roots holding models you trust.",
    )
    kv_events_endpoint: str | None = Field(
        json_schema_extra={"short": "ZMQ PUB endpoint of KV events"},
        default=None,
        description="ZMQ PUB endpoint for vLLM-format KV events (`BlockStored`/`BlockRemoved`; medium `CPU` = "
        "DRAM, `STORAGE` = NVMe), for routers such as llm-d or Dynamo: `tcp://127.0.0.1:5557`, "
        "`tcp://NODE_IP:5557` or `ipc://PATH`. They carry every chunk's token ids, so `tcp://*` is refused: "
        "name the address (`tcp://0.0.0.0:PORT` if every interface is meant). Unset: off.",
    )
    kv_events_replay_endpoint: str | None = Field(
        json_schema_extra={"short": "ZMQ ROUTER endpoint of replays"},
        default=None,
        description="ZMQ ROUTER endpoint where a KV-event subscriber that saw a gap in the sequence numbers asks for "
        "the batches it missed, as from a vLLM instance's `replay_endpoint` (the last 10,000 batches since the "
        "daemon started); same forms and rules as `kv_events_endpoint`. Unset: no replay.",
    )
    kv_events_topic: str = Field(
        default="",
        description="Topic frame of every KV-event message (e.g. `kv@node-1@model` for llm-d).",
    )
    tenant_quotas: dict[str, ByteSize] = Field(
        default={},
        description="Bytes each tenant may hold in the cache, by tenant id (16 hex, as `/v1/chunks` lists them; "
        "`prefixcache quota tenant-id` prints a salt's), `none` for requests without a `cache_salt`: "
        '`{"0123456789abcdef": "8GiB"}` (JSON in the environment). A chunk counts once whatever its copies, '
        "pinned ones included. A quota set through `/v1/quotas` takes the place of this one (docs/operations.md, "
        "Quotas).",
    )
    default_tenant_quota: ByteSize | None = Field(
        default=None,
        description="The quota of every tenant with a `cache_salt` that has none of its own (`tenant_quotas` or "
        "`/v1/quotas`). Unset: such tenants are unbounded.",
    )
    namespace_quotas: dict[str, ByteSize] = Field(
        default={},
        description="Bytes each namespace may hold, by digest (32 hex, as `/v1/namespaces` lists them), over every "
        "tenant; as `tenant_quotas` otherwise.",
    )
    quota_low_watermark: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="A tenant or namespace holding more than this fraction of its quota loses its own least "
        "recently used chunks down to it, each second; the rest of the quota is the room its publishes may fill "
        "until the next second (keep it several chunks). Publishes beyond the room are skipped.",
    )
    quota_scan_entries: int = Field(
        default=65_536,
        ge=1,
        description="Index entries a quota round reads at most, on from where the last one stopped, to find the "
        "chunks of tenants and namespaces above their low mark: those go oldest first among what the round read, "
        "so a round's cost on Redis is bounded however large the index. An index of at most this many chunks is "
        "read whole and trimmed exactly by last access.",
    )
    cpus: str | None = Field(
        json_schema_extra={"short": "CPUs to run on (1,2-3)"},
        default=None,
        description="CPUs the daemon and every server it starts run on (`1`, `2-3,6`). On a vLLM CPU host, give "
        "it the cores vLLM reserves (`VLLM_CPU_NUM_OF_RESERVED_CPU`; vLLM reserves the last ones), so that "
        "write-behind and the segment owner's copies never take a compute core; warm-up engines it starts run "
        "on the cores the daemon had before. Unset: wherever the OS puts them (cachestore/host/cpus.py).",
    )
    owner_nice: int = Field(
        default=-10,
        ge=-20,
        le=19,
        description="Nice of the segment owner, for its threads and its session (autogroup). It copies every "
        "DRAM hit into vLLM's pages while the step waits, on the cores vLLM reserves, where vLLM's engine core "
        "busy-polls; at the default priority it gets only part of a core there. It works where the daemon and vLLM "
        "share the root cgroup, as on a plain host or VM (the kernel then shares a core between sessions, and "
        "the owner runs in one of its own); in containers and systemd services, cgroups share the cores (CPU "
        "requests, `CPUWeight=`), so the shipped files set it to 0. Below 0 needs CAP_SYS_NICE; without it the "
        "owner runs at the default and the daemon logs a warning (cachestore/host/cpu_priority.py).",
    )

    @field_validator("tenant_quotas")
    @classmethod
    def _tenant_ids(cls, quotas: dict[str, ByteSize]) -> dict[str, ByteSize]:
        return _scoped(quotas, "tenant")

    @field_validator("namespace_quotas")
    @classmethod
    def _namespace_digests(cls, quotas: dict[str, ByteSize]) -> dict[str, ByteSize]:
        return _scoped(quotas, "namespace")

    @property
    def quotas(self) -> dict[QuotaScope, int]:
        """The quotas of ``tenant_quotas`` and ``namespace_quotas``, by scope."""
        scoped: list[tuple[ScopeKind, dict[str, ByteSize]]] = [
            ("tenant", self.tenant_quotas),
            ("namespace", self.namespace_quotas),
        ]
        return {QuotaScope(kind, i): int(limit) for kind, quotas in scoped for i, limit in quotas.items()}

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _host_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, hosts: list[str]) -> list[str]:
        for host in hosts:
            if not re.fullmatch(r"(\*\.)?[A-Za-z0-9_.\-]+|\[?[0-9A-Fa-f:.]+\]?", host):
                raise ValueError(f"{host!r} is not a host name (a name, an address, or *.domain)")
        return [host.lower() for host in hosts]

    @field_validator("warmup_roots", mode="before")
    @classmethod
    def _path_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(os.pathsep) if part]
        return value

    @field_validator("warmup_roots")
    @classmethod
    def _absolute_folders(cls, roots: list[Path]) -> list[Path]:
        for root in roots:
            if not root.is_absolute():
                raise ValueError(f"{str(root)!r} is not an absolute path")
            if not root.is_dir():
                raise ValueError(f"{str(root)!r} is not a folder")
        return [root.resolve() for root in roots]

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, url: str | None) -> str | None:
        if url is not None:
            try:
                check_redis_url(url)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return url

    @field_validator("cpus")
    @classmethod
    def _cpu_list(cls, text: str | None) -> str | None:
        if text is not None:
            missing = cpu_list(text) - allowed_cpus()
            if missing:
                raise ValueError(
                    f"CPUs {format_cpu_list(missing)} are not available to this process "
                    f"(it may run on {format_cpu_list(allowed_cpus())})"
                )
        return text

    @property
    def cpu_set(self) -> frozenset[int] | None:
        return cpu_list(self.cpus) if self.cpus is not None else None

    @field_validator("admin_token")
    @classmethod
    def _long_enough(cls, token: SecretStr | None) -> SecretStr | None:
        if token is not None and len(token.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters (a guessable token is no protection)")
        return token

    @field_validator("mooncake_master")
    @classmethod
    def _host_port(cls, address: str | None) -> str | None:
        if address is not None and address.startswith(ETCD_SCHEME):
            try:
                EtcdMasters.parse(address)
            except ValueError as exc:
                raise ValueError(f"{exc} (got {address!r})") from None
        elif address is not None and not _is_host_port(address):
            raise ValueError(
                f"must look like host:port, or etcd://host:port[;host:port...][/cluster_id] for masters in "
                f"high-availability mode (got {address!r})"
            )
        return address

    @field_validator("mooncake_metrics_url")
    @classmethod
    def _http_urls(cls, urls: str | None) -> str | None:
        if urls is not None:
            for url in urls.split(","):
                if not re.fullmatch(r"https?://[^\s,/]+(/\S*)?", url.strip()):
                    raise ValueError(f"{url.strip()!r} is not an http:// or https:// URL")
        return urls

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_endpoint(cls, endpoint: str | None) -> str | None:
        if endpoint is not None:
            scheme, sep, address = endpoint.partition("://")
            host, _, port = address.rpartition(":")
            tcp_ok = bool(host) and port.isdigit() and 0 < int(port) < 65536
            if not sep or scheme not in ("tcp", "ipc") or not address or (scheme == "tcp" and not tcp_ok):
                raise ValueError(f"must look like tcp://HOST:PORT or ipc://PATH (got {endpoint!r})")
            if scheme == "tcp" and host == "*":
                raise ValueError(
                    f"{endpoint} would publish every cached chunk's token ids on every interface: name "
                    f"the address routers reach (tcp://127.0.0.1:{port}, this node's own address, or "
                    f"tcp://0.0.0.0:{port} if every interface is meant)"
                )
        return endpoint

    @property
    def kv_events_tcp_addresses(self) -> list[tuple[str, int]]:
        """(host, port) each ``tcp://`` KV-events endpoint binds (brackets of an IPv6 host taken off)."""
        addresses = []
        for endpoint in (self.kv_events_endpoint, self.kv_events_replay_endpoint):
            if endpoint is not None and endpoint.startswith("tcp://"):
                host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
                addresses.append((host.strip("[]"), int(port)))
        return addresses

    @field_validator("object_store_url")
    @classmethod
    def _bucket_url(cls, url: str | None) -> str | None:
        if url is not None and not re.fullmatch(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/[^?#@]*)?", url):
            raise ValueError(
                "must be s3://BUCKET or s3://BUCKET/PREFIX (a bucket name: 3 to 63 lowercase letters, digits, dots "
                "and hyphens), without credentials, query or fragment"
            )
        return url

    @field_validator("object_store_endpoint")
    @classmethod
    def _endpoint_url(cls, url: str | None) -> str | None:
        if url is not None and not re.fullmatch(r"https?://[^@/?#]+/?", url):
            raise ValueError("must be http(s)://HOST[:PORT], without credentials (the AWS chain gives those) or a path")
        return url

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.dram_low_watermark >= self.dram_high_watermark:
            raise ValueError("dram_low_watermark must be below dram_high_watermark")
        if self.mooncake_master and not self.mooncake_metadata_url and self.mooncake_ha is None:
            raise ValueError("mooncake_metadata_url is required with an external mooncake_master")
        if len(self.mooncake_metrics_urls) > 1 and self.mooncake_ha is None:
            raise ValueError("mooncake_metrics_url names several masters: that takes an etcd:// mooncake_master")
        if self.nvme_bytes < 2 * NVME_PACK_FILE_BYTES:
            raise ValueError(f"nvme_bytes must be at least {2 * NVME_PACK_FILE_BYTES >> 20} MiB (two pack files)")
        if self.port + 6 > 65535:
            raise ValueError("port must leave room for the six ports after it (PORT+1..PORT+6)")
        if self.dram_bytes < 64 << 20:
            raise ValueError("dram_bytes must be at least 64 MiB")
        return self

    @property
    def embedded_redis(self) -> bool:
        return self.redis_url is None

    @property
    def embedded_mooncake(self) -> bool:
        return self.mooncake_master is None

    @property
    def mooncake_ha(self) -> EtcdMasters | None:
        """The masters in high-availability mode that ``mooncake_master`` names (None: one master, or embedded)."""
        master = self.mooncake_master
        return EtcdMasters.parse(master) if master and master.startswith(ETCD_SCHEME) else None

    @property
    def mooncake_metrics_urls(self) -> list[str]:
        """``mooncake_metrics_url``'s URLs, one per master."""
        return [url.strip() for url in (self.mooncake_metrics_url or "").split(",") if url.strip()]

    def derived_port(self, name: str) -> int:
        """A fixed port per role (PORT+1..PORT+6 unless set), so clients reconnect to a restarted daemon."""
        offsets = {
            "redis_port": 1,
            "shm_port": 2,
            "segment_port": 3,
            "master_port": 4,
            "metadata_port": 5,
            "metrics_port": 6,
        }
        explicit = getattr(self, name, None)
        return explicit or self.port + offsets[name]

    @property
    def nvme_path(self) -> Path:
        return self.nvme_dir or self.data_dir / "nvme"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Flags (init kwargs) beat the environment, which beats the config file (passed as
        # ``_file_values`` through ``load``), which beats defaults.
        return (init_settings, env_settings)


class IndexSecrets(BaseSettings):
    """The index's password, from the environment only (``PREFIXCACHE_REDIS_PASSWORD``; never a flag, which other
    users of the host can read, nor the daemon's config file): the one place it is read, for the daemon's warm-up
    jobs, ``prefixcache warmup`` and ``prefixcache proxy``. A password in the index's URL comes first."""

    model_config = SettingsConfigDict(env_prefix="PREFIXCACHE_", extra="ignore")

    redis_password: SecretStr | None = None


def redis_password_from_environment() -> str | None:
    """``PREFIXCACHE_REDIS_PASSWORD``, or None where it is unset or empty."""
    secret = IndexSecrets().redis_password
    return (secret.get_secret_value() or None) if secret is not None else None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a TOML or JSON config file into a dict, with errors that name the file."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table/object of settings")
    return data


def load_settings(flags: dict[str, Any], config_file: Path | None = None) -> Settings:
    """Build Settings from flags (only those given), the environment and an optional config file."""
    file_values = read_config_file(config_file) if config_file else {}
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        from_env_and_flags = Settings(**given)
        explicit = from_env_and_flags.model_fields_set
        merged = {**file_values, **{k: getattr(from_env_and_flags, k) for k in explicit}}
        return Settings.model_validate(merged) if file_values else from_env_and_flags
    except ValidationError as exc:
        raise ConfigError(_describe(exc, config_file)) from None


#: Fields whose values may carry credentials: never echoed in errors.
_SECRET_FIELDS = frozenset({"redis_url", "admin_token", "object_store_url", "object_store_endpoint"})


def _describe(exc: ValidationError, config_file: Path | None) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        if err["type"] == "value_error":
            err["msg"] = err["msg"].removeprefix("Value error, ")
        value = err.get("input")
        quiet = isinstance(value, dict) or field in _SECRET_FIELDS or "(got " in err["msg"]
        shown = "" if quiet else f" (got {value!r})"
        lines.append(f"invalid setting {field}: {err['msg']}{shown}")
    where = f" [flags, PREFIXCACHE_* environment or {config_file}]" if config_file else ""
    return "; ".join(lines) + where
