"""What the scheduler side tells the worker side each step (pickled between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadChunk:
    """Load pages ``first_page ..`` of stored chunk ``key`` (holding ``stored_tokens``) into ``blocks``;
    ``in_dram``: False when the lookup found the chunk on NVMe alone (its read starts there at once)."""

    key: bytes
    stored_tokens: int
    first_page: int
    blocks: list[int]
    in_dram: bool = True


@dataclass
class SaveChunk:
    """Publish pages ``blocks`` of request ``request`` as the chunk of ``tokens`` (packed uint32) after
    ``parents[rank]``: each tensor-parallel rank stores its shard of the pages in its own key chain, from
    the root of the request's tenant and variant (connector/request_identity.py)."""

    request: str
    parents: list[bytes]
    tokens: bytes
    blocks: list[int]
    tenant_salt: str | None
    variant: bytes = b""


@dataclass
class PrefixCacheMetadata(KVConnectorMetadata):
    """``loads[rank][request]``: the chunks a tensor-parallel rank loads for a request (the same tokens and
    blocks on every rank, each rank its own keys); ``saves``: the chunks every rank publishes.

    ``load_early``: the worker may start the loads at the first hook of the step (``handle_preemptions``),
    before vLLM prepares the step, because vLLM itself writes none of their blocks first (no zeroing,
    no copy-on-write into them)."""

    loads: list[dict[str, list[LoadChunk]]] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)
    load_early: bool = False

    def loads_of(self, rank: int) -> dict[str, list[LoadChunk]]:
        return self.loads[rank] if self.loads else {}
