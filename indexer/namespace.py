"""Namespaces: everything that makes two KV caches byte-incompatible, folded into one digest.

A chunk key chains from its namespace's root digest, so KV computed under another model, weight
set, dtype, layout, chunk size or parallel rank can never be found, let alone loaded: a mismatch
costs hits, never correctness. Because a silent 0% hit rate is the most common complaint about KV
stores, the index also keeps each namespace's full description and the client names the fields
that differ when it finds only foreign namespaces for its model (see ``mismatched_fields``).
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from pydantic import BaseModel, ConfigDict, Field

#: Version of the key scheme itself (key chaining, token packing, probe size). Bumping it moves
#: every namespace, so old entries stop matching instead of being misread.
KEY_SCHEME_VERSION = 1


class NamespaceSpec(BaseModel):
    """The description of one KV namespace. Two processes with equal specs produce equal keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, description="model name as served (e.g. the HF repo id)")
    model_fingerprint: str = Field(min_length=1, description="digest of the weights and config files")
    kv_dtype: str = Field(min_length=1, description="dtype of the stored KV, e.g. bfloat16")
    kv_layout: str = Field(min_length=1, description="layout version of a stored chunk's payload")
    chunk_tokens: int = Field(gt=0, description="tokens per chunk")
    tp_rank: int = Field(default=0, ge=0)
    tp_size: int = Field(default=1, ge=1)
    pp_rank: int = Field(default=0, ge=0)
    pp_size: int = Field(default=1, ge=1)
    key_scheme: int = Field(default=KEY_SCHEME_VERSION, ge=1)

    def canonical_json(self) -> str:
        """The byte-stable text the digest is computed over (sorted keys, no whitespace)."""
        return json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> bytes:
        """16-byte xxh3-128 digest of the canonical description."""
        return xxhash.xxh3_128_digest(self.canonical_json().encode())

    @property
    def shard(self) -> int:
        """This rank's place among its engine's shards: pipeline stage first, then tensor-parallel rank."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def shards(self) -> list[NamespaceSpec]:
        """This namespace as each rank of its engine has it, in ``shard`` order. A pipeline stage holds its
        layers' KV and a tensor-parallel rank its heads of those, and each rank stores its shard of the pages
        in a namespace of its own. Stages of equal ``pp_size`` hold the same layers whenever their payloads
        are the same size (vLLM splits the layers into contiguous runs), and an object of another size is
        refused when it is read: a different split costs hits, never correctness."""
        return [
            self.model_copy(update={"pp_rank": stage, "tp_rank": rank})
            for stage in range(self.pp_size)
            for rank in range(self.tp_size)
        ]

    def root(self, tenant_salt: str | None = None, variant: bytes = b"") -> bytes:
        """The parent digest of a prompt's first chunk.

        A tenant salt (vLLM's ``cache_salt``) gives each tenant a disjoint key space inside the same
        namespace; it is not part of the registered description, so it is never stored or shown. A
        variant does the same for what else decides a request's KV besides its tokens: its LoRA adapter
        and multimodal inputs (connector/request_identity.py).
        """
        root = self.digest
        if tenant_salt:
            root = xxhash.xxh3_128_digest(root + b"\x00tenant\x00" + tenant_salt.encode())
        if variant:
            root = xxhash.xxh3_128_digest(root + b"\x00variant\x00" + variant)
        return root


def tenant_id(tenant_salt: str | None) -> str:
    """A short, non-reversible id for a tenant salt, safe to store and display ("" for no tenant)."""
    if not tenant_salt:
        return ""
    return xxhash.xxh3_64_hexdigest(b"tenant\x00" + tenant_salt.encode())


def mismatched_fields(ours: NamespaceSpec, theirs: NamespaceSpec) -> dict[str, tuple[Any, Any]]:
    """Fields whose values differ, as ``{field: (ours, theirs)}``."""
    a, b = ours.model_dump(), theirs.model_dump()
    return {name: (a[name], b[name]) for name in a if a[name] != b[name]}


def same_model(ours: NamespaceSpec, theirs: NamespaceSpec) -> bool:
    """Whether two namespaces describe the same model by name or by weights (the ones worth comparing)."""
    return ours.model == theirs.model or ours.model_fingerprint == theirs.model_fingerprint


def describe_mismatch(ours: NamespaceSpec, others: list[NamespaceSpec]) -> str:
    """One log line saying why this client will get no hits from namespaces registered for its model."""
    parts = []
    for other in others:
        diffs = ", ".join(f"{f}: ours={a!r} theirs={b!r}" for f, (a, b) in mismatched_fields(ours, other).items())
        parts.append(f"{other.digest.hex()[:12]} ({diffs})")
    return (
        f"prefixcache: namespace {ours.digest.hex()[:12]} of model {ours.model!r} is new; "
        f"{len(others)} namespace(s) registered for this model differ, so their chunks will not hit: "
        + "; ".join(parts)
    )
