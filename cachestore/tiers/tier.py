"""The contract every storage tier keeps (DRAM, NVMe, object): put, read into a buffer, ask, delete, measure, report
health. Each tier's class names ``StorageTier`` as its base, so that the type checker (``make lint``) proves it keeps
the contract's signatures.

Services that only move bytes between tiers, measure them or report on them see a tier through ``StorageTier``;
what only one tier does (the DRAM tier's arena and scattered reads, the NVMe tier's extents for same-node
readers) stays on its own class. Errors are answers, never exceptions: a tier that cannot reach its store
reports misses, ``False`` puts and ``Removal.FAILED`` deletes, and says why in ``health()``. Which chunks a tier
gives up under pressure is a separate piece, its ``EvictionPolicy`` (cachestore/tiers/eviction_policy.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from prefixcache.cachestore.tiers.usage import TierUsage
from prefixcache.indexer.index import Tier


class Removal(Enum):
    """What ``delete`` did to one key's copy."""

    REMOVED = "removed"  # the tier held it and holds it no more
    ABSENT = "absent"  # the tier did not hold it
    FAILED = "failed"  # the tier could not be reached or refused: the copy may still be there

    @property
    def gone(self) -> bool:
        """Whether the tier holds no copy now, so that the index may stop naming it."""
        return self is not Removal.FAILED


@dataclass(frozen=True)
class TierHealth:
    """A tier's state for ``/v1/health``: down (``ok`` False), serving while failing part of its job
    (``degraded``), or well; ``detail`` says which, for an operator."""

    ok: bool
    detail: str
    degraded: bool = False


class StorageTier(Protocol):
    """One tier of the cache: objects under 16-byte chunk keys, stored, read and removed in batches."""

    @property
    def tier(self) -> Tier:
        """The tier's name in index locations."""
        ...

    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store each object under its key; per item, whether it is stored now."""
        ...

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[int]:
        """Read each object into its buffer; its length, or a negative number for a miss."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds its object."""
        ...

    def delete(self, keys: Sequence[bytes]) -> list[Removal]:
        """Remove each key's object; per key, what became of it (a key given twice answers twice alike)."""
        ...

    def usage(self) -> TierUsage:
        """The tier's space now."""
        ...

    def health(self) -> TierHealth:
        """Whether the tier serves, and how well."""
        ...
