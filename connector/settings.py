"""The connector's settings (``kv_connector_extra_config``) and the namespace its KV lives in."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefixcache.connector.io_threads import IoCpus
from prefixcache.indexer.errors import ConfigError, validation_problems
from prefixcache.indexer.namespace import NamespaceSpec


class ConnectorSettings(BaseModel):
    """Keys of ``kv_connector_extra_config``. Unknown keys are errors, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid")

    service_url: str = Field(
        default="http://127.0.0.1:8600",
        pattern=r"^https?://[^\s/]+",
        description="The node daemon's REST API: the default is a daemon on this host with its default port "
        "(`http://NODE_IP:8600` in a cluster); the connector asks it for the Redis and Mooncake addresses "
        "(`GET /v1/config`).",
    )
    arena_mb: Annotated[int, Field(ge=16, le=1 << 20)] | Literal["auto"] = Field(
        default="auto",
        description="Registered buffer for loads and publishes, in MiB; `auto` sizes it for two steps of "
        "publishes (vLLM's `max_num_batched_tokens`), 512 to 4096 (`arena_mib`). A load larger than its free "
        "room runs in windows, and a step whose publishes do not fit publishes what does: each is warned once. "
        "On a GPU worker it is pinned host memory (`cudaHostRegister`).",
    )
    min_hit_tokens: int = Field(
        default=16,
        ge=1,
        description="External hits shorter than this many tokens are not worth a load: vLLM computes them.",
    )
    publish_output: bool = Field(
        default=True,
        description="Publish, when a request finishes, the KV of the tokens it generated (all but the last, whose KV "
        "no step computed), under the same chained keys as its prompt: the next turn of a conversation, whose prompt "
        "is this one's, the answer and a new message, then loads the answer instead of computing it again. vLLM keeps "
        "the request's blocks one step longer, while their pages are copied out. Only where `kv_role` publishes; a "
        'request sets it for itself (`{"prefixcache": {"publish_output": false}}`), or turns it off with the rest of '
        'its publishing (`{"prefixcache": {"publish": false}}`); `false`: prompts only, unless a request asks.',
    )
    redis_password: str | None = Field(
        default=None,
        description="The index's password, if it needs one (never logged). Unset: the embedded index's, read "
        "from the file the daemon names in `GET /v1/config` (`secret_files.redis_password`), which vLLM can "
        "read when it runs as the daemon's user; set it for a shared index with a password.",
    )
    chunk_key_file: str | None = Field(
        default=None,
        description="The cluster's chunk-signing key file, where this host's path differs from the one the "
        "daemon names in `/v1/config`.",
    )
    io_cpus: IoCpus = Field(
        default="auto",
        description="Cores for the connector's own threads: `auto`, on vLLM's CPU backend, the cores the worker "
        "does not compute on (elsewhere, or with no core to spare, as the worker); `inherit`, as the worker; "
        "or a list of CPU ids (connector/io_threads.py).",
    )
    engine_core_cpus: IoCpus = Field(
        default="auto",
        description="Cores for vLLM's engine core process (its scheduler, which busy-polls for the workers' "
        "output): `auto`, on vLLM's CPU backend, the cores no worker computes on, which vLLM reserves for it but "
        "leaves it free to leave (elsewhere, or with no core to spare, where vLLM puts it); `inherit`, where vLLM "
        "puts it; or a list of CPU ids (connector/engine_core_cpus.py).",
    )
    async_loads: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Whether a hit loads while vLLM keeps stepping the other running requests "
        "(connector/load_policy.py). `auto`: with other requests running, a hit that reads NVMe, or that brings "
        "what the step loads synchronously to `async_load_mib` per rank (a large hit, or the rest of a burst of "
        "small ones), loads asynchronously, and an idle engine loads synchronously, which is faster for the "
        "hit; `always` and `never` force either. Under vLLM's asynchronous scheduling (its default on GPUs) "
        "every hit loads asynchronously and `never` is refused: a synchronous load that fails there stops vLLM "
        "0.32's engine core (docs/connector.md). So it is with vLLM's V2 model runner (its default on "
        "GPUs with Triton), which recomputes a failed synchronous load from stale positions and answers wrongly "
        "(vllm#49250), and with pipeline parallelism, where vLLM runs a step per stage at once. On a model that "
        "takes images (or other media), a hit in which an item ends loads asynchronously too, and `never` is "
        "refused: vLLM sends its worker no data for an item inside a synchronous hit, and a failed load's "
        "recompute then stops the engine core on an encoder cache miss.",
    )
    async_load_mib: int = Field(
        default=64,
        ge=1,
        description="With `async_loads` `auto`: a hit that brings the step's synchronous loads to this size "
        "(MiB per rank) loads asynchronously when other requests are running.",
    )
    check_threads: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        default="auto",
        description="Threads that verify chunks loaded through arena slots (every GPU load) while the next are "
        "copied; 0: the fetch thread checks them; `auto`: 4 on a GPU worker, 0 on a CPU one.",
    )
    kv_in_shared_memory: bool = Field(
        default=True,
        description="CPU backend: vLLM's KV cache is allocated in Mooncake-registered shared memory, so that "
        "DRAM hits are written straight into its pages by the segment owner (each chunk's first quarter of "
        "layers before the forward pass, the rest while it computes those) and verified while the forward pass "
        "runs, and chunks only this node's NVMe holds are read from their pack files straight into the "
        "pages, one layer after another, while the forward pass computes the layers already in (each attention "
        "layer waits for its own). It costs no extra memory; the owner writes every page once at start-up "
        "(in time proportional to the KV cache's size), so that first hits into fresh pages copy at full speed. "
        "`false`: loads go through the arena (connector/shared_kv.py).",
    )

    @classmethod
    def parse(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        try:
            return cls.model_validate(extra or {})
        except ValidationError as exc:
            problems = validation_problems(exc, "config")
            raise ConfigError(f"invalid kv_connector_extra_config for PrefixCacheConnector: {problems}") from None


class Directions(NamedTuple):
    """Which ways an engine's connector moves KV: into vLLM's pages (loads) and out of them (publishes)."""

    loads: bool
    publishes: bool

    @classmethod
    def of_role(cls, kv_role: str) -> Directions:
        """``kv_producer`` publishes only, ``kv_consumer`` loads only, ``kv_both`` does both."""
        return cls(loads=kv_role in ("kv_consumer", "kv_both"), publishes=kv_role in ("kv_producer", "kv_both"))


#: Bounds of an automatically sized arena, in MiB: the floor serves small models well (the tiny test model's
#: hits of 8k tokens are 64 MiB), and the ceiling keeps a huge model from pinning more than 4 GiB unasked.
AUTO_ARENA_MIB = (512, 4096)


def arena_mib(setting: int | Literal["auto"], step_tokens: int, chunk_tokens: int, bytes_per_token: int) -> int:
    """The arena's size in MiB: ``setting``, or for ``"auto"`` room for two steps of publishes.

    A step publishes at most the chunks its ``step_tokens`` (vLLM's ``max_num_batched_tokens``) complete,
    plus one partly covered at each end, and their slots stay held until the background thread has put
    them; two steps' worth lets one step stage while the last one's puts finish. A publish that finds
    the arena full is dropped, and with a fixed 512 MiB an 8B model on a GPU (128 KiB of KV per token)
    published only the first 4k tokens of a longer prefill step. Loads larger than the arena still
    load whole, in windows.
    """
    if setting != "auto":
        return setting
    step_bytes = (step_tokens + 2 * chunk_tokens) * bytes_per_token
    floor, ceiling = AUTO_ARENA_MIB
    return min(max(floor, -(-2 * step_bytes // (1 << 20))), ceiling)


def kv_bytes_per_token(kv_cache_group: Any) -> int:
    """Bytes of KV one token takes on one rank, over every layer of vLLM's (single) KV cache group."""
    spec = kv_cache_group.kv_cache_spec
    return int(spec.page_size_bytes * len(kv_cache_group.layer_names) // spec.block_size)


#: The KV cache specs whose blocks vLLM keeps for every token of a running request, so that a chunk's pages hold
#: the request's own KV from its first token to its last. A model whose sliding-window layers share the engine
#: with full-attention layers is one of them too: without the hybrid KV cache manager, vLLM keeps all their
#: blocks (a ``FullAttentionSpec`` with its ``sliding_window`` set).
MAPPED_KV_CACHE_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


def check_supported(kv_cache_config: Any, parallel_config: Any) -> None:
    """Refuse, at start-up, engines whose KV the connector cannot map completely: it would load some
    layers' pages and leave the rest unwritten, or move pages the request no longer holds, which is wrong KV,
    not a miss."""
    groups = len(kv_cache_config.kv_cache_groups)
    if groups != 1:
        # vLLM turns its hybrid KV cache manager off for connectors without SupportsHMA, unless told not to.
        raise ConfigError(
            f"PrefixCacheConnector maps one KV cache group and this engine has {groups}: run without "
            "--no-disable-hybrid-kv-cache-manager (models that need it, such as hybrid SSM models, "
            "are not supported)"
        )
    kind = type(kv_cache_config.kv_cache_groups[0].kv_cache_spec).__name__
    if kind not in MAPPED_KV_CACHE_SPECS:
        # Measured with a sliding-window-only model (window 512, prompts of 1100 tokens): loads wrote chunks
        # into the null block that stands in for the freed ones, and the answers changed.
        raise ConfigError(
            f"PrefixCacheConnector maps KV caches that keep a block for every token of a request "
            f"(full attention or MLA), and this engine's is a {kind}: vLLM frees the blocks that "
            "fall outside a sliding or local attention window and gives them to other requests, so "
            "models whose every attention layer has such a window are not supported"
        )
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel_config, setting, 1) > 1:
            # Context parallelism deals a block's tokens out across ranks, so no rank's page holds the
            # block_size consecutive tokens that a chunk's pages are keyed by.
            raise ConfigError(
                f"PrefixCacheConnector does not support context parallelism: {setting} is "
                f"{getattr(parallel_config, setting)}, and each rank's pages would hold only some "
                "of a block's tokens; run with it at 1"
            )


#: Attention backends whose steps over cached KV give other answers than a full prefill of the same prompt, with
#: why. A hit there would change answers even with every byte loaded intact, so their engines may publish but
#: not load.
CANNOT_LOAD_INTO = {
    "CPU_MLA": "vLLM's reference MLA backend for CPUs (used where the CPU has no AMX) decodes over cached KV with "
    "a kernel that disagrees with its prefill, which is why vLLM turns its own prefix cache off for it",
}


def check_loads_supported(attention_backends: Iterable[str], directions: Directions) -> None:
    """Refuse, at start-up, an engine that would load KV into pages that one of ``attention_backends`` (the
    names of its layers' backends) cannot compute over as a full prefill would."""
    if not directions.loads:
        return
    for name in sorted(set(attention_backends) & CANNOT_LOAD_INTO.keys()):
        raise ConfigError(
            f"PrefixCacheConnector cannot load KV on the {name} attention backend: "
            f"{CANNOT_LOAD_INTO[name]}; use kv_role kv_producer on it, to publish only"
        )


def attention_backends(vllm_config: Any, layer_names: Iterable[str]) -> set[str]:
    """The names of the attention backends that ``layer_names`` run on (a worker's, once its model is built)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    # vLLM filters layers by this abstract base; mypy takes only a concrete class for a type[T] parameter
    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)  # type: ignore[type-abstract]
    return {layer.get_attn_backend().get_name() for layer in layers.values()}


def kv_replicas(kv_cache_spec: Any, tp_size: int, total_kv_heads: int) -> int:
    """How many tensor-parallel ranks hold each shard of the KV, bit for bit. Multi-head Latent Attention (DeepSeek-V2
    and later) caches one latent vector per token, from a projection every rank runs whole: all of them. With
    more ranks than KV heads, vLLM gives each head to ``tp_size // total_kv_heads`` consecutive ranks."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if isinstance(kv_cache_spec, MLAAttentionSpec):
        return tp_size
    return tp_size // total_kv_heads if total_kv_heads < tp_size else 1


def engine_kv_replicas(vllm_config: Any, kv_cache_spec: Any) -> int:
    """``kv_replicas`` of this engine."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return kv_replicas(kv_cache_spec, tp_size, vllm_config.model_config.get_total_num_kv_heads())


def namespace_for(
    vllm_config: Any, kv_cache_spec: Any, chunk_tokens: int, *, tp_rank: int, pp_rank: int
) -> NamespaceSpec:
    """Everything that makes this engine's KV pages incompatible with another's, as the rank of pipeline stage
    ``pp_rank`` and tensor-parallel rank ``tp_rank`` has it (``NamespaceSpec.shards`` gives the others).

    Tensor-parallel ranks that hold the same KV (``kv_replicas``) share one shard, named as the rank of an
    engine with as many ranks as distinct shards: they store one copy of each chunk, and engines of that
    smaller tensor-parallel size share it too (their KV differs from this one's only by rounding, as a batch
    of another size would).

    Pages are stored as the attention backend lays them out (the CPU backend packs K and V per head in
    an ISA-specific order), so the layout names the device, the instruction set, the block geometry
    and vLLM's cache layout.
    """
    import torch
    from vllm.platforms import current_platform

    from prefixcache.indexer.fingerprint import fingerprint_model

    model_config = vllm_config.model_config
    replicas = engine_kv_replicas(vllm_config, kv_cache_spec)
    isa = torch.backends.cpu.get_cpu_capability() if current_platform.is_cpu() else current_platform.device_name
    layout = ":".join(
        [
            "vllm-pages-v1",
            current_platform.device_type,
            isa,
            str(vllm_config.cache_config.kv_cache_layout or "default"),
            f"bs{kv_cache_spec.block_size}",
            f"h{kv_cache_spec.num_kv_heads}",
            f"d{kv_cache_spec.head_size}",
        ]
    )
    return NamespaceSpec(
        model=str(model_config.served_model_name or model_config.model),
        model_fingerprint=fingerprint_model(str(model_config.model)),
        kv_dtype=str(kv_cache_spec.dtype).removeprefix("torch."),
        kv_layout=layout,
        chunk_tokens=chunk_tokens,
        tp_rank=tp_rank // replicas,
        tp_size=vllm_config.parallel_config.tensor_parallel_size // replicas,
        pp_rank=pp_rank,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
    )
