"""``ProxySettings``: what ``prefixcache proxy`` runs with, each setting described once (its ``Field``).

Kept apart from the proxy's server so that the settings reference (docs/settings.md) and the command's help
read them without importing a web framework.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from prefixcache.indexer.errors import ConfigError, validation_problems

#: Where the proxy reads its secrets: never from flags, which other users of the host can see.
AUTH_TOKEN_ENV = "PREFIXCACHE_PROXY_TOKEN"
REDIS_PASSWORD_ENV = "PREFIXCACHE_REDIS_PASSWORD"


class ProxySettings(BaseModel):
    """What ``prefixcache proxy`` runs with. Every URL is checked before anything starts."""

    model_config = ConfigDict(extra="forbid")

    prefill: list[str] = Field(
        json_schema_extra={"short": "A prefill instance's URL"},
        min_length=1,
        description="prefill instances (vLLM with a `kv_producer` connector), as `http://HOST:PORT`; repeat the "
        "flag or separate them with commas",
    )
    decode: list[str] = Field(
        json_schema_extra={"short": "A decode instance's URL"},
        min_length=1,
        description="decode instances (vLLM with a `kv_consumer` or `kv_both` connector), as `http://HOST:PORT`; "
        "repeat the flag or separate them with commas",
    )
    host: str = Field(
        json_schema_extra={"short": "Address to bind"}, default="127.0.0.1", description="address the proxy binds to"
    )
    port: int = Field(
        json_schema_extra={"short": "Port to listen on"},
        default=8000,
        ge=1,
        le=65535,
        description="port the proxy listens on",
    )
    routing: Literal["round-robin", "cache-aware"] = Field(
        json_schema_extra={"short": "Routing policy"},
        default="round-robin",
        description="`round-robin`, or `cache-aware`: ask the index how much of the prompt is cached and skip the "
        "prefill step where it could add nothing (needs `service_url`)",
    )
    service_url: str | None = Field(
        json_schema_extra={"short": "A daemon, for cache-aware routing"},
        default=None,
        description="a prefixcache daemon, for cache-aware routing",
    )
    redis_password: str | None = Field(
        default=None,
        description="the index's password, for cache-aware routing where the daemon's password file cannot be "
        "read; never logged",
    )
    timeout_s: float = Field(
        json_schema_extra={"short": "Request timeout, s"},
        default=600.0,
        gt=0,
        description="longest a request to an instance may take, seconds",
    )
    publish_wait_s: float = Field(
        json_schema_extra={"short": "Wait for prefill chunks, s"},
        default=2.0,
        ge=0,
        description="cache-aware: how long to wait for a prefill's chunks to appear in the index, seconds",
    )
    retry_after_s: float = Field(
        json_schema_extra={"short": "Failed instance last for, s"},
        default=10.0,
        gt=0,
        description="a failed instance is tried last for this long, seconds",
    )
    auth_token: SecretStr | None = Field(
        default=None,
        min_length=16,
        description="bearer token every request but `/health` needs; unset: none (the instances may still check "
        "theirs: the client's `Authorization` header is forwarded)",
    )

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _split(cls, urls: object) -> object:
        """``--prefill A,B`` and ``--prefill A --prefill B`` mean the same."""
        if isinstance(urls, str):
            urls = [urls]
        if isinstance(urls, list):
            return [u.strip() for url in urls for u in str(url).split(",") if u.strip()]
        return urls

    @field_validator("prefill", "decode", "service_url")
    @classmethod
    def _http_urls(cls, urls: list[str] | str | None) -> list[str] | str | None:
        for url in [urls] if isinstance(urls, str) else urls or []:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
                raise ValueError(f"must look like http://HOST:PORT (got {url!r})")
        if isinstance(urls, list):
            return [u.rstrip("/") for u in urls]
        return urls.rstrip("/") if urls else urls

    @model_validator(mode="after")
    def _cache_aware_needs_the_index(self) -> ProxySettings:
        if self.routing == "cache-aware" and not self.service_url:
            raise ValueError("routing cache-aware needs --service-url (a prefixcache daemon, for the index)")
        return self

    @classmethod
    def parse(cls, values: dict[str, Any]) -> ProxySettings:
        try:
            return cls.model_validate({k: v for k, v in values.items() if v is not None})
        except ValidationError as exc:
            raise ConfigError(f"invalid proxy setting {validation_problems(exc, 'settings')}") from None
