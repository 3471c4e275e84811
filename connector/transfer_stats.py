"""What the connector moved, in vLLM's own statistics: its ``KV Transfer metrics`` log line and its ``/metrics``.

Operators watch vLLM's endpoint, not only the daemon's, so each worker counts its loads and publishes and
vLLM collects them after every step (``get_kv_connector_stats``), sums them over its workers
(``aggregate``), logs them every stats interval (``reduce``) and adds them to Prometheus counters labelled
like vLLM's own (``PrefixCachePromMetrics``). The daemon's ``/metrics`` keeps what every client of a node
took from the cache, with latencies; these say what one engine moved, beside its other metrics.

Counted per worker and summed over them: each rank (pipeline stage and tensor-parallel rank) moves its own shard
of every chunk, so with N ranks a chunk (or a failed block) counts N times, and the bytes are the shards' sum.
Where tensor-parallel ranks hold the same KV (MLA; fewer KV heads than ranks), only the first publishes it and
each loads it.

- ``loaded_chunks``, ``loaded_bytes``: chunks that arrived intact in vLLM's pages, and their KV bytes;
- ``load_failed_blocks``: blocks reported to vLLM as failed (damaged, gone, or not loaded), which it recomputes;
- ``published_chunks``, ``published_bytes``: chunks stored (in DRAM, then NVMe) and registered, and their KV bytes;
- ``unpublished_chunks``: chunks computed to publish that were not stored (the store refused them, the
  arena had no room, or the publishing thread had fallen behind).

With them travel, neither logged nor exported, the bytes and seconds of the workers' reads per path
(``read_bytes:<path>``, ``read_s:<path>``), from which the scheduler side learns each path's bandwidth
(connector/load_costs.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from prefixcache.connector.load_costs import READ_PATHS, ReadPath

COUNTS: dict[str, str] = {
    "loaded_chunks": "Chunks prefixcache loaded intact into vLLM's KV cache.",
    "loaded_bytes": "KV bytes prefixcache loaded into vLLM's KV cache.",
    "load_failed_blocks": "KV cache blocks whose prefixcache load failed; vLLM recomputed them.",
    "published_chunks": "Chunks of newly computed KV prefixcache stored and registered.",
    "published_bytes": "KV bytes of the chunks prefixcache published.",
    "unpublished_chunks": "Chunks computed to publish that prefixcache did not store.",
}
_GIB = 1 << 30


class TransferCounts:
    """A worker's counts since vLLM last collected them; added to from the connector's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: Counter[str] = Counter()

    def add(self, **counts: int) -> None:
        unknown = counts.keys() - COUNTS.keys()
        if unknown:
            raise ValueError(f"unknown transfer counts: {sorted(unknown)}")
        with self._lock:
            self._since.update(counts)

    def add_read(self, path: ReadPath, nbytes: int, seconds: float) -> None:
        """A read of ``nbytes`` over ``path`` that took ``seconds`` (or was abandoned after them)."""
        with self._lock:
            self._since.update({f"read_bytes:{path}": nbytes, f"read_s:{path}": seconds})

    def take(self) -> PrefixCacheTransferStats | None:
        """The counts since the last ``take``, or None when nothing moved (vLLM then sends nothing)."""
        with self._lock:
            since, self._since = self._since, Counter()
        since = +since  # drops zeros
        return PrefixCacheTransferStats(data=dict(since)) if since else None


class PrefixCacheTransferStats(KVConnectorStats):
    """Counts (``COUNTS``) over one or more steps and ranks; vLLM ships ``data`` between its processes."""

    def reads(self) -> dict[ReadPath, tuple[float, float]]:
        """The reads' bytes and seconds per path, summed over the steps and ranks these stats cover."""
        return {
            path: (self.data[f"read_bytes:{path}"], self.data[f"read_s:{path}"])
            for path in READ_PATHS
            if self.data.get(f"read_s:{path}")
        }

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's fields: chunk and block counts, and bytes in GiB."""
        reduced: dict[str, int | float] = {}
        for name in COUNTS:
            value = self.data.get(name, 0)
            if name.endswith("_bytes"):
                reduced[name.removesuffix("_bytes") + "_GiB"] = round(value / _GIB, 3)
            else:
                reduced[name] = value
        return reduced


class PrefixCachePromMetrics(KVConnectorPromMetrics):
    """One counter per ``COUNTS`` entry, ``vllm:prefixcache_<name>_total``, labelled per engine as vLLM's are.
    Every engine's series exist from the start, at 0, so that a dashboard or an alert reads 0 where nothing moved
    (no load failed, say) rather than no data."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counters = {
            name: self._counter_cls(name=f"vllm:prefixcache_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTS.items()
        }
        self._series = {
            name: {engine: counter.labels(*values) for engine, values in per_engine_labelvalues.items()}
            for name, counter in counters.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in self._series and value:
                # vLLM types _counter_cls as any of its metric classes; COUNTS are made with it as counters
                self._series[name][engine_idx].inc(value)  # type: ignore[union-attr]
