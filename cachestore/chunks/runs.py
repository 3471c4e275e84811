"""Splitting an ordered batch of objects into consecutive runs of about a given size."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def runs_of_about(items: Sequence[T], size_of: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive runs of ``items``, each closed once it holds ``limit`` bytes or more.

    Pipelines move one run while the next is read: runs must be large enough that per-call costs stay
    small, small enough that the first one arrives early. Every run holds at least one item.
    """
    runs: list[list[T]] = []
    size = limit
    for item in items:
        if size >= limit:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += size_of(item)
    return runs
