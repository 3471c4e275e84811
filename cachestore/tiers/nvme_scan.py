"""Find the chunk objects in an NVMe pack file from their own headers: how a lost manifest is rebuilt.

Every object starts at a 4 KiB-aligned offset of its pack file (``cachestore/tiers/nvme.py``) and describes itself
(``cachestore/chunks/codec.py``): ``read_meta`` checks its magic, format, header checksum and that its key is
``H(parent ‖ tokens)``, and its length follows from the header. So a scan tries each aligned offset, and after
an object it jumps past it. The MAC is not checked here (it covers the payload): every load verifies it, so an
object whose payload was damaged is found now and refused when read.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from prefixcache.cachestore.chunks.codec import HEADER_BYTES, MAGIC, ChunkError, read_meta

#: Offsets of objects in pack files are multiples of this (the tier's O_DIRECT page).
ALIGN = 4096
#: Bytes read to parse one header and its tokens: enough for chunks of up to 65 000 tokens.
_HEAD_WINDOW = 256 << 10


class FoundObject(NamedTuple):
    key: bytes
    offset: int
    length: int


@dataclass(frozen=True)
class PackFileScan:
    """The objects of one pack file, in file order, and where a torn one (its header intact, the file ending
    inside its bytes: a write cut by a crash) begins, if the file ends with one."""

    objects: list[FoundObject] = field(default_factory=list)
    torn_at: int | None = None


def scan_pack_file(path: Path) -> PackFileScan:
    """Every object whose header verifies in the pack file at ``path``; raises ``OSError`` if it cannot be read."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        return PackFileScan()
    objects: list[FoundObject] = []
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        offset = 0
        while offset + HEADER_BYTES <= size:
            if data[offset : offset + len(MAGIC)] != MAGIC:
                offset += ALIGN
                continue
            try:
                meta = read_meta(data[offset : offset + _HEAD_WINDOW])  # slicing an mmap copies: no view outlives it
            except ChunkError:
                offset += ALIGN
                continue
            length = meta.encoded_size
            if offset + length > size:
                return PackFileScan(objects, torn_at=offset)
            objects.append(FoundObject(meta.key, offset, length))
            offset += -(-length // ALIGN) * ALIGN
    return PackFileScan(objects)
