"""A quantity per second learned from samples, the recent ones weighed most: a read path's bandwidth, an engine's
prefill rate. Pure arithmetic."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: Samples after which an old one weighs half as much as the newest.
HALF_LIFE = 4
#: How long an estimate holds without a new sample.
FORGET_S = 60.0


class MovingRate:
    """A quantity per second (tokens/s, bytes/s), from samples of (amount, seconds): the sums of both, each sample
    weighed ``0.5 ** (1 / half_life)`` less at every newer one, forgotten ``forget_s`` after the last."""

    def __init__(
        self, half_life: int = HALF_LIFE, forget_s: float = FORGET_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._keep = 0.5 ** (1 / half_life)
        self._forget_s = forget_s
        self._clock = clock
        self._amount = 0.0
        self._seconds = 0.0
        self._at = -math.inf

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        if self._clock() - self._at > self._forget_s:
            self._amount = self._seconds = 0.0
        self._amount = self._amount * self._keep + amount
        self._seconds = self._seconds * self._keep + seconds
        self._at = self._clock()

    @property
    def per_second(self) -> float | None:
        """The rate, or None before a sample (or once the last one is older than ``forget_s``)."""
        if self._seconds <= 0 or self._clock() - self._at > self._forget_s:
            return None
        return self._amount / self._seconds
