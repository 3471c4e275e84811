"""The connector's plan arithmetic (pure logic; the engine tests run it inside real vLLM)."""

import dataclasses
from types import SimpleNamespace

from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

from connector.plans import Geometry, chunks_to_publish, load_plan
from connector.scheduler_side import blocks_vllm_writes_first
from indexer.index import PartialHit, PrefixMatch

G = Geometry(chunk_tokens=256, block_tokens=128)
BLOCKS = list(range(100, 120))  # the request's blocks, in token order


def match(full: int, partial_tokens: int = 0, stored: int = 0) -> PrefixMatch:
    partial = PartialHit(key=b"p" * 16, tokens=partial_tokens, stored_tokens=stored) if partial_tokens else None
    return PrefixMatch(keys=[bytes([i]) * 16 for i in range(full)], chunk_tokens=256, partial=partial)


def test_full_chunks_then_the_pages_of_a_partial_tail():
    plan = load_plan(match(3, partial_tokens=231, stored=232), BLOCKS, 0, 999, G)  # L-1 of a 1000-token prompt
    assert [(c.key[:1], c.first_page, c.blocks) for c in plan] == [
        (b"\x00", 0, [100, 101]), (b"\x01", 0, [102, 103]), (b"\x02", 0, [104, 105]), (b"p", 0, [106, 107]),
    ]  # fmt: skip
    assert plan[-1].stored_tokens == 232


def test_a_partial_hit_loads_only_the_pages_it_needs():
    plan = load_plan(match(2, partial_tokens=88, stored=256), BLOCKS, 0, 600, G)
    assert [(c.first_page, c.blocks) for c in plan] == [(0, [100, 101]), (0, [102, 103]), (0, [104])]


def test_chunks_the_lookup_found_on_nvme_alone_are_marked_so():
    m = dataclasses.replace(match(3, partial_tokens=40, stored=232), without_dram=frozenset({1}))
    assert [c.in_dram for c in load_plan(m, BLOCKS, 0, 808, G)] == [True, False, True, True]  # the partial: unknown


def test_what_vllm_holds_locally_is_not_loaded_again():
    plan = load_plan(match(4), BLOCKS, 384, 1000, G)  # the local prefix cache holds 3 blocks
    assert [(c.key[:1], c.first_page, c.blocks) for c in plan] == [
        (b"\x01", 1, [103]), (b"\x02", 0, [104, 105]), (b"\x03", 0, [106, 107]),
    ]  # fmt: skip


def test_full_chunks_are_published_as_soon_as_computed_and_the_tail_once_the_prompt_is():
    assert chunks_to_publish(0, 512, 1000, False, G) == ([(0, 256), (256, 512)], False)  # a chunked-prefill step
    assert chunks_to_publish(2, 1000, 1000, False, G) == ([(512, 768), (768, 1000)], True)
    assert chunks_to_publish(3, 1001, 1000, True, G) == ([], True)  # decode steps publish nothing


def test_a_tail_shorter_than_the_probe_is_not_published():
    assert chunks_to_publish(0, 1030, 1030, False, G) == ([(0, 256), (256, 512), (512, 768), (768, 1024)], True)


def test_blocks_vllm_zeroes_or_copies_into_are_written_before_a_load_may_start():
    step = SimpleNamespace(new_block_ids_to_zero=[3, 4], kv_cache_block_copies=[KVCacheBlockCopy(7, 9)])
    assert blocks_vllm_writes_first(step) == {3, 4, 9}  # the copy's source is only read
    assert blocks_vllm_writes_first(SimpleNamespace(new_block_ids_to_zero=None, kv_cache_block_copies=None)) == set()
