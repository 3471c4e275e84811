"""What the scheduler side tells the worker side each step (pickled between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from prefixcache.cachestore.client.node_requests import ExtentsAsked


@dataclass
class LoadChunk:
    """Load pages ``first_page ..`` of stored chunk ``key`` (holding ``stored_tokens``) into ``blocks``;
    ``in_dram``: False when the lookup found the chunk on NVMe alone (its read starts there at once);
    ``ends_mid_block``: the load ends inside its last block, where vLLM writes the step's first computed
    tokens, layer by layer before each attention layer waits for its KV, so the block must be in first;
    ``remote``: its DRAM copies lie on other nodes only, so its read crosses the network and has a deadline (into
    arena slots, never straight into the pages: a read abandoned at its deadline may still write later)."""

    key: bytes
    stored_tokens: int
    first_page: int
    blocks: list[int]
    in_dram: bool = True
    ends_mid_block: bool = False
    remote: bool = False


@dataclass
class SaveChunk:
    """Publish pages ``blocks`` of request ``request`` as the chunk of ``tokens`` (packed uint32) after
    ``parents[shard]`` (a media parent where media begin in the chunk): each rank of the engine (its
    ``NamespaceSpec.shard``: pipeline stage, then tensor-parallel rank) stores its shard of the pages in its
    own key chain, from the root of the request's tenant and variant (connector/request_identity.py)."""

    request: str
    parents: list[bytes]
    tokens: bytes
    blocks: list[int]
    tenant_salt: str | None
    variant: bytes = b""


@dataclass
class PrefixCacheMetadata(KVConnectorMetadata):
    """``loads[shard][request]``: the chunks a rank loads for a request (the same tokens and blocks on every
    rank, each rank its own keys); ``saves``: the chunks every rank publishes.

    ``load_early``: the worker may start the loads at the first hook of the step (``handle_preemptions``),
    before vLLM prepares the step, because vLLM itself writes none of their blocks first (no zeroing,
    no copy-on-write into them).

    ``load_async``: requests of ``loads`` that vLLM holds in ``WAITING_FOR_REMOTE_KVS`` while they load:
    the worker loads them on a thread of its own and reports each in ``finished_recving`` once its pages
    are in and verified (connector/load_policy.py says which).

    ``extents_asked``: requests to this node's daemon for where its NVMe tier holds the synchronous loads' chunks that
    the lookup found there alone, sent as the loads were planned; the worker takes the answers of its shard's
    (``CacheClient.disk_extents``).

    ``finished``: requests that have finished, whose ``saves`` (what they generated) are copied out of blocks that
    vLLM keeps until every worker has reported the request in ``finished_sending``."""

    loads: list[dict[str, list[LoadChunk]]] = field(default_factory=list)
    saves: list[SaveChunk] = field(default_factory=list)
    load_early: bool = False
    load_async: set[str] = field(default_factory=set)
    extents_asked: list[ExtentsAsked] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)

    def loads_of(self, shard: int, *, asynchronous: bool = False) -> dict[str, list[LoadChunk]]:
        """Shard ``shard``'s loads of this step that are synchronous (or, with ``asynchronous``, the others)."""
        loads = self.loads[shard] if self.loads else {}
        return {req: chunks for req, chunks in loads.items() if (req in self.load_async) == asynchronous}
