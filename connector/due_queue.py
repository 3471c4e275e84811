"""The queue of the connector's background thread: jobs that run as soon as the thread reaches them, and jobs that
wait until they are due. A store into DRAM of chunks a load read from NVMe waits until the tokens of the step that
read them have gone out, while publishes queued after it, which other instances wait for, run before it."""

from __future__ import annotations

import heapq
import itertools
import queue
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class DueQueue(Generic[T]):
    """A bounded queue for one consumer thread, in which a job may wait until it is due (``time.monotonic()``)."""

    def __init__(self, maxsize: int) -> None:
        self._queue: queue.Queue[tuple[float, T] | None] = queue.Queue(maxsize)
        self._waiting: list[tuple[float, int, T]] = []  # taken off the queue, not due yet: a heap by due time
        self._order = itertools.count()  # jobs due at the same time keep their order
        self._closed = False

    def put_nowait(self, job: T, due: float = 0.0) -> None:
        """Queue ``job``, to be handed out once ``due``; raises ``queue.Full`` when the consumer has fallen behind."""
        self._queue.put_nowait((due, job))

    def close(self) -> None:
        """No more jobs: those queued and those waiting are handed out at once, then ``get`` answers None."""
        self._queue.put(None)

    def get(self) -> T | None:
        """The next job that is due, waiting for it; None once closed and every job has been handed out."""
        while True:
            now = time.monotonic()
            if self._waiting and (self._closed or self._waiting[0][0] <= now):
                return heapq.heappop(self._waiting)[2]
            if self._closed:
                return None
            try:
                item = self._queue.get(timeout=self._waiting[0][0] - now if self._waiting else None)
            except queue.Empty:  # the first waiting job is due
                continue
            if item is None:
                self._closed = True
                continue
            due, job = item
            heapq.heappush(self._waiting, (due, next(self._order), job))
