"""What a tier reports of its space (``usage()`` of the DRAM and the NVMe tier), for demotion and ``/v1/stats``."""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.indexer.index import Tier


@dataclass(frozen=True)
class TierUsage:
    """A tier's space at one moment. ``bytes_used`` is what it costs the machine, ``live_bytes`` what it holds."""

    tier: Tier
    bytes_used: int
    live_bytes: int
    capacity_bytes: int
    chunks: int
