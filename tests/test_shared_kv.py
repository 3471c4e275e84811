"""Where vLLM's KV cache allocation goes under ``SharedKVAllocation``: pure logic, with memory from a bytearray."""

from __future__ import annotations

import logging

import torch

from prefixcache.connector.shared_kv import SharedKVAllocation


def test_the_kv_buffer_comes_from_the_allocator_zeroed_and_only_once():
    memory = bytearray(4096)
    mode = SharedKVAllocation(lambda size: memoryview(memory)[:size])
    with mode:
        kv = torch.zeros(1024, dtype=torch.int8, device="cpu")
        second = torch.zeros(1024, dtype=torch.int8)
    kv[0] = 5
    assert memory[0] == 5 and not kv[1:].any()  # the tensor is a view of the allocator's memory
    assert mode.allocated is not None and second.data_ptr() != kv.data_ptr()


def test_other_allocations_are_left_alone():
    calls = []
    with SharedKVAllocation(lambda size: calls.append(size) or memoryview(bytearray(size))):
        torch.zeros(16, dtype=torch.float32)
        torch.zeros(4, 4, dtype=torch.int8)
        torch.ones(16, dtype=torch.int8)
    assert calls == []


def test_a_refused_allocation_falls_back_to_ordinary_memory(caplog):
    def refuse(size: int) -> memoryview:
        raise MemoryError("pool exhausted")

    with caplog.at_level(logging.WARNING), SharedKVAllocation(refuse):
        kv = torch.zeros(64, dtype=torch.int8, device="cpu")
    assert kv.shape == (64,) and not kv.any()
    assert "pool exhausted" in caplog.text
