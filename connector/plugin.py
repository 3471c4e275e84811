"""``PrefixCacheConnector``: the class vLLM loads. It only dispatches to the scheduler or worker side."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from prefixcache.cachestore.client import trace
from prefixcache.connector.attachment import Attachment
from prefixcache.connector.engine_core_cpus import place_engine_core
from prefixcache.connector.io_threads import io_cpus, numa_node_cpus, pinning, ranks_bound_by_vllm
from prefixcache.connector.settings import (
    ConnectorSettings,
    Directions,
    attention_backends,
    check_loads_supported,
    engine_kv_replicas,
)
from prefixcache.connector.transfer_stats import PrefixCachePromMetrics, PrefixCacheTransferStats
from prefixcache.connector.worker_states import WorkerStates

if TYPE_CHECKING:
    import torch

    from prefixcache.cachestore.client.cache_client import CacheClient
    from prefixcache.connector.detached_worker import DetachedWorker
    from prefixcache.connector.metadata import PrefixCacheMetadata
    from prefixcache.connector.transfer_stats import TransferCounts
    from prefixcache.connector.worker_side import WorkerSide
    from prefixcache.indexer.namespace import NamespaceSpec

log = logging.getLogger("prefixcache.connector")


class PrefixCacheConnector(KVConnectorBase_V1):
    """Loads cached prefixes from prefixcache and publishes newly computed ones."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self._settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        self._directions = Directions.of_role(transfer.kv_role)
        self._scheduler = None
        self._states: WorkerStates | None = None  # the worker side: detached until the worker's client attaches
        self._layer_index: dict[str, int] = {}  # the worker's attention layers, in its KV cache's order
        self._layers: list[torch.Tensor] = []  # their KV caches, for the worker side made once the client attaches
        # The step's metadata while its layers' pages are copied out as they come (``save_kv_layer``), else None.
        self._layer_saves: PrefixCacheMetadata | None = None
        self._client_attachment: Attachment[CacheClient] | None = None
        self._io_thread_setup: Callable[[], None] | None = None  # binds the connector's threads (set with the client)
        if role == KVConnectorRole.SCHEDULER:
            from prefixcache.connector.scheduler_side import SchedulerSide

            if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
                # A chunk that fails to load must be recomputed, not fail the request. vLLM reads this
                # setting after constructing the connector.
                log.warning(
                    "prefixcache: setting kv_load_failure_policy='recompute' (was %r)", transfer.kv_load_failure_policy
                )
                transfer.kv_load_failure_policy = "recompute"
            place_engine_core(self._settings.engine_core_cpus, vllm_config, on_cpu_backend=_on_cpu_backend())
            self._scheduler = SchedulerSide(
                vllm_config,
                kv_cache_config,
                self._settings,
                self._directions,
                kv_in_shared_memory=self._settings.kv_in_shared_memory and _on_cpu_backend(),
            )

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33 asks, with ``enable_sleep_mode``: the worker side lets go of the KV cache while it sleeps
        (``unregister_kv_caches``) and takes it up again on waking (connector/worker_states.py)."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache is best effort: requests never wait for their KV to be stored

    # -- scheduler side ------------------------------------------------------------------------------

    @trace.timed
    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    @trace.timed
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @trace.timed
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @trace.timed
    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """The hit by the tier it is expected from, for vLLM's ``vllm:prompt_tokens_cached_by_source``: DRAM
        (Mooncake's pool, any node) is ``host``, NVMe ``disk``."""
        assert self._scheduler is not None
        dram, nvme = self._scheduler.tokens_by_tier(request, num_external_tokens)
        return {
            source: tokens for source, tokens in ((CacheHitSource.HOST, dram), (CacheHitSource.DISK, nvme)) if tokens
        }

    @trace.timed_step_end
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    @trace.timed
    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    @trace.timed
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Blocks are held past the request only while what it generated is copied out, a step later (setting
        ``publish_output``), until every worker reports it in ``finished_sending``. vLLM itself keeps the blocks of a
        request aborted while it loads asynchronously until the workers report that load over."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids), None

    @trace.timed
    def has_pending_block_frees(self) -> bool:
        assert self._scheduler is not None
        return self._scheduler.has_pending_block_frees()

    # -- worker side ---------------------------------------------------------------------------------

    def get_mem_pool_context(self) -> AbstractContextManager[object] | None:
        """On the CPU backend, vLLM allocates its KV cache inside this context: in the client's shared
        memory, so that loads write chunks straight into the pages (connector/shared_kv.py).

        A store that cannot be reached at start leaves the KV cache in ordinary memory for the engine's life:
        once the client attaches, its loads copy through the arena, as for any cache outside shared memory.
        Shared memory the client makes later could not hold a cache vLLM has already allocated."""
        if not self._settings.kv_in_shared_memory or not _on_cpu_backend():
            return None
        if (client := self._client()) is None:
            log.warning(
                "prefixcache: KV cache not placed in shared memory (no store yet); loads will copy through the arena"
            )
            return None
        from prefixcache.connector.shared_kv import SharedKVAllocation

        return SharedKVAllocation(client.shared_memory)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        group = self._kv_cache_config.kv_cache_groups[0]
        check_loads_supported(attention_backends(self._vllm_config, group.layer_names), self._directions)
        names = [name for name in group.layer_names if name in kv_caches]
        self._layer_index = {name: i for i, name in enumerate(names)}
        self._layers = [kv_caches[name] for name in names]
        self._client()
        self._states = WorkerStates(
            lambda: self._client_attachment.value if self._client_attachment is not None else None,
            self._worker_side,
        )
        self._states.adopt()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33, before its sleep mode unmaps the KV cache: finish the copies under way and drop every view of
        the pages, the staging buffers and the pinned arena; loads fail (vLLM computes them) until restored."""
        if self._states is not None:
            self._states.unregister()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33, once waking up has mapped the KV cache again: the worker side takes it up again."""
        if self._states is not None:
            self._states.restore()

    @property
    def _worker(self) -> WorkerSide | DetachedWorker | None:
        return self._states.current if self._states is not None else None

    def _adopt_client(self) -> None:
        if self._states is not None:
            self._states.adopt()

    def _worker_side(self, client: CacheClient, transfers: TransferCounts) -> WorkerSide:
        """The worker side over the KV cache, once the worker's client has attached (connector/worker_states.py)."""
        from prefixcache.connector.worker_side import WorkerSide

        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return WorkerSide(
            client,
            self._layers,
            spec.block_size,
            directions=self._worker_directions(spec),
            io_thread_setup=self._io_thread_setup,
            check_threads=self._settings.check_threads,
            transfers=transfers,
        )

    def _worker_directions(self, kv_cache_spec: Any) -> Directions:
        """The role's directions, except that of tensor-parallel ranks holding the same KV (``kv_replicas``) only
        the first publishes it: the others load the copy it stores."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        if get_tensor_model_parallel_rank() % engine_kv_replicas(self._vllm_config, kv_cache_spec):
            return self._directions._replace(publishes=False)
        return self._directions

    def _client(self) -> CacheClient | None:
        """The worker's client, or None while the store cannot be reached (tried again in the background:
        connector/attachment.py). Asked for first by ``get_mem_pool_context``, before the KV cache exists."""
        if self._client_attachment is None:
            from prefixcache.cachestore.client.cache_client import CacheClient

            self._client_attachment = Attachment(self._attach_client, CacheClient.close, "worker side")
        return self._client_attachment.value

    def _attach_client(self) -> CacheClient:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        from prefixcache.cachestore.client.cache_client import CacheClient
        from prefixcache.cachestore.client.config import chunk_mac_key, fetch_config
        from prefixcache.connector.settings import arena_mib, kv_bytes_per_token, namespace_for

        group = self._kv_cache_config.kv_cache_groups[0]
        config = fetch_config(self._settings.service_url)
        spec = namespace_for(
            self._vllm_config,
            group.kv_cache_spec,
            config.chunk_tokens,
            tp_rank=get_tensor_model_parallel_rank(),
            pp_rank=get_pp_group().rank_in_group,
        )
        cpus = io_cpus(
            self._settings.io_cpus,
            on_cpu_backend=_on_cpu_backend(),
            compute=os.sched_getaffinity(0),
            online=range(os.cpu_count() or 1),
            numa_nodes=numa_node_cpus(),
            other_ranks=ranks_bound_by_vllm(os.environ.get("VLLM_CPU_OMP_THREADS_BIND")),
        )
        step_tokens = self._vllm_config.scheduler_config.max_num_batched_tokens
        arena = arena_mib(self._settings.arena_mb, step_tokens, config.chunk_tokens, kv_bytes_per_token(group))
        thread_setup = pinning(cpus)
        client = CacheClient(
            config,
            spec,
            arena_bytes=arena << 20,
            redis_password=self._settings.redis_password,
            io_thread_setup=thread_setup,
            mac_key=chunk_mac_key(config, self._settings.chunk_key_file),
        )
        log.info("prefixcache: connector threads on CPUs %s", "as the worker" if cpus is None else sorted(cpus))
        log.info("prefixcache: a %d MiB arena (arena_mb=%s)", arena, self._settings.arena_mb)
        self._io_thread_setup = thread_setup
        return client

    @property
    def worker_namespace(self) -> NamespaceSpec | None:
        """The namespace this worker loads and publishes under (None before the store has attached)."""
        client = self._client_attachment.value if self._states is not None and self._client_attachment else None
        return client.spec if client is not None else None

    @trace.timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM's first hook of every step, ahead of ``start_load_kv``: DRAM hits start here."""
        self._adopt_client()
        self._layer_saves = None
        if (worker := self._worker) is not None and isinstance(kv_connector_metadata, _metadata_type()):
            worker.begin_step(kv_connector_metadata)
            if worker.saves_layers and kv_connector_metadata.saves:
                self._layer_saves = kv_connector_metadata

    @trace.timed
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._adopt_client()
        if self._worker is not None:
            meta = self._get_connector_metadata()
            if isinstance(meta, _metadata_type()):
                self._worker.start_load(meta)

    @trace.timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Each attention layer calls this before it reads its KV. Loads are in their pages when start_load_kv
        returns (their verification may still run), except those read from NVMe layer by layer: this waits for
        the layer's."""
        if self._worker is not None and (layer := self._layer_index.get(layer_name)) is not None:
            self._worker.wait_for_layer(layer)

    @trace.timed
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Each attention layer calls this once it has written its KV: on the CPU, the pages of the step's chunks to
        publish are copied out and signed behind the later layers; on a GPU, every layer's are copied after the
        forward pass (``wait_for_save``). A step's metadata says which chunks at its first hook
        (``handle_preemptions``): the other steps, most of a decode, cost this hook one test."""
        if (meta := self._layer_saves) is None or (worker := self._worker) is None:
            return
        if (layer := self._layer_index.get(layer_name)) is not None:
            worker.save_layer(meta, layer)

    @trace.timed_step_end
    def wait_for_save(self) -> None:
        self._layer_saves = None
        if self._worker is not None:
            meta = self._get_connector_metadata()
            if isinstance(meta, _metadata_type()):
                self._worker.save(meta)

    @trace.timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose generated tokens' pages are copied out (vLLM frees their blocks once every worker
        says so), and requests whose asynchronous loads are over; their failed blocks go to the load errors vLLM
        asks for next, in the same pass."""
        if self._worker is None:
            return None, None
        return self._worker.finished_saves() or None, self._worker.finished_async_loads() or None

    @trace.timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    @trace.timed
    def get_kv_connector_stats(self) -> PrefixCacheTransferStats | None:
        """What this worker loaded and published since vLLM last asked (after every step); none on the
        scheduler side (connector/transfer_stats.py)."""
        return self._worker.transfers.take() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PrefixCacheTransferStats:
        return PrefixCacheTransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PrefixCachePromMetrics:
        return PrefixCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._states is not None and self._states.attached is not None:
            self._states.close()  # and its client
        elif self._client_attachment is not None:
            self._client_attachment.close()
        if self._scheduler is not None:
            self._scheduler.close()


def _on_cpu_backend() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _metadata_type() -> type[PrefixCacheMetadata]:
    from prefixcache.connector.metadata import PrefixCacheMetadata

    return PrefixCacheMetadata
