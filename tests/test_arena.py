import mmap
import time

import pytest

from prefixcache.cachestore.chunks.arena import ALIGN, Arena, ArenaFullError, address_of


@pytest.fixture
def arena():
    memory = mmap.mmap(-1, 16 * ALIGN)
    yield Arena(address_of(memoryview(memory)), len(memory))


def test_slots_are_aligned_disjoint_and_reused_after_free(arena):
    a, b = arena.alloc(100), arena.alloc(ALIGN + 1)
    assert arena.offset_of(a) == 0 and arena.offset_of(b) == ALIGN
    a[:] = b"x" * 100
    b[:3] = b"abc"
    assert bytes(a[:3]) == b"xxx"
    arena.free(a)
    assert arena.offset_of(arena.alloc(ALIGN)) == 0


def test_freed_neighbours_coalesce_so_a_large_slot_fits_again(arena):
    slots = [arena.alloc(ALIGN) for _ in range(16)]
    with pytest.raises(ArenaFullError):
        arena.alloc(1)
    for slot in slots[3:9]:
        arena.free(slot)
    assert arena.offset_of(arena.alloc(6 * ALIGN)) == 3 * ALIGN
    for slot in slots[:3] + slots[9:]:
        arena.free(slot)
    assert arena.free_bytes == 10 * ALIGN


def test_views_from_elsewhere_are_recognised(arena):
    assert arena.offset_of(memoryview(bytearray(10))) is None
    with pytest.raises(ValueError):
        arena.free(memoryview(bytearray(10)))
    assert address_of(memoryview(b"read-only")) is None


def test_a_batch_takes_the_leading_sizes_that_fit_and_raises_only_when_none_does(arena):
    slots = arena.alloc_batch([4 * ALIGN, 8 * ALIGN, 8 * ALIGN, ALIGN])
    assert [len(s) for s in slots] == [4 * ALIGN, 8 * ALIGN]  # the third does not fit: stop there
    with pytest.raises(ArenaFullError):
        arena.alloc_batch([8 * ALIGN])


def test_a_held_slot_stays_out_of_use_after_its_free_until_its_hold_is_over(arena):
    """A read abandoned at its deadline may still write its slot: freed, the slot waits for the read's call to
    return and the margin to pass."""
    held, other = arena.alloc(ALIGN), arena.alloc(ALIGN)
    hold = arena.hold(held, margin_s=0.05)
    arena.free(held)
    arena.free(other)
    assert arena.held_bytes == ALIGN
    assert [arena.offset_of(arena.alloc(ALIGN)) for _ in range(15)] == list(range(ALIGN, 16 * ALIGN, ALIGN))
    with pytest.raises(ArenaFullError):
        arena.alloc(1)  # the held slot is not handed out, though its caller freed it
    hold.over()
    with pytest.raises(ArenaFullError):
        arena.alloc(1)  # the call returned, but a transfer it left may still write for the margin
    time.sleep(0.1)
    assert arena.offset_of(arena.alloc(ALIGN)) == 0
    assert arena.held_bytes == 0
