"""Chunks this engine's scheduler side knows to be in the store, for a while: a request that can load nothing needs
no index lookup when every chunk of its prompt is among them.

A request whose prompt vLLM's own prefix cache holds can load nothing from the store (vLLM already has every chunk
it could give), and a lookup of it would only say which of its chunks need not be published again: a Redis round
trip inside vLLM's own hit, about a third of the time the connector adds to it. vLLM holds those chunks because this
engine computed and published them, or found them stored, a moment ago; the scheduler side notes their keys then
(``add``). A key is known for ``KNOWN_FOR_S`` after the lookup that found it or the step that published it, and a
request answered from here notes nothing: after that, the next such request is looked up again, so that chunks the
store has evicted since are published again. Pure bookkeeping: no I/O.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

#: How long a key is known after it was found stored or published: short enough that a chunk the store evicted is
#: published again soon, long enough that a prompt repeated within it is never looked up for publishing alone.
KNOWN_FOR_S = 30.0
#: Keys known at most (16 bytes each): the newest are kept, some thousands of prompts' worth.
KNOWN_KEYS = 1 << 16


class KnownStored:
    """Chunk keys found stored or published, each for ``known_for_s``, the newest ``capacity`` of them."""

    def __init__(
        self, known_for_s: float = KNOWN_FOR_S, capacity: int = KNOWN_KEYS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self._known_for_s = known_for_s
        self._capacity = capacity
        self._clock = clock
        self._until: OrderedDict[bytes, float] = OrderedDict()  # key -> when it stops being known, oldest first

    def __len__(self) -> int:
        return len(self._until)

    def add(self, keys: Iterable[bytes]) -> None:
        """These chunks were found stored, or published, just now."""
        until = self._clock() + self._known_for_s
        for key in keys:
            self._until[key] = until
            self._until.move_to_end(key)
        while len(self._until) > self._capacity:
            self._until.popitem(last=False)

    def holds(self, keys: Iterable[bytes]) -> bool:
        """Whether every one of ``keys`` is known stored now."""
        now = self._clock()
        while self._until and next(iter(self._until.values())) <= now:  # oldest first: drop what lapsed
            self._until.popitem(last=False)
        return all(key in self._until for key in keys)
