"""A load through arena slots, as a handle (``CacheClient.load``): what its fetches read ahead belongs to it.

A load names the chunks it will fetch next with the slots it will pass for them, and the client starts reading
those on this node's NVMe into the slots at once (``read_ahead``, and the ``upcoming`` chunks of each fetch). Those
reads, until fetched, write into the caller's slots: the handle holds them, and ``close`` waits for the ones never
fetched, so that no read still writes into a slot the caller hands out again. What each fetch read from NVMe comes
back with it (``Fetched.from_disk``), for the caller to store into DRAM once its load is over. Every load holds its
own reads: loads on different threads never see one another's.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Generic, TypeVar, cast

if TYPE_CHECKING:
    from prefixcache.cachestore.client.cache_client import CacheClient

#: What ``SlotLoad.fetch_checking_later`` gives per chunk: its verified payload, a future of it, or None (a miss).
FetchedPayload = memoryview | Future[memoryview | None] | None
P = TypeVar("P", memoryview | None, FetchedPayload)


@dataclass
class Fetched(Generic[P]):
    """One fetch's chunks: per chunk its payload (a view into its slot; None: a miss the caller recomputes), and the
    chunks it read straight from this node's NVMe, (key, verified object), each a view into the caller's slot: hand
    them to ``CacheClient.store_disk_reads`` before releasing those slots, so that the next load of these chunks
    comes from DRAM."""

    payloads: list[P]
    from_disk: list[tuple[bytes, memoryview]] = field(default_factory=list)


class SlotLoad:
    """One load through arena slots (``CacheClient.load``). It owns the NVMe reads it started into the caller's slots
    ahead of their fetch (key -> (slot, the read's future of the object's length)) until they are fetched or the load
    is closed: ``close`` (or leaving its ``with`` block) waits for those never fetched and forgets them, so that the
    caller may then release the slots. Closing twice is harmless, and a closed load may fetch again (a load in
    windows closes each window's reads before handing its slots out again)."""

    def __init__(self, client: CacheClient) -> None:
        self._client = client
        self.ahead: dict[bytes, tuple[memoryview, Future[int]]] = {}

    def read_ahead(self, chunks: Sequence[tuple[bytes, memoryview]]) -> None:
        """Start bringing back chunks the caller found missing from DRAM, each into its slot (of ``read_size``
        bytes): this node's are read straight from its NVMe (asked first, without reading the index: the common
        case on a node that published them), other nodes' are promoted. The ``fetch`` of those slots then waits
        for them instead of asking DRAM again."""
        self._client._read_ahead(self, chunks)

    def fetch(
        self,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        *,
        upcoming: Sequence[tuple[bytes, memoryview]] = (),
        cuts: Sequence[int | None] = (),
        across_network: bool = False,
    ) -> Fetched[memoryview | None]:
        """Each chunk's verified payload (a view into its slot), or None: a miss the caller recomputes.

        A chunk missing from DRAM, or whose DRAM copy fails verification (and is deleted), comes from
        the NVMe tier: read straight from the pack files when this node holds it (slots of
        ``read_size`` bytes let that read land in place), else promoted by the daemon of a node that
        does. ``upcoming`` names the chunks the caller will fetch next, in order, each with the slot it
        will pass for it: when this call must go to NVMe, it plans those of them with no DRAM copy in
        the same requests, and starts reading this node's straight into those slots, so later calls
        find them read or on their way, or promoted. ``cuts``: where each chunk's DRAM copy is cut, if
        the caller knows (``MooncakeTier.get_into``), so that its two parts come in one call. ``across_network``:
        some DRAM copies may lie on other nodes (the lookup said so), so the read has a deadline
        (``READ_DEADLINE_FLOOR_S``), and ``slots`` must be arena slots.
        """
        return cast(  # all checked
            "Fetched[memoryview | None]", self._client._fetch(self, keys, slots, upcoming, None, cuts, across_network)
        )

    def fetch_checking_later(
        self,
        keys: Sequence[bytes],
        slots: Sequence[memoryview],
        *,
        checks: Executor,
        upcoming: Sequence[tuple[bytes, memoryview]] = (),
        cuts: Sequence[int | None] = (),
        across_network: bool = False,
    ) -> Fetched[FetchedPayload]:
        """``fetch``, returning as soon as DRAM has copied its chunks into their slots: each of those comes
        back as a future of its verified payload, its MAC computed on ``checks``, so the caller reads
        the next chunks while these are checked, on as many threads as ``checks`` has (on one thread of an
        H100 host, checking a chunk took three quarters as long as Mooncake's copy of it). A future that
        resolves to None was a damaged DRAM copy, now deleted: ``fetch`` that chunk again to have it from
        NVMe. Chunks from NVMe come back verified, as from ``fetch``. The caller waits for every future
        before it releases their slots.
        """
        return self._client._fetch(self, keys, slots, upcoming, checks, cuts, across_network)

    def close(self) -> None:
        """Wait for the reads started ahead for chunks that were never fetched, and forget them."""
        reads, self.ahead = self.ahead, {}
        for _, read in reads.values():
            read.exception()  # waits; a failed read only matters to the fetch that never came

    def __enter__(self) -> SlotLoad:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
