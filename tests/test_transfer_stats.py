"""The connector's statistics in vLLM's own (pure logic; tests/test_worker_side.py counts real loads and publishes,
and the engine tests read them from vLLM's metrics)."""

import functools
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefixcache.connector.transfer_stats import PrefixCachePromMetrics, PrefixCacheTransferStats, TransferCounts


def test_counts_are_taken_once_and_nothing_is_sent_when_nothing_moved():
    counts = TransferCounts()
    assert counts.take() is None
    counts.add(loaded_chunks=2, loaded_bytes=1 << 20, load_failed_blocks=0)
    counts.add(loaded_chunks=1)
    assert counts.take().data == {"loaded_chunks": 3, "loaded_bytes": 1 << 20}
    assert counts.take() is None
    with pytest.raises(ValueError, match="unknown transfer counts: \\['loaded'\\]"):
        counts.add(loaded=1)


def test_ranks_are_summed_and_logged_in_gib():
    rank0 = PrefixCacheTransferStats(data={"loaded_chunks": 16, "loaded_bytes": 1 << 30})
    rank1 = PrefixCacheTransferStats(data={"loaded_chunks": 16, "loaded_bytes": 1 << 30, "published_chunks": 1})
    both = rank0.aggregate(rank1)
    assert both.reduce() == {
        "loaded_chunks": 32,
        "loaded_GiB": 2.0,
        "load_failed_blocks": 0,
        "published_chunks": 1,
        "published_GiB": 0.0,
        "unpublished_chunks": 0,
    }
    assert not both.is_empty()
    both.reset()
    assert both.is_empty()


def test_prometheus_counters_grow_per_engine():
    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    engines = {0: ["m", "0"], 1: ["m", "1"]}
    metrics = PrefixCachePromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"], engines)
    metrics.observe({"loaded_chunks": 3, "published_bytes": 4096}, engine_idx=1)
    metrics.observe({"loaded_chunks": 2}, engine_idx=1)
    sample = functools.partial(registry.get_sample_value, labels={"model_name": "m", "engine": "1"})
    assert sample("vllm:prefixcache_loaded_chunks_total") == 5
    assert sample("vllm:prefixcache_published_bytes_total") == 4096
    # every engine's series from the start: 0 where nothing moved
    assert registry.get_sample_value("vllm:prefixcache_loaded_chunks_total", {"model_name": "m", "engine": "0"}) == 0
    assert sample("vllm:prefixcache_load_failed_blocks_total") == 0
