"""The connector's settings (``kv_connector_extra_config``), a request's own ``kv_transfer_params``, and where the
connector's threads run: pure logic."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from prefixcache.cachestore.client.request_params import NO_CACHE, RequestCacheParams, request_cache_params
from prefixcache.cachestore.host.cpus import cpu_list
from prefixcache.connector.engine_core_cpus import engine_core_cpus, workers_compute_cores
from prefixcache.connector.io_threads import io_cpus, numa_node_cpus, pinning, ranks_bound_by_vllm
from prefixcache.connector.settings import (
    ConnectorSettings,
    Directions,
    arena_mib,
    check_loads_supported,
    check_supported,
    kv_bytes_per_token,
    kv_replicas,
)
from prefixcache.indexer.errors import ConfigError


def test_defaults_need_no_setting_at_all():
    settings = ConnectorSettings.parse({})
    assert settings.service_url == "http://127.0.0.1:8600"
    assert settings.io_cpus == "auto" and settings.arena_mb == "auto"
    assert settings.async_loads == "auto" and settings.async_load_mib == 64 and settings.check_threads == "auto"
    assert settings.publish_output  # what finished requests generated is published wherever kv_role publishes


@pytest.mark.parametrize(
    "extra, problem",
    [
        ({"service_url": ""}, "service_url"),
        ({"service_url": "http://x", "arena_mb": 1}, "arena_mb"),
        ({"service_url": "http://x", "arena_mb": "big"}, "arena_mb"),
        ({"service_url": "http://x", "servce_url": "http://y"}, "servce_url"),
        ({"service_url": "http://x", "io_cpus": "all"}, "io_cpus"),
        ({"service_url": "http://x", "io_cpus": [-1]}, "io_cpus"),
        ({"service_url": "http://x", "io_cpus": []}, "io_cpus"),
        ({"service_url": "http://x", "engine_core_cpus": "reserved"}, "engine_core_cpus"),
        ({"service_url": "http://x", "engine_core_cpus": []}, "engine_core_cpus"),
        ({"service_url": "http://x", "async_loads": "sometimes"}, "async_loads"),
        ({"service_url": "http://x", "async_load_mib": 0}, "async_load_mib"),
        ({"service_url": "http://x", "check_threads": -1}, "check_threads"),
        ({"service_url": "http://x", "check_threads": 65}, "check_threads"),
        ({"service_url": "http://x", "check_threads": "many"}, "check_threads"),
        ({"service_url": "http://x", "publish_output": "sometimes"}, "publish_output"),
    ],
)
def test_bad_settings_are_named_in_the_error(extra, problem):
    with pytest.raises(ConfigError, match=problem):
        ConnectorSettings.parse(extra)


@pytest.mark.parametrize(
    "kv_transfer_params, wanted",
    [
        (None, RequestCacheParams(load=True, publish=True)),
        ({"do_remote_prefill": True}, RequestCacheParams(load=True, publish=True)),  # another connector's keys
        ({"prefixcache": {}}, RequestCacheParams(load=True, publish=True)),
        ({"prefixcache": {"publish": False}}, RequestCacheParams(load=True, publish=False)),
        ({"prefixcache": {"load": False}, "do_remote_prefill": True}, RequestCacheParams(load=False, publish=True)),
        ({"prefixcache": {"publish_output": False}}, RequestCacheParams(publish_output=False)),
        ({"prefixcache": {"publish_output": True}}, RequestCacheParams(publish_output=True)),
    ],
)
def test_a_request_may_turn_loading_or_publishing_off_for_itself(kv_transfer_params, wanted):
    assert request_cache_params(kv_transfer_params) == (wanted, None)


@pytest.mark.parametrize(
    "entry, problem",
    [
        ({"pubish": False}, "pubish: Extra inputs are not permitted"),
        ({"publish": "false"}, "publish: Input should be a valid boolean"),  # a string could mean either
        ({"load": 0}, "load: Input should be a valid boolean"),
        ({"publish_output": "no"}, "publish_output: Input should be a valid boolean"),
        (False, "prefixcache: Input should be a valid dictionary"),
    ],
)
def test_a_malformed_request_entry_turns_the_cache_off_for_that_request_and_says_why(entry, problem):
    params, said = request_cache_params({"prefixcache": entry})
    assert params == NO_CACHE and not params.load and not params.publish  # a typo must not publish a private prompt
    assert said is not None and said.startswith('kv_transfer_params["prefixcache"] is invalid') and problem in said


def test_an_explicit_arena_size_is_kept():
    assert ConnectorSettings.parse({"service_url": "http://x", "arena_mb": 128}).arena_mb == 128
    assert arena_mib(128, step_tokens=8192, chunk_tokens=256, bytes_per_token=128 << 10) == 128


def test_an_automatic_arena_holds_two_steps_of_publishes_within_its_bounds():
    tiny_cpu_model = arena_mib("auto", step_tokens=8192, chunk_tokens=256, bytes_per_token=8 << 10)
    llama_8b_on_a_gpu = arena_mib("auto", step_tokens=8192, chunk_tokens=256, bytes_per_token=128 << 10)
    llama_70b_on_one_gpu = arena_mib("auto", step_tokens=8192, chunk_tokens=256, bytes_per_token=320 << 10)
    assert tiny_cpu_model == 512  # the floor: 2 x 8704 tokens x 8 KiB is 136 MiB
    assert llama_8b_on_a_gpu == 2 * (8192 + 2 * 256) * 128 // 1024  # 2176 MiB
    assert llama_70b_on_one_gpu == 4096  # the ceiling


def test_kv_bytes_per_token_count_every_layer_of_the_group():
    group = SimpleNamespace(
        kv_cache_spec=SimpleNamespace(page_size_bytes=131072, block_size=128),
        layer_names=[f"model.layers.{i}.self_attn" for i in range(8)],
    )
    assert kv_bytes_per_token(group) == 8192  # the tiny test Llama: 8 layers x 4 heads x 128 x bf16


def test_auto_moves_connector_threads_off_a_cpu_workers_compute_cores():
    assert io_cpus("auto", on_cpu_backend=True, compute={0}, online=range(2)) == {1}
    assert io_cpus("auto", on_cpu_backend=True, compute={0, 1, 2}, online=range(8)) == {3, 4, 5, 6, 7}


def test_auto_never_takes_another_tensor_parallel_ranks_cores():
    # two ranks bound by hand on one node ("0|1"): no core is spare
    others = ranks_bound_by_vllm("0|1")
    assert others == {0, 1}
    assert io_cpus("auto", on_cpu_backend=True, compute={0}, online=range(2), other_ranks=others) is None
    assert ranks_bound_by_vllm("0-2,7|3-5") == {0, 1, 2, 3, 4, 5, 7}
    assert ranks_bound_by_vllm("auto") == ranks_bound_by_vllm(None) == frozenset()
    # vLLM's own binding puts each rank on a NUMA node of its own: the spare cores are on this rank's node
    nodes = [cpu_list("0-3"), cpu_list("4-7\n")]
    assert io_cpus("auto", on_cpu_backend=True, compute={4, 5, 6}, online=range(8), numa_nodes=nodes) == {7}


def test_numa_nodes_are_read_from_sysfs(tmp_path):
    for node, cpus in (("node0", "0-1,4\n"), ("node1", "2-3\n")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus)
    assert numa_node_cpus(tmp_path) == [{0, 1, 4}, {2, 3}]
    assert numa_node_cpus(tmp_path / "missing") == []


def test_auto_leaves_threads_alone_off_the_cpu_backend_or_with_no_spare_core():
    assert io_cpus("auto", on_cpu_backend=False, compute={0}, online=range(2)) is None
    assert io_cpus("auto", on_cpu_backend=True, compute={0, 1}, online=range(2)) is None
    assert io_cpus("inherit", on_cpu_backend=True, compute={0}, online=range(2)) is None


def test_an_explicit_list_is_used_as_given():
    assert io_cpus([3, 5], on_cpu_backend=False, compute={0}, online=range(8)) == {3, 5}


def test_auto_binds_the_engine_core_to_the_cores_no_worker_computes_on():
    assert engine_core_cpus("auto", multiprocess_cpu_workers=True, allowed=range(2), compute={0}) == {1}
    two_ranks = {0, 1, 2, 4, 5, 6}
    assert engine_core_cpus("auto", multiprocess_cpu_workers=True, allowed=range(8), compute=two_ranks) == {3, 7}


def test_auto_leaves_the_engine_core_where_vllm_puts_it_unless_workers_compute_apart_beside_a_spare_core():
    assert engine_core_cpus("auto", multiprocess_cpu_workers=False, allowed=range(2), compute={0}) is None
    assert engine_core_cpus("auto", multiprocess_cpu_workers=True, allowed=range(2), compute=()) is None
    assert engine_core_cpus("auto", multiprocess_cpu_workers=True, allowed=range(2), compute={0, 1}) is None
    assert engine_core_cpus("inherit", multiprocess_cpu_workers=True, allowed=range(2), compute={0}) is None
    assert engine_core_cpus([5], multiprocess_cpu_workers=False, allowed=range(8), compute=()) == {5}


def test_a_vllm_that_cannot_say_where_its_workers_compute_leaves_nothing_to_avoid(caplog):
    assert workers_compute_cores(SimpleNamespace()) == frozenset()
    assert "cannot tell which cores" in caplog.text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_placing_the_engine_core_binds_every_thread_of_its_process_and_those_it_starts():
    cpu = max(os.sched_getaffinity(0))
    script = f"""
import os, threading
from types import SimpleNamespace
from prefixcache.connector.engine_core_cpus import place_engine_core
started = threading.Event()
before = threading.Thread(target=started.wait)
before.start()
config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="mp"))
place_engine_core([{cpu}], config, on_cpu_backend=True)
after = threading.Thread(target=started.wait)
after.start()
print(sorted({{cpu for task in os.listdir("/proc/self/task") for cpu in os.sched_getaffinity(int(task))}}))
print(len(os.listdir("/proc/self/task")))
started.set()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [f"[{cpu}]", "3"], out.stderr


def test_pinning_binds_only_the_thread_that_runs_it():
    before = os.sched_getaffinity(0)
    target = frozenset({min(before)})
    seen: list[set[int]] = []

    def run() -> None:
        pinning(target)()
        seen.append(os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [set(target)] and os.sched_getaffinity(0) == before


def test_a_refused_binding_leaves_the_thread_where_it_was(caplog):
    before = os.sched_getaffinity(0)
    pinning(frozenset({100_000}))()  # no such CPU
    assert os.sched_getaffinity(0) == before and "cannot bind" in caplog.text


def test_each_kv_role_moves_kv_the_ways_it_names():
    assert Directions.of_role("kv_both") == (True, True)
    assert Directions.of_role("kv_producer") == Directions(loads=False, publishes=True)
    assert Directions.of_role("kv_consumer") == Directions(loads=True, publishes=False)


def kv_cache_config(groups: int, spec: str = "FullAttentionSpec", **fields: object) -> SimpleNamespace:
    """The part of vLLM's KV cache config the connector checks at start-up: ``groups`` groups of vLLM's ``spec``."""
    from vllm.v1 import kv_cache_interface

    shape = {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16, **fields}
    group = SimpleNamespace(kv_cache_spec=getattr(kv_cache_interface, spec)(**shape))
    return SimpleNamespace(kv_cache_groups=[group] * groups)


def parallel_config(**sizes: int) -> SimpleNamespace:
    """The part of vLLM's parallel config the connector checks at start-up."""
    return SimpleNamespace(**{"decode_context_parallel_size": 1, "prefill_context_parallel_size": 1, **sizes})


def test_engines_whose_kv_the_connector_cannot_map_whole_are_refused_at_start_up():
    check_supported(kv_cache_config(1), parallel_config())
    with pytest.raises(ConfigError, match="one KV cache group and this engine has 2"):
        check_supported(kv_cache_config(2), parallel_config())
    for setting in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        with pytest.raises(ConfigError, match=f"does not support context parallelism: {setting} is 2"):
            check_supported(kv_cache_config(1), parallel_config(**{setting: 2}))


def test_only_kv_caches_that_keep_every_tokens_block_are_mapped():
    """vLLM frees the blocks a sliding or local window leaves behind; where sliding layers share the engine with
    full ones, it keeps them all (a FullAttentionSpec with a window)."""
    check_supported(kv_cache_config(1, "MLAAttentionSpec"), parallel_config())
    check_supported(kv_cache_config(1, sliding_window=512), parallel_config())
    for spec, fields in (
        ("SlidingWindowSpec", {"sliding_window": 512}),
        ("ChunkedLocalAttentionSpec", {"attention_chunk_size": 512}),
    ):
        with pytest.raises(ConfigError, match=f"this engine's is a {spec}: vLLM frees the blocks"):
            check_supported(kv_cache_config(1, spec, **fields), parallel_config())


def test_an_engine_may_not_load_on_an_attention_backend_whose_answers_a_hit_would_change():
    check_loads_supported({"CPU_ATTN"}, Directions.of_role("kv_both"))
    check_loads_supported({"CPU_MLA"}, Directions.of_role("kv_producer"))  # publishing changes no answer
    for role in ("kv_both", "kv_consumer"):
        with pytest.raises(ConfigError, match="cannot load KV on the CPU_MLA attention backend.*kv_producer"):
            check_loads_supported({"CPU_MLA"}, Directions.of_role(role))


def test_tensor_parallel_ranks_hold_the_same_kv_under_latent_attention_or_with_fewer_kv_heads_than_ranks():
    mla, full = (
        kv_cache_config(1, spec).kv_cache_groups[0].kv_cache_spec for spec in ("MLAAttentionSpec", "FullAttentionSpec")
    )
    assert kv_replicas(mla, tp_size=4, total_kv_heads=1) == 4  # MLA: every rank
    assert kv_replicas(full, tp_size=8, total_kv_heads=4) == 2  # vLLM gives each head to two ranks
    assert kv_replicas(full, tp_size=2, total_kv_heads=1) == 2
    assert kv_replicas(full, tp_size=2, total_kv_heads=8) == 1
    assert kv_replicas(full, tp_size=1, total_kv_heads=8) == 1


def test_the_background_thread_yields_to_the_engine() -> None:
    """``behind_the_engine`` lowers the calling thread's priority only, not its process's."""
    from prefixcache.connector.io_threads import BACKGROUND_NICE, behind_the_engine

    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: list[int] = []

    def background() -> None:
        behind_the_engine()
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=background)
    thread.start()
    thread.join()
    assert seen == [max(before, BACKGROUND_NICE)] and os.getpriority(os.PRIO_PROCESS, 0) == before
