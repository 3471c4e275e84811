"""Which of a tier's chunks go first when it needs room: the order, apart from the storage that keeps the bytes.

A tier tells its policy what it stores, reads and forgets, and asks it for the coldest keys; whether one of those
may go (pins, leases) is the tier owner's answer, not the policy's. Policies are not thread-safe: a tier calls
its policy under the lock that guards its own map of keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator
from itertools import islice
from typing import Protocol


class EvictionPolicy(Protocol):
    """The order in which a tier evicts its keys."""

    def stored(self, key: bytes, *, used: bool) -> None:
        """``key`` was written: a new key enters the order; ``used`` (a write a caller asked for, not a copy the
        tier made of its own, such as compaction's) counts as a use of it."""
        ...

    def used(self, key: bytes) -> None:
        """``key`` was read."""
        ...

    def forgotten(self, key: bytes) -> None:
        """``key`` is no longer stored."""
        ...

    def coldest(self, skip: Container[bytes], limit: int) -> list[bytes]:
        """Up to ``limit`` keys not in ``skip``, the first to evict first."""
        ...

    def __iter__(self) -> Iterator[bytes]:
        """Every key, the first to evict first."""
        ...


class LruPolicy:
    """Least recently used first. A key entered without a use (a restart's, in creation order) ranks as new."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def stored(self, key: bytes, *, used: bool) -> None:
        if key not in self._order:
            self._order[key] = None
        elif used:
            self._order.move_to_end(key)

    def used(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def forgotten(self, key: bytes) -> None:
        self._order.pop(key, None)

    def coldest(self, skip: Container[bytes], limit: int) -> list[bytes]:
        """A fresh walk each time: reads reorder the keys between two calls."""
        return list(islice((key for key in self._order if key not in skip), limit))

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._order)
