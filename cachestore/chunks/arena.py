"""A registered memory arena carved into page-aligned slots.

Mooncake moves data fastest between buffers registered with it, and registering costs a system call
and pins memory, so each process registers one large arena once and hands out slices of it. Slots are
4 KiB aligned, which also lets the NVMe tier read into them with O_DIRECT.
"""

from __future__ import annotations

import bisect
import ctypes
import threading

from prefixcache.indexer.errors import PrefixCacheError

ALIGN = 4096


class ArenaFullError(PrefixCacheError, MemoryError):
    """No free slot is large enough right now; callers retry with a smaller batch or later."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """First-fit allocator over ``size`` bytes at ``address`` (memory owned elsewhere)."""

    def __init__(self, address: int, size: int) -> None:
        if address % ALIGN or size <= 0:
            raise ValueError("an arena is page aligned and non-empty")
        self.address = address
        self.size = size
        self._view = view_at(address, size)
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._lock = threading.Lock()

    def alloc(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes at a page-aligned offset."""
        need = _aligned(max(size, 1))
        with self._lock:
            for i, (offset, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + need, length - need)
                    return self._view[offset : offset + size]
        raise ArenaFullError(f"no free {need}-byte slot in a {self.size}-byte arena")

    def alloc_batch(self, sizes: list[int]) -> list[memoryview]:
        """Slots for the longest leading run of ``sizes`` that fits now (at least one, or ArenaFullError).

        Background services move work in batches as large as the arena allows and take the rest next.
        """
        slots: list[memoryview] = []
        for size in sizes:
            try:
                slots.append(self.alloc(size))
            except ArenaFullError:
                if not slots:
                    raise
                break
        return slots

    def free(self, view: memoryview) -> None:
        offset = self.offset_of(view)
        if offset is None:
            raise ValueError("view does not belong to this arena")
        length = _aligned(max(len(view), 1))
        with self._lock:
            i = bisect.bisect(self._free, (offset, length))
            self._free.insert(i, (offset, length))
            if i + 1 < len(self._free) and offset + length == self._free[i + 1][0]:  # merge with the next
                self._free[i] = (offset, length + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and with the previous
                prev_offset, prev_length = self._free[i - 1]
                self._free[i - 1] = (prev_offset, prev_length + self._free.pop(i)[1])

    def offset_of(self, view: memoryview) -> int | None:
        """The view's offset in the arena, or None if it lies (even partly) elsewhere."""
        address = address_of(view)
        if address is None or not self.address <= address <= self.address + self.size - len(view):
            return None
        return address - self.address

    def view_at(self, offset: int, size: int) -> memoryview:
        return self._view[offset : offset + size]

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)


def view_at(address: int, size: int) -> memoryview:
    """A writable byte view of ``size`` bytes at ``address``, memory someone else owns and keeps alive."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def address_of(view: memoryview) -> int | None:
    """Address of a contiguous buffer's first byte (None for read-only or non-contiguous buffers)."""
    if view.readonly or not view.c_contiguous:
        return None
    if len(view) == 0:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))
