"""The connector's scheduler side as the installed vLLM's scheduler drives it, with vLLM's own classes (``VllmConfig``
from ``EngineArgs``, ``Request``, ``KVCacheBlocks``, ``SchedulerOutput``) against a real daemon: vLLM 0.33 may call
``update_state_after_alloc`` steps after ``get_num_new_matched_tokens`` (a consumer with more than one batch in flight
defers it to ``update_from_output``), and the requests it finishes meanwhile. ``make test-vllm033`` runs this module
with vLLM 0.33 too; config validation asks the connector whether it supports sleep mode there."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prefixcache.cachestore.client.cache_client import CacheClient
from prefixcache.indexer.index import Location
from tests.daemon_harness import Daemon, publish_prompt, wait_for, wait_persisted
from tests.e2e.tinymodel import build_tiny_llama, random_prompt

BLOCK_TOKENS = 16
PROMPT_TOKENS = 1000


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[tuple[Daemon, Path]]:
    work = tmp_path_factory.mktemp("scheduler-side")
    daemon = Daemon(work / "data").start()
    try:
        yield daemon, build_tiny_llama(work / "tiny-llama")
    finally:
        daemon.stop()


def vllm_config(daemon: Daemon, model: Path, sleep_mode: bool = False, async_loads: str = "always"):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        kv_connector="PrefixCacheConnector",
        kv_role="kv_consumer",
        kv_connector_extra_config={
            "service_url": daemon.url,
            "async_loads": async_loads,
            # a scheduler side made in this process would bind the test's threads as an engine core's
            "engine_core_cpus": "inherit",
        },
    )
    args = EngineArgs(
        model=str(model),
        max_model_len=2048,
        block_size=BLOCK_TOKENS,
        enable_sleep_mode=sleep_mode,
        kv_transfer_config=transfer,
    )
    return args.create_engine_config()


def kv_cache_config(config, blocks: int = 256):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = config.model_config
    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS,
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.get_num_layers(config.parallel_config))]
    return KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def request(request_id: str, prompt: list[int]):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, prompt, SamplingParams(max_tokens=4), None)


def allocated(first: int, count: int):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block) for block in range(first, first + count)],))


def empty_step():
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


@pytest.fixture(scope="module")
def scheduler(stack):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from prefixcache.connector.plugin import PrefixCacheConnector

    daemon, model = stack
    config = vllm_config(daemon, model)
    connector = PrefixCacheConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(config))
    yield connector
    connector.shutdown()


def stored_prompt(daemon: Daemon, scheduler, seed: int) -> list[int]:
    """A prompt whose every chunk is in the store, under the namespace the scheduler side looks up."""
    prompt = random_prompt(seed=seed, length=PROMPT_TOKENS)
    client = CacheClient.connect(daemon.url, scheduler._scheduler.store.namespaces[0], arena_bytes=64 << 20)
    try:
        publish_prompt(client, prompt, bytes_per_token=256)
    finally:
        client.close()
    return prompt


def test_vllms_config_validation_takes_the_connector_with_sleep_mode_on_and_off(stack):
    """With sleep mode on, 0.33's validation asks the class vLLM's factory finds whether it supports sleep mode; 0.32
    does not ask. Sleep mode is for GPUs (vLLM refuses it on the CPU backend): there the question is asked directly."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.platforms import current_platform

    from prefixcache.connector.plugin import PrefixCacheConnector

    daemon, model = stack
    config = vllm_config(daemon, model)
    found = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
    assert found is PrefixCacheConnector and found.supports_sleep_mode(config.kv_transfer_config)
    if current_platform.is_sleep_mode_available():
        assert vllm_config(daemon, model, sleep_mode=True).model_config.enable_sleep_mode


def test_an_allocation_vllm_defers_past_a_step_plans_the_load_in_the_step_after_it(stack, scheduler):
    daemon, _ = stack
    prompt = stored_prompt(daemon, scheduler, seed=11)
    r = request("deferred", prompt)
    scheduler.on_new_request(r)
    hit, asynchronous = scheduler.get_num_new_matched_tokens(r, 0)
    assert hit == PROMPT_TOKENS - 1 and asynchronous
    # vLLM runs other requests' steps before its update_from_output makes the allocation known
    assert "deferred" not in scheduler.build_connector_meta(empty_step()).loads[0]
    blocks = allocated(0, -(-PROMPT_TOKENS // BLOCK_TOKENS))
    scheduler.update_state_after_alloc(r, blocks, hit)
    meta = scheduler.build_connector_meta(empty_step())
    planned = [block for chunk in meta.loads[0]["deferred"] for block in chunk.blocks]
    assert planned == blocks.get_block_ids()[0][: len(planned)] and len(planned) == -(-hit // BLOCK_TOKENS)
    assert meta.load_async == {"deferred"}
    assert "deferred" not in scheduler.build_connector_meta(empty_step()).loads[0]  # planned once


def test_a_request_finished_before_its_deferred_allocation_is_not_planned_again(stack, scheduler):
    """vLLM drops a deferred load of a request that finishes first: the request publishes nothing (it computed
    nothing), and an allocation update that came late anyway is ignored, not taken for a new request."""
    daemon, _ = stack
    prompt = stored_prompt(daemon, scheduler, seed=12)
    r = request("aborted", prompt)
    scheduler.on_new_request(r)
    hit, asynchronous = scheduler.get_num_new_matched_tokens(r, 0)
    assert hit > 0 and asynchronous
    assert scheduler.request_finished(r, []) == (False, None)
    scheduler.update_state_after_alloc(r, allocated(100, 8), hit)
    assert "aborted" not in scheduler._scheduler.requests
    meta = scheduler.build_connector_meta(empty_step())
    assert "aborted" not in meta.loads[0] and not meta.saves and not meta.finished


def test_a_prompt_vllms_own_cache_holds_is_not_looked_up_while_its_chunks_are_known_stored(stack, scheduler):
    """A request that can load nothing (vLLM's own prefix cache holds its prompt) is looked up only to learn which
    chunks need not be published again: while its chunks are known stored, from the lookup of an earlier request,
    it is not looked up, and none of them is published again. Shown by evicting them from the store between the
    two: a lookup would find nothing. Once the knowledge lapses, the next one is looked up, and finds nothing."""
    from prefixcache.connector.known_stored import KnownStored

    daemon, _ = stack
    side = scheduler._scheduler
    clock = [0.0]
    side.store.known = KnownStored(known_for_s=30.0, clock=lambda: clock[0])
    prompt = stored_prompt(daemon, scheduler, seed=13)
    first = request("first", prompt)
    scheduler.on_new_request(first)
    hit, _ = scheduler.get_num_new_matched_tokens(first, 0)
    assert hit == PROMPT_TOKENS - 1
    scheduler.update_state_after_alloc(first, allocated(0, -(-PROMPT_TOKENS // BLOCK_TOKENS)), hit)
    full_chunks = PROMPT_TOKENS // side.store.geometry.chunk_tokens
    hasher = side.requests["first"].hashers[0]
    assert side.requests["first"].stored_chunks == full_chunks
    assert side.requests["first"].tail_done
    keys = [key.hex() for key in [*hasher.keys, hasher.tail_key()]]
    scheduler.request_finished(first, [])
    evicted = httpx.post(daemon.url + "/v1/evict", json={"keys": keys}, headers=daemon.headers, timeout=10)
    assert evicted.raise_for_status().json()["chunks"] == full_chunks + 1

    own_cache = PROMPT_TOKENS // BLOCK_TOKENS * BLOCK_TOKENS  # what vLLM's prefix cache holds of it, block-aligned
    again = request("again", prompt)
    scheduler.on_new_request(again)
    assert scheduler.get_num_new_matched_tokens(again, own_cache) == (0, False)
    scheduler.update_state_after_alloc(again, allocated(100, 1), 0)
    state = side.requests["again"]
    assert state.matches is None and (state.stored_chunks, state.tail_done) == (full_chunks, True)
    scheduler.request_finished(again, [])

    clock[0] += 31  # the knowledge lapsed: looked up, the evicted chunks are found missing, and published again
    late = request("late", prompt)
    scheduler.on_new_request(late)
    assert scheduler.get_num_new_matched_tokens(late, own_cache) == (0, False)
    scheduler.update_state_after_alloc(late, allocated(100, 1), 0)
    state = side.requests["late"]
    assert state.matches is not None and state.stored_chunks == 0
    scheduler.request_finished(late, [])


def test_a_synchronous_load_from_nvme_asks_the_daemon_where_its_chunks_lie_as_it_is_planned(stack):
    """The worker, which reads chunks on NVMe alone from the pack files itself, finds the daemon's answer waiting
    when the step begins, instead of waiting a round trip through the daemon then; it takes that answer, for the
    keys the answer covers (``CacheClient.disk_extents``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from prefixcache.connector.plugin import PrefixCacheConnector

    daemon, model = stack
    config = vllm_config(daemon, model, async_loads="never")
    connector = PrefixCacheConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(config))
    client = CacheClient.connect(daemon.url, connector._scheduler.store.namespaces[0], arena_bytes=64 << 20)
    try:
        prompt = random_prompt(seed=15, length=PROMPT_TOKENS)
        keys, _ = publish_prompt(client, prompt, bytes_per_token=256)
        wait_persisted(client, keys)
        client.index.drop_location(keys, Location("dram", client.node))  # on NVMe alone, as after a restart
        r = request("from-disk", prompt)
        connector.on_new_request(r)
        hit, asynchronous = connector.get_num_new_matched_tokens(r, 0)
        assert hit == PROMPT_TOKENS - 1 and not asynchronous
        connector.update_state_after_alloc(r, allocated(0, -(-PROMPT_TOKENS // BLOCK_TOKENS)), hit)
        meta = connector.build_connector_meta(empty_step())
        (asked,) = meta.extents_asked
        assert asked.node == client.node and list(asked.keys) == [chunk.key for chunk in meta.loads[0]["from-disk"]]
        reply = connector._scheduler.store._index.keyspace.extents_reply(asked.reply_id)
        assert wait_for(lambda: client._redis.exists(reply) == 1)  # answered before any worker asks
        extents = client.disk_extents(keys, [asked])
        assert client._redis.exists(reply) == 0  # taken
        assert all(extents) and extents == client.disk_extents(keys)  # what the daemon answers now
        assert not connector.build_connector_meta(empty_step()).extents_asked  # asked once
    finally:
        client.close()
        connector.shutdown()
