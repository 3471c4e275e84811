"""What every chunk tier offers the daemon, so eviction, promotion and reporting treat DRAM and NVMe alike.

A chunk is an opaque byte string (the codec's signed header and payload) under a 16-byte key. Tiers
never parse it: verification belongs to the codec, placement and capacity to the tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixcache.indexer.index import Tier


@dataclass(frozen=True)
class TierUsage:
    """A tier's space at one moment. ``bytes_used`` is what it costs the machine, ``live_bytes`` what it holds."""

    tier: Tier
    bytes_used: int
    live_bytes: int
    capacity_bytes: int
    chunks: int


class ChunkTier(Protocol):
    """The interface the DRAM and NVMe tiers both implement.

    Batches everywhere: a tier amortises its fixed costs (a sync, a round trip) over a batch, and the
    daemon always has one. Results come back per item, in the order given.
    """

    tier: Tier

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store each (key, object); True where the object is stored, as durably as the tier promises."""
        ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into its caller-owned buffer; its length, or -1 for a miss."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> int:
        """Forget these keys; how many existed."""
        ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None: ...
