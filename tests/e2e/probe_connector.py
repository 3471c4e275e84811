"""``PrefixCacheConnector`` with a recorder, for tests that check KV bit for bit.

Loaded by vLLM like the real one (``kv_connector_module_path: tests.e2e.probe_connector``). With
``PREFIXCACHE_PROBE_DIR`` set, the worker writes the pages of every chunk it publishes right after the forward
pass computed them (``saved-<key>.pt``; a tensor-parallel rank whose KV another rank holds and publishes adds
``.rank<r>`` before ``.pt``, here and to the loaded pages' names) and the pages of every chunk it loads right
after placing them, before the forward pass reads them (``loaded-<key>-<first page>-<request>.pt``), each as a
(layers, pages, *page shape) tensor, and how many of them the segment owner wrote into the pages in place
(``loaded_in_place.<shard>``, the worker's ``NamespaceSpec.shard``: its tensor-parallel rank under one pipeline
stage), how many of those reads began at vLLM's first hook of the step (``loaded_early.<shard>``), how many chunks
were read from NVMe into their pages layer by layer (``loaded_layer_by_layer.<shard>``: the probe waits for every
layer of such a load before it records it, and counts apart the attention layers whose KV vLLM itself waited for,
``layers_waited.<shard>`` as ``<layers waited for>/<layers>``), how many
requests loaded asynchronously (``loaded_async.<shard>``), how many chunks it was asked to publish
(``saves.<shard>``) and in which namespace (``namespace.<shard>``), and of the attention layers of the steps that
publish, those whose pages were copied out at the layer's own hook (``layers_saved.<shard>`` as ``<copied
then>/<layers of those steps>``); an asynchronous load's pages are recorded
once the worker reports it over. The scheduler side records whether vLLM schedules each step before the last one
is over (``schedules_ahead``: its asynchronous scheduling). Each rank records its own shard under its own keys.
A test then compares what one instance computed with what another loaded: the same bytes in the right blocks, or
the cache is wrong.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from prefixcache.connector import PrefixCacheConnector
from prefixcache.connector.metadata import LoadChunk, PrefixCacheMetadata
from prefixcache.indexer.keys import chunk_key


class ProbeConnector(PrefixCacheConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loading: dict[str, list[LoadChunk]] = {}  # asynchronous loads not reported over yet
        self._saves = 0  # chunks the scheduler side asked this worker to publish
        self._layers_waited: set[str] = set()  # the attention layers vLLM called wait_for_layer_load for
        self._layers_saved = 0  # save_kv_layer calls that copied a publishing step's pages out
        self._publishing_steps = 0
        directory = os.environ.get("PREFIXCACHE_PROBE_DIR")
        if directory and self._scheduler is not None:
            (Path(directory) / "schedules_ahead").write_text(str(self._scheduler.schedules_ahead))

    def _probe_dir(self) -> Path | None:
        directory = os.environ.get("PREFIXCACHE_PROBE_DIR")
        return Path(directory) if directory and self._worker is not None else None

    def _replica_suffix(self) -> str:
        """``.rank<r>`` on the files of a tensor-parallel rank that holds another rank's KV (``kv_replicas``): the
        first rank of its group records under the plain names, and this one beside them."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        assert self._worker is not None
        rank, replicas = (
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size() // self._worker.client.spec.tp_size,
        )
        return f".rank{rank}" if rank % replicas else ""

    def _pages(self, blocks: list[int]) -> torch.Tensor:
        assert self._worker is not None
        index = torch.tensor(blocks, dtype=torch.long)
        return torch.stack([layer.index_select(0, index).cpu() for layer in self._worker.layers])

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        directory, meta = self._probe_dir(), self._get_connector_metadata()
        if directory is None or not isinstance(meta, PrefixCacheMetadata):
            return
        assert self._worker is not None
        for layer in range(len(self._worker.layers)):  # in their pages, as the forward pass would have them
            self._worker.wait_for_layer(layer)
        self._worker.finish_load()  # verified: only intact chunks are recorded
        shard = self._worker.shard
        (directory / f"loaded_in_place.{shard}").write_text(str(self._worker.loaded_in_place))
        (directory / f"loaded_early.{shard}").write_text(str(self._worker.loaded_early))
        (directory / f"loaded_layer_by_layer.{shard}").write_text(str(self._worker.loaded_layer_by_layer))
        self._record(directory, meta.loads_of(shard))
        self._loading.update(meta.loads_of(shard, asynchronous=True))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        directory = self._probe_dir()
        if directory is not None and recving:
            assert self._worker is not None
            self._record(directory, {req_id: self._loading.pop(req_id) for req_id in recving})
            (directory / f"loaded_async.{self._worker.shard}").write_text(str(self._worker.loaded_async))
        return sending, recving

    def _record(self, directory: Path, loads: dict[str, list[LoadChunk]]) -> None:
        """The pages of every chunk of ``loads`` that arrived intact."""
        assert self._worker is not None
        failed, replica = self._worker.load_errors, self._replica_suffix()
        for req_id, chunks in loads.items():
            for chunk in chunks:
                if not failed.intersection(chunk.blocks):
                    name = f"loaded-{chunk.key.hex()}-{chunk.first_page}-{req_id}{replica}.pt"
                    torch.save(self._pages(chunk.blocks), directory / name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._layers_waited.add(layer_name)
        super().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self._layers_saved += self._layer_saves is not None and layer_name in self._layer_index
        super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        directory, meta = self._probe_dir(), self._get_connector_metadata()
        if directory is not None and isinstance(meta, PrefixCacheMetadata):
            assert self._worker is not None
            waited = len(self._layers_waited.intersection(self._layer_index))
            (directory / f"layers_waited.{self._worker.shard}").write_text(f"{waited}/{len(self._layer_index)}")
            replica = self._replica_suffix()
            for save in meta.saves:
                key = chunk_key(save.parents[self._worker.shard], save.tokens)
                torch.save(self._pages(save.blocks), directory / f"saved-{key.hex()}{replica}.pt")
            self._saves += len(meta.saves)
            self._publishing_steps += bool(meta.saves)
            layers = self._publishing_steps * len(self._layer_index)
            (directory / f"layers_saved.{self._worker.shard}").write_text(f"{self._layers_saved}/{layers}")
            (directory / f"saves.{self._worker.shard}").write_text(str(self._saves))
            (directory / f"namespace.{self._worker.shard}").write_text(self._worker.client.spec.digest.hex())
        super().wait_for_save()
