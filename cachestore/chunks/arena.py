"""A registered memory arena carved into page-aligned slots.

A slot whose read was abandoned past its deadline may still be written by the transfer that was abandoned
(Mooncake cannot cancel one): ``hold`` keeps such a slot out of use, even once its caller frees it, until the
transfer is known to be over (``Hold``).

Mooncake moves data fastest between buffers registered with it, and registering costs a system call
and pins memory, so each process registers one large arena once and hands out slices of it. Slots are
4 KiB aligned, which also lets the NVMe tier read into them with O_DIRECT.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time

from prefixcache.indexer.errors import PrefixCacheError

ALIGN = 4096


class ArenaFullError(PrefixCacheError, MemoryError):
    """No free slot is large enough right now; callers retry with a smaller batch or later."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Hold:
    """Until when memory an abandoned transfer may still write stays out of use: the call that started the transfer
    has returned (``over``) and ``margin_s`` has passed since, for the transfers it left running behind it."""

    def __init__(self, margin_s: float) -> None:
        self._margin_s = margin_s
        self._over_at: float | None = None

    def over(self) -> None:
        """The call has returned."""
        self._over_at = time.monotonic()

    def expired(self) -> bool:
        return self._over_at is not None and time.monotonic() >= self._over_at + self._margin_s


class Arena:
    """First-fit allocator over ``size`` bytes at ``address`` (memory owned elsewhere)."""

    def __init__(self, address: int, size: int) -> None:
        if address % ALIGN or size <= 0:
            raise ValueError("an arena is page aligned and non-empty")
        self.address = address
        self.size = size
        self._view = view_at(address, size)
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (offset, length)
        self._held: dict[int, Hold] = {}  # offset of a held slot -> its hold
        self._freed_held: list[tuple[int, int]] = []  # held slots their callers freed: (offset, length)
        self._lock = threading.Lock()

    def alloc(self, size: int) -> memoryview:
        """A writable view of ``size`` bytes at a page-aligned offset."""
        need = _aligned(max(size, 1))
        with self._lock:
            if self._freed_held:
                self._reclaim()
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
            if offset in self._held:
                self._freed_held.append((offset, length))
                return
            self._insert(offset, length)

    def hold(self, view: memoryview, margin_s: float) -> Hold:
        """Keep ``view``'s slot out of use, once freed, until the returned hold is over and ``margin_s`` has
        passed (``Hold.over``): an abandoned transfer may still write into it."""
        offset = self.offset_of(view)
        if offset is None:
            raise ValueError("view does not belong to this arena")
        hold = Hold(margin_s)
        with self._lock:
            self._held[offset] = hold
        return hold

    @property
    def held_bytes(self) -> int:
        """Bytes of freed slots still held (``hold``)."""
        with self._lock:
            return sum(length for _, length in self._freed_held)

    def _reclaim(self) -> None:
        """Free the held slots whose hold has expired (call with the lock held)."""
        kept = []
        for offset, length in self._freed_held:
            if self._held[offset].expired():
                del self._held[offset]
                self._insert(offset, length)
            else:
                kept.append((offset, length))
        self._freed_held = kept

    def _insert(self, offset: int, length: int) -> None:
        """Return [offset, offset + length) to the free list, merged with its neighbours (call with the lock held)."""
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
