"""Whether a hit pays: a load is started only where it is faster than computing the same tokens. Pure logic.

A hit's chunks come over paths of different speeds: this node's DRAM (a memory copy), another node's DRAM (the
network: a congested or rate-limited link moves a few MB/s), this node's NVMe. Where a path is slower than the
engine computes, loading over it makes the request slower than no cache at all, so the scheduler side cuts the hit
before the first chunk from which loading no longer pays (``LoadCosts.paying_tokens``), and vLLM computes the rest.

Both sides of the comparison are learned from what this engine does, never configured:

- the prefill rate from its own steps: the tokens a step computed over the time between the step's scheduling and
  the next one's, from steps that computed at least ``PREFILL_SAMPLE_TOKENS`` (a decode step's cost per token says
  nothing of a prefill's) and that the engine ran back to back (no idle gap in between);
- each path's bandwidth from the workers' reads over it (bytes and seconds, per path, sent with the step's
  statistics). A read abandoned at its deadline counts with the seconds it was given: the path is at most that fast.

Each is a moving average (cachestore/client/moving_rate.py) that weighs the last ``HALF_LIFE`` samples most, so
a link that became slow (or fast again) is followed within a few reads. A path not yet measured, or an engine whose
rate is not yet known, loads: nothing says the hit costs more than it saves. A path skipped is not measured again
by this engine: its estimate is forgotten after ``FORGET_S``, so the hit is tried once more.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from prefixcache.cachestore.client.moving_rate import MovingRate

ReadPath = Literal["local_dram", "remote_dram", "nvme"]
READ_PATHS: tuple[ReadPath, ...] = ("local_dram", "remote_dram", "nvme")
#: A step counts for the prefill rate when it computed at least this many tokens (mostly prompt tokens).
PREFILL_SAMPLE_TOKENS = 256


@dataclass(frozen=True)
class HitPart:
    """Tokens of a hit that come over one path, in the order they are loaded."""

    tokens: int
    path: ReadPath


class LoadCosts:
    """The scheduler side's estimate of a load's time against computing the same tokens (module docstring)."""

    def __init__(self, bytes_per_token: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._bytes_per_token = bytes_per_token
        self._prefill = MovingRate(clock=clock)
        self._paths = {path: MovingRate(clock=clock) for path in READ_PATHS}

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step that computed ``tokens`` in ``seconds`` (scheduling to scheduling, with no idle gap)."""
        if tokens >= PREFILL_SAMPLE_TOKENS:
            self._prefill.add(tokens, seconds)

    def observe_reads(self, reads: Mapping[ReadPath, tuple[float, float]]) -> None:
        """The workers' reads since the last report: bytes and seconds per path."""
        for path, (nbytes, seconds) in reads.items():
            self._paths[path].add(nbytes, seconds)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self._prefill.per_second

    def bandwidth(self, path: ReadPath) -> float | None:
        """Bytes/s over ``path``, or None while unknown."""
        return self._paths[path].per_second

    def paying_tokens(self, parts: Iterable[HitPart]) -> int:
        """How many of the hit's tokens (``parts``, in order) to load: the prefix whose load saves the most time
        over computing it, 0 where none saves any. All of it while the prefill rate is unknown; a part over a path
        not yet measured costs nothing."""
        rate = self._prefill.per_second
        parts = list(parts)
        if rate is None:
            return sum(part.tokens for part in parts)
        saved = best_saved = 0.0
        tokens = best_tokens = 0
        for part in parts:
            bandwidth = self._paths[part.path].per_second
            load_s = part.tokens * self._bytes_per_token / bandwidth if bandwidth else 0.0
            saved += part.tokens / rate - load_s
            tokens += part.tokens
            if saved > best_saved:
                best_saved, best_tokens = saved, tokens
        return best_tokens
