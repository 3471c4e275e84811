"""Chunks read from DRAM straight into the caller's memory, as a handle that owns them until it is closed.

The connector reads each chunk's header and tokens into an arena slot and its payload into the KV pages themselves,
so a load copies each byte once (``MooncakeTier.get_scattered``). What lands there counts for nothing until it is
checked where it landed: a ``ScatteredRead`` (``CacheClient.read_in_place``) owns the chunks' slots, their copies
from DRAM, their checks and the record of the fetch, so that a load cannot use a chunk it did not verify, nor keep a
slot it is done with.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from prefixcache.cachestore.client import trace

if TYPE_CHECKING:
    from prefixcache.cachestore.client.cache_client import CacheClient

log = logging.getLogger("prefixcache.client")


@dataclass(frozen=True)
class Landed:
    """Where one chunk read in place lands: its header and tokens in ``head`` (the start of ``slot``, an arena slot
    that also holds what of its payload the caller does not keep), then its payload across ``first`` (the pieces of
    its first DRAM part, after the header) and ``rest`` (those of its second: cachestore/tiers/dram.py; empty: the
    copy is not cut), in order."""

    key: bytes
    slot: memoryview
    head: memoryview
    first: Sequence[memoryview]
    rest: Sequence[memoryview] = ()

    @property
    def payload(self) -> list[memoryview]:
        return [*self.first, *self.rest]


class ScatteredRead:
    """Chunks read from DRAM into the caller's memory (``CacheClient.read_in_place``), and what they hold.

    It owns, so that no step of a read in place can be forgotten: the arena slots holding the chunks' headers (given
    back by ``close``, or by leaving its ``with`` block, once the caller is done with them: after it copied out pages
    held there; ``take`` moves chunks, slots included, into a handle of their own), each chunk's verdict (False until
    ``check`` or ``verify`` found the chunk intact where it landed: a read never verified reports no chunk loaded),
    and the record of the fetch (made once, by ``verify``, timed from ``started``). Closing twice is harmless.
    ``check`` may run on several threads at once, each for other chunks; a damaged chunk's DRAM copy is deleted when
    it is checked.
    """

    def __init__(self, client: CacheClient, chunks: Sequence[Landed], started: float) -> None:
        self._client = client
        self.chunks = list(chunks)
        self._started = started
        self._verdicts: list[bool | None] = [None] * len(self.chunks)  # None: not checked yet
        self._recorded = False
        self._holds = [True] * len(self.chunks)  # whose slots this handle gives back on close
        self._lock = threading.Lock()

    def fetch(self, whole: Sequence[bool]) -> list[bool]:
        """Copy each chunk's first DRAM part into place, and its second too where ``whole[i]``, in one call to the
        segment owner; returns which chunks arrived (one that did not may have written some of its pieces)."""
        keys: list[bytes] = []
        parts: list[list[memoryview]] = []
        second: list[bool] = []
        at: list[tuple[int, int | None]] = []  # per chunk: where its parts are in the call
        for chunk, both in zip(self.chunks, whole, strict=True):
            at.append((len(keys), len(keys) + 1 if both else None))
            keys += [chunk.key] * (1 + both)
            parts += [[chunk.head, *chunk.first], list(chunk.rest)] if both else [[chunk.head, *chunk.first]]
            second += [False, True] if both else [False]
        got = self._client._copy_scattered(keys, parts, second)
        return [got[i] and (j is None or got[j]) for i, j in at]

    def fetch_rest(self) -> list[bool]:
        """Copy each chunk's second DRAM part into place, in one call; returns which arrived."""
        return self._client._copy_scattered(
            [chunk.key for chunk in self.chunks], [chunk.rest for chunk in self.chunks], [True] * len(self.chunks)
        )

    def take(self, positions: Sequence[int]) -> ScatteredRead:
        """A handle of its own for the chunks at ``positions``, in that order, with their slots and verdicts; this one
        no longer gives those slots back."""
        taken = ScatteredRead(self._client, [self.chunks[i] for i in positions], self._started)
        with self._lock:
            for at, i in enumerate(positions):
                taken._verdicts[at], taken._holds[at] = self._verdicts[i], self._holds[i]
                self._holds[i] = False
        return taken

    def check(self, i: int) -> bool:
        """Verify chunk ``i`` where it landed (again if it was); whether it is intact. Never raises: a chunk whose
        check fails to run counts as failed (recomputed)."""
        chunk = self.chunks[i]
        try:
            self._verdicts[i] = self._client._verified_scattered(chunk.key, chunk.head, chunk.payload)
        except Exception:  # noqa: BLE001 - a failed load is recomputed; the request must not fail
            log.exception("verifying a chunk failed; recomputing it")
            self._verdicts[i] = False
        return self._verdicts[i] is True

    def verify(self) -> list[bool]:
        """Every chunk's verdict, checking those not checked yet; records the fetch (once)."""
        trace.mark("verify", chunks=len(self.chunks))
        for i, verdict in enumerate(self._verdicts):
            if verdict is None:
                self.check(i)
        trace.mark("verify_end", chunks=len(self.chunks))
        intact = self.verdicts
        with self._lock:
            recorded, self._recorded = self._recorded, True
        if not recorded:
            self._client._record_scattered_fetch(intact, self._started)
        return intact

    @property
    def verdicts(self) -> list[bool]:
        """Whether each chunk was found intact so far (one not checked: False)."""
        return [verdict is True for verdict in self._verdicts]

    def close(self) -> None:
        """Give back the slots of the chunks this handle holds (once)."""
        with self._lock:
            slots = [chunk.slot for chunk, held in zip(self.chunks, self._holds, strict=True) if held]
            self._holds = [False] * len(self.chunks)
        for slot in slots:
            self._client.release(slot)

    def __enter__(self) -> ScatteredRead:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
