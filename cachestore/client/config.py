"""What a client attaches to a node with: the daemon's answer to ``GET /v1/config``, and what follows from it.

Connectors, warm-up jobs and the proxy ask a node's daemon once, at start, how to attach (``fetch_config``): the
index's address, Mooncake's, and where the node keeps the files of its secrets. The answer never holds a secret;
``index_url`` and ``chunk_mac_key`` read the ones a client on the daemon's host needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import httpx
from pydantic import BaseModel, Field

from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.cachestore.host.secret_files import read_secret
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.redis_clients import with_password


class MooncakeConfig(BaseModel):
    master: str
    metadata_url: str
    protocol: Literal["tcp", "rdma"]
    device_names: str
    #: where local processes attach (``setup_dummy``): this node's segment owner
    shm_address: str
    #: this node's segment, for ``preferred_segment``
    segment: str


class SecretFiles(BaseModel):
    """Where this node keeps its secrets, for clients on its host run as the daemon's user: paths, never values."""

    chunk_key: str | None = Field(default=None, description="the key every chunk is signed with (the cluster secret)")
    redis_password: str | None = Field(default=None, description="the index's password, where it needs one")
    admin_token: str | None = Field(default=None, description="the bearer token admin calls need")


class ClientConfig(BaseModel):
    """What a connector or warm-up job needs to attach to this node. Never holds a secret."""

    node: str
    redis_url: str
    redis_password_required: bool
    key_prefix: str
    chunk_tokens: int
    mooncake: MooncakeConfig
    secret_files: SecretFiles = Field(default_factory=SecretFiles)


def fetch_config(service_url: str, timeout_s: float = 5.0) -> ClientConfig:
    """Ask a node's daemon how to attach (``GET /v1/config``)."""
    try:
        response = httpx.get(service_url.rstrip("/") + "/v1/config", timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot read the attach settings from {service_url}: {exc}") from exc
    return ClientConfig.model_validate(response.json())


def chunk_mac_key(config: ClientConfig, key_file: str | None = None) -> ChunkMacKey:
    """The cluster's chunk-signing key: from ``key_file`` if given, else from the file the daemon names."""
    path = key_file or config.secret_files.chunk_key
    if path is None:
        raise ConfigError(f"node {config.node}'s daemon names no chunk-signing key file; give the client one")
    return ChunkMacKey.read(Path(path))


def index_url(config: ClientConfig, redis_password: str | None = None) -> str:
    """The index URL a client of ``config``'s node connects with (the connector's scheduler and workers, warm-up
    jobs, the proxy): with ``redis_password`` where one is given (a setting), else, where the index needs a
    password, with the one in the file the node names (``secret_files.redis_password``: its embedded
    redis-server's, readable by the daemon's user on its host)."""
    if redis_password:
        return with_password(config.redis_url, redis_password)
    password_file = config.secret_files.redis_password
    if config.redis_password_required and password_file:
        try:
            return with_password(config.redis_url, read_secret(Path(password_file)))
        except ConfigError as exc:
            raise ConfigError(
                f"the index at {config.redis_url} needs a password: {exc} (run as the daemon's "
                "user on its host, or set redis_password)"
            ) from None
    return config.redis_url
