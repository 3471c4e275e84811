"""The connector's settings (``kv_connector_extra_config``) and the namespace its KV lives in."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from connector.io_threads import IoCpus
from indexer.errors import ConfigError, validation_problems
from indexer.namespace import NamespaceSpec


class ConnectorSettings(BaseModel):
    """Keys of ``kv_connector_extra_config``. Unknown keys are errors, so a typo never goes unnoticed."""

    model_config = ConfigDict(extra="forbid")

    service_url: str = Field(description="the node daemon, e.g. http://127.0.0.1:8600")
    arena_mb: Annotated[int, Field(ge=16, le=1 << 20)] | Literal["auto"] = Field(
        default="auto", description="registered buffer for loads and publishes, in MiB; auto sizes it for two "
        "steps of publishes (arena_mib)")  # fmt: skip
    min_hit_tokens: int = Field(default=16, ge=1, description="smaller external hits are not worth a load")
    redis_password: str | None = Field(default=None, description="if the index needs one (never logged)")
    io_cpus: IoCpus = Field(default="auto", description="cores for the connector's threads: auto, inherit or CPU ids "
                            "(connector/io_threads.py)")  # fmt: skip
    async_loads: Literal["auto", "always", "never"] = Field(
        default="auto", description="load hits while vLLM runs other requests' steps (connector/load_policy.py): "
        "auto does so for hits that read NVMe or are large, when other requests are running")  # fmt: skip
    async_load_mib: int = Field(default=64, ge=1, description="auto: a hit this large (MiB per rank) loads "
                                "asynchronously when other requests are running")  # fmt: skip
    kv_in_shared_memory: bool = Field(default=True, description="CPU backend: vLLM's KV cache in shared memory, so "
                                      "loads write straight into its pages (connector/shared_kv.py)")  # fmt: skip

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
    return spec.page_size_bytes * len(kv_cache_group.layer_names) // spec.block_size


def check_supported(kv_cache_config: Any) -> None:
    """Refuse, at start-up, engines whose KV the connector cannot map completely: it would load some
    layers' pages and leave the rest unwritten, which is wrong KV, not a miss."""
    groups = len(kv_cache_config.kv_cache_groups)
    if groups != 1:
        # vLLM turns its hybrid KV cache manager off for connectors without SupportsHMA, unless told not to.
        raise ConfigError(f"PrefixCacheConnector maps one KV cache group and this engine has {groups}: run without "
                          "--no-disable-hybrid-kv-cache-manager (models that need it, such as hybrid SSM models, "
                          "are not supported)")  # fmt: skip


def namespace_for(
    vllm_config: Any, kv_cache_spec: Any, chunk_tokens: int, *, tp_rank: int, pp_rank: int
) -> NamespaceSpec:
    """Everything that makes this engine's KV pages incompatible with another's, as the rank of pipeline stage
    ``pp_rank`` and tensor-parallel rank ``tp_rank`` has it (``NamespaceSpec.shards`` gives the others).

    Pages are stored as the attention backend lays them out (the CPU backend packs K and V per head in
    an ISA-specific order), so the layout names the device, the instruction set, the block geometry
    and vLLM's cache layout.
    """
    import torch
    from vllm.platforms import current_platform

    from indexer.fingerprint import fingerprint_model

    model_config = vllm_config.model_config
    isa = torch.backends.cpu.get_cpu_capability() if current_platform.is_cpu() else current_platform.device_name
    layout = ":".join([
        "vllm-pages-v1", current_platform.device_type, isa, str(vllm_config.cache_config.kv_cache_layout or "default"),
        f"bs{kv_cache_spec.block_size}", f"h{kv_cache_spec.num_kv_heads}", f"d{kv_cache_spec.head_size}",
    ])  # fmt: skip
    return NamespaceSpec(
        model=str(model_config.served_model_name or model_config.model),
        model_fingerprint=fingerprint_model(str(model_config.model)),
        kv_dtype=str(kv_cache_spec.dtype).removeprefix("torch."),
        kv_layout=layout,
        chunk_tokens=chunk_tokens,
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        pp_rank=pp_rank,
        pp_size=vllm_config.parallel_config.pipeline_parallel_size,
    )
