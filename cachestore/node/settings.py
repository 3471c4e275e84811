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
from pathlib import Path
from typing import Annotated, Any, Literal

from prefixcache.cachestore.host.cpus import allowed_cpus, cpu_list, format_cpu_list
from prefixcache.indexer.chunking import DEFAULT_CHUNK_TOKENS, MAX_CHUNK_TOKENS
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.redis_clients import redact_url
from pydantic import ByteSize, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

#: Size of one NVMe segment file: large sequential writes, and the unit compaction works in.
NVME_SEGMENT_BYTES = 256 << 20
#: Largest request body the REST API reads by default (a 1M-token prompt as JSON is about 8 MB).
DEFAULT_MAX_BODY_BYTES = 16 << 20


def default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "prefixcache"


class Settings(BaseSettings):
    """Everything ``prefixcache serve`` needs. Unknown keys in a file or flags are errors, not ignored."""

    model_config = SettingsConfigDict(env_prefix="PREFIXCACHE_", extra="forbid", validate_default=True)

    host: str = Field(default="127.0.0.1", description="address the REST API binds to (loopback unless told)")
    port: int = Field(default=8600, ge=1, le=65535, description="REST API port")
    data_dir: Path = Field(
        default_factory=default_data_dir, description="where the NVMe tier and embedded servers keep files"
    )
    node: str = Field(default_factory=socket.gethostname, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.\-]+$")
    redis_url: str | None = Field(default=None, description="shared index; unset: start an embedded redis-server")
    redis_port: int | None = Field(default=None, ge=1, le=65535, description="embedded redis-server [default: port+1]")
    key_prefix: str = Field(default="pc", min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_.\-]+$")
    chunk_tokens: int = Field(default=DEFAULT_CHUNK_TOKENS, gt=0, le=MAX_CHUNK_TOKENS)

    dram_bytes: ByteSize = Field(default=ByteSize(2 << 30), description="DRAM this node adds to the Mooncake pool")
    nvme_bytes: ByteSize = Field(default=ByteSize(16 << 30), description="capacity of this node's NVMe tier")
    nvme_dir: Path | None = Field(default=None, description="NVMe tier directory [default: <data_dir>/nvme]")
    dram_high_watermark: float = Field(default=0.85, gt=0, lt=1, description="demote DRAM above this fill")
    dram_low_watermark: float = Field(default=0.70, gt=0, lt=1, description="demote DRAM down to this fill")
    write_behind_hold_s: float = Field(
        default=0.25,
        ge=0,
        le=10,
        description="seconds a chunk stays in DRAM alone before the write-behind copies it "
        "to NVMe, so that its first reads (a decode instance's, right after a prefill instance publishes) do not "
        "share the node with that copy (cachestore/services/write_behind.py); 0: at once",
    )

    mooncake_master: str | None = Field(default=None, description="host:port of the master; unset: embedded")
    mooncake_metadata_url: str | None = Field(default=None, description="Mooncake metadata server (http/etcd/redis)")
    mooncake_metrics_url: str | None = Field(default=None, description="master's /metrics (external master)")
    mooncake_host: str = Field(default="127.0.0.1", description="this node's address in the Mooncake pool")
    mooncake_protocol: Literal["tcp", "rdma"] = "tcp"
    mooncake_device_names: str = Field(default="", description="RDMA NICs, e.g. mlx5_0,mlx5_1")
    shm_port: int | None = Field(
        default=None, ge=1, le=65535, description="local clients attach here [default: port+2]"
    )
    segment_port: int | None = Field(default=None, ge=1, le=65535, description="names this node's segment [port+3]")
    master_port: int | None = Field(default=None, ge=1, le=65535, description="embedded master RPC [port+4]")
    chunk_key_file: Path | None = Field(
        default=None,
        description="file holding the key every chunk is signed with (64 hex digits), the same on every "
        "node of a cluster; unset: <data_dir>/secrets/chunk-key, generated at first start",
    )
    admin_token: SecretStr | None = Field(
        default=None,
        description="bearer token mutating (and, unless open_reads, reading) calls need; unset: "
        "generated at first start into DATA_DIR/secrets/admin-token (0600)",
    )
    open_reads: bool = Field(default=False, description="read-only endpoints answer without the admin token")
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default=[],
        description="Host header names the REST API answers besides localhost, 127.0.0.1, ::1, host "
        "and node (comma-separated in the environment)",
    )
    max_body_bytes: ByteSize = Field(
        default=ByteSize(DEFAULT_MAX_BODY_BYTES), ge=1024, description="larger request bodies get 413, unread"
    )
    warmup_roots: Annotated[list[Path], NoDecode] = Field(
        default=[],
        description="folders the models, tokenizers and corpora of POST /v1/warmup must lie in "
        "(':'-separated in the environment); none: warm-up jobs are refused",
    )
    warmup_allow_trust_remote_code: bool = Field(
        default=False, description="POST /v1/warmup may pass --trust-remote-code (runs the model's own code)"
    )
    kv_events_endpoint: str | None = Field(
        default=None,
        description="ZMQ PUB endpoint for vLLM-format KV events (they carry every chunk's token ids), "
        "e.g. tcp://127.0.0.1:5557 or the node's address; tcp://* is refused; unset: off",
    )
    kv_events_topic: str = Field(default="", description="topic frame of every KV-event message")
    cpus: str | None = Field(
        default=None,
        description="CPUs the daemon and its servers run on, e.g. the cores vLLM reserves: '1' or "
        "'2-3,6'; unset: wherever the OS puts them (cachestore/host/cpus.py)",
    )
    owner_nice: int = Field(
        default=-10,
        ge=-20,
        le=19,
        description="CPU priority (nice) of the segment owner, which copies every "
        "DRAM hit into vLLM's pages beside vLLM's busy-polling engine core; below 0 needs CAP_SYS_NICE "
        "(cachestore/tiers/owner_priority.py)",
    )

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
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"must start with redis://, rediss:// or unix:// (got {redact_url(url)!r})")
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
        if address is not None:
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"must look like host:port (got {address!r})")
        return address

    @field_validator("kv_events_endpoint")
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
    def kv_events_tcp_address(self) -> tuple[str, int] | None:
        """(host, port) a ``tcp://`` KV-events endpoint binds (brackets of an IPv6 host taken off); None otherwise."""
        if self.kv_events_endpoint is None or not self.kv_events_endpoint.startswith("tcp://"):
            return None
        host, _, port = self.kv_events_endpoint.removeprefix("tcp://").rpartition(":")
        return host.strip("[]"), int(port)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.dram_low_watermark >= self.dram_high_watermark:
            raise ValueError("dram_low_watermark must be below dram_high_watermark")
        if self.mooncake_master and not self.mooncake_metadata_url:
            raise ValueError("mooncake_metadata_url is required with an external mooncake_master")
        if self.nvme_bytes < 2 * NVME_SEGMENT_BYTES:
            raise ValueError(f"nvme_bytes must be at least {2 * NVME_SEGMENT_BYTES >> 20} MiB (two segments)")
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
_SECRET_FIELDS = frozenset({"redis_url", "admin_token"})


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
