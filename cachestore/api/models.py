"""Bodies and answers of the admin API (``/v1/namespaces``, ``/v1/lookup``, ``/v1/chunks``, ``/v1/evict``,
``/v1/pin``, ``/v1/unpin``, ``/v1/quotas``). Every limit a client could exceed is declared here, so a bad body is a 422
that names the field before any work starts."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field, StringConstraints, model_validator

from prefixcache.indexer.index import NamespaceUsage, Tier, Usage
from prefixcache.indexer.namespace import NamespaceSpec

#: Longest prompt a lookup, eviction or pin may name (a 1M-token context; ~8 MB of JSON).
MAX_PROMPT_TOKENS = 1 << 20
MAX_TEXT_CHARS = 4 << 20
#: Keys one request may name, and entries one page may list.
MAX_KEYS = 10_000
MAX_PAGE = 1000
#: Keys an answer quotes as examples (dry runs, evictions).
SAMPLE_KEYS = 20
MAX_TTL_S = 10 * 365 * 86400
#: Smallest chunk a spec given in a request may have: the work of a lookup, eviction or pin grows with the
#: chunks of its prompt (a 1M-token prompt in 1-token chunks is a million keys; in 16-token chunks 65,536).
MIN_SPEC_CHUNK_TOKENS = 16

HexDigest = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{32}$", to_lower=True)]
TenantId = Annotated[str, StringConstraints(pattern=r"^([0-9a-f]{16}|none)$")]
TokenId = Annotated[int, Field(ge=0, le=2**32 - 1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NamespaceRef(Strict):
    """A namespace: the digest of a registered one, or its full description (model and settings)."""

    namespace: HexDigest | None = Field(default=None, description="digest of a registered namespace (32 hex)")
    spec: NamespaceSpec | None = Field(default=None, description="model and settings; need not be registered")
    cache_salt: str | None = Field(
        default=None, min_length=1, max_length=1024, description="vLLM cache_salt of the tenant; never stored or shown"
    )

    @model_validator(mode="after")
    def _one_namespace(self) -> NamespaceRef:
        if (self.namespace is None) == (self.spec is None):
            raise ValueError("give exactly one of namespace (a registered digest) or spec (model and settings)")
        if self.spec is not None and self.spec.chunk_tokens < MIN_SPEC_CHUNK_TOKENS:
            raise ValueError(f"spec.chunk_tokens must be at least {MIN_SPEC_CHUNK_TOKENS}")
        return self


class PromptRef(NamespaceRef):
    """A prompt prefix in a namespace, as token ids or as text for that model's tokenizer."""

    token_ids: list[TokenId] | None = Field(default=None, min_length=1, max_length=MAX_PROMPT_TOKENS)
    text: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        description="tokenized with the namespace's model tokenizer when it is installed on this node",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> PromptRef:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("give exactly one of token_ids or text")
        return self


class Selector(Strict):
    """Entries by their attributes; every given condition must hold."""

    namespace: HexDigest | None = None
    model: str | None = Field(default=None, min_length=1, max_length=512, description="every namespace of this model")
    tenant: TenantId | None = Field(default=None, description="tenant id as listed (16 hex), or 'none'")
    tier: Tier | None = Field(default=None, description="has a copy in this tier")
    pinned: bool | None = None
    older_than_s: float | None = Field(default=None, ge=0, le=1e10, description="created more than this ago")
    newer_than_s: float | None = Field(default=None, ge=0, le=1e10, description="created less than this ago")
    min_hits: int | None = Field(default=None, ge=0, le=2**62)


class EvictRequest(Strict):
    """What to evict: exactly one of keys, prefix, where or all."""

    keys: list[HexDigest] | None = Field(default=None, min_length=1, max_length=MAX_KEYS)
    prefix: PromptRef | None = Field(default=None, description="the prefix's chunks and every chunk below them")
    where: Selector | None = None
    all: bool = False
    force: bool = Field(default=False, description="evict pinned chunks too")
    dry_run: bool = Field(default=False, description="report what would be removed, remove nothing")

    @model_validator(mode="after")
    def _one_target(self) -> EvictRequest:
        if sum((self.keys is not None, self.prefix is not None, self.where is not None, self.all)) != 1:
            raise ValueError("give exactly one of keys, prefix, where or all=true")
        return self


class PinRequest(Strict):
    """Chunks to pin or unpin: exactly one of keys or prefix (the chunks a lookup of it would load)."""

    keys: list[HexDigest] | None = Field(default=None, min_length=1, max_length=MAX_KEYS)
    prefix: PromptRef | None = None
    ttl_s: float | None = Field(
        default=None, gt=0, le=MAX_TTL_S, description="pin: for this long; unset: until unpinned"
    )

    @model_validator(mode="after")
    def _one_target(self) -> PinRequest:
        if (self.keys is None) == (self.prefix is None):
            raise ValueError("give exactly one of keys or prefix")
        return self


class Chunk(BaseModel):
    key: str
    namespace: str
    tenant: str = Field(description="tenant id (16 hex), empty without a tenant")
    parent: str
    tokens: int
    bytes: int
    locations: list[str]
    tiers: list[Tier]
    created_s: float
    last_access_s: float
    hits: int
    pinned: bool
    pinned_until_s: float | None = Field(description="unset while pinned until unpinned, or not pinned")


class ChunkPage(BaseModel):
    chunks: list[Chunk]
    next_cursor: str | None = Field(description="pass as cursor for the next page; unset after the last one")


class LookupChunk(BaseModel):
    key: str
    matched_tokens: int
    stored_tokens: int
    tiers: list[Tier]
    locations: list[str]


class Lookup(BaseModel):
    namespace: str
    requested_tokens: int
    matched_tokens: int
    matched_chunks: int
    chunks: list[LookupChunk]


class NamespaceInfo(BaseModel):
    namespace: str
    spec: NamespaceSpec
    chunks: int
    bytes: int
    tiers: dict[Tier, Usage]


class EvictResult(BaseModel):
    dry_run: bool
    chunks: int = Field(description="chunks removed (would be removed, in a dry run) from every tier and the index")
    bytes: int
    pinned_skipped: int
    kept_elsewhere: int = Field(
        description="lost their copies here, but copies remain on other nodes: those of pending_nodes have the "
        "order queued and delete them when their daemons next run, unless pinned by then; any other holder could "
        "not delete them yet (retry)"
    )
    failed: int = Field(description="untouched because the DRAM tier did not answer; retry")
    pending_nodes: list[str] = Field(
        default_factory=list, description="nodes that did not confirm their part of the eviction in time"
    )
    sample_keys: list[str]


class PinResult(BaseModel):
    chunks: int = Field(description="chunks that exist and were (un)pinned")
    pinned_until_s: float | None
    keys: list[str]


class QuotaRequest(Strict):
    limit_bytes: ByteSize = Field(
        ge=0, le=2**62, description="bytes the scope may hold: a number, or a size such as '8GiB' (0: nothing)"
    )


class Quota(BaseModel):
    scope: Literal["tenant", "namespace"]
    id: str = Field(description="tenant id (16 hex, or 'none') or namespace digest (32 hex)")
    limit_bytes: int
    source: Literal["api", "settings", "default"] = Field(
        description="api: set through /v1/quotas; settings: tenant_quotas or namespace_quotas; default: "
        "default_tenant_quota"
    )
    used_chunks: int
    used_bytes: int = Field(description="bytes of the scope's chunks, each counted once, pinned ones included")
    at_quota: bool = Field(description="publishes of the scope are skipped until it is below its quota again")
    evicted_chunks: int = Field(description="chunks this node evicted to keep the scope within its quota")


def tier_use(held: NamespaceUsage | None) -> dict[Tier, Usage]:
    """A namespace's copies per tier, as answers show them."""
    return dict(held.tiers) if held else {}
