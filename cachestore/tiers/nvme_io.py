"""The NVMe tier's I/O helpers: O_DIRECT reads of its pack files at page alignment, straight into the caller's
memory. The tier itself (cachestore/tiers/nvme.py, whose manifest is in RocksDB) and the connector's loads that read
its pack files themselves (connector/loaders/nvme_layered.py) share them; nothing here needs RocksDB.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from typing import NamedTuple

from prefixcache.cachestore.chunks.arena import address_of

#: O_DIRECT needs offsets, lengths and buffer addresses aligned to the disk's logical block; a page
#: satisfies every disk, and anonymous mmaps are page-aligned for free.
PAGE = 4096


def page_align(n: int) -> int:
    return -(-n // PAGE) * PAGE


def read_size(length: int) -> int:
    """Bytes a page-aligned buffer needs for ``NvmeTier.get_into`` (cachestore/tiers/nvme.py) to read a
    ``length``-byte object straight into it.

    A smaller (or unaligned) buffer still works, through a bounce buffer and one more copy.
    """
    return page_align(length)


class Extent(NamedTuple):
    """Where an object's bytes lie, for a reader in another process on this node (see ``read_extent`` in
    cachestore/tiers/nvme.py, or ``read_pieces``)."""

    path: str  # its pack file
    offset: int  # page-aligned
    length: int


def open_for_reading(path: str) -> int:
    """O_DIRECT where the file system supports it (tmpfs does not), else through the page cache."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def read_pieces(fd: int, views: Sequence[memoryview], offset: int) -> bool:
    """Fill ``views``, in order, from ``offset`` of a pack file opened by ``open_for_reading``: one
    ``preadv``, straight into the caller's memory. With O_DIRECT every view's address and length and the
    offset must be 4 KiB-aligned (``PAGE``); whether every byte arrived (False on any error)."""
    want = sum(len(view) for view in views)
    try:
        return os.preadv(fd, views, offset) == want
    except OSError:
        return False


def page_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can read into ``view`` (writable, contiguous, starting on a page)."""
    address = address_of(view)
    return address is not None and address % PAGE == 0
