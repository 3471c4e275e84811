"""The stored form of one chunk: a 256-byte header, the chunk's tokens, zeros up to a 4 KiB boundary, then the
raw KV payload, signed with the cluster's chunk-signing key.

    offset  size  field
    0       4     magic b"PCKV"
    4       2     format version (3)
    6       2     header length (256)
    8       16    namespace digest
    24      16    chunk key
    40      16    parent key (the namespace root for a prompt's first chunk)
    56      16    namespace root (tenant-salted)
    72      8     tenant id (0: none)
    80      8     payload length
    88      8     reserved (0)
    96      4     token count
    100     1     dtype code
    101     1     number of dimensions (<= 8)
    102     2     reserved (0)
    104     32    shape, 8 x uint32 (unused dimensions 0)
    136     32    MAC: keyed BLAKE3 of header bytes 0..136, the tokens, then the payload
    168     80    reserved (0)
    248     8     xxh3-64 of header bytes 0..248
    256     4n    the chunk's n tokens, uint32
    256+4n        zeros, up to the next multiple of 4096
    P             payload, at P = 4096 * ceil((256 + 4n) / 4096)

Everything is little-endian. The MAC covers every field that gives the bytes their meaning (identity,
lineage, tenant, dtype, shape), the tokens and the payload, never the padding; the header checksum only
tells a damaged header at once, before any payload is read.

Why a MAC: any process that can write into the DRAM pool or a pack file can also write a header that is
consistent with itself (``key == H(parent ‖ tokens)``, an unkeyed checksum). Only a holder of the cluster's key
(cachestore/chunks/mac.py) can sign a chunk, so a forged or altered one fails here and is never used as KV.
Objects of earlier format versions carry no MAC and are refused like forged ones.

Why the payload starts at a 4 KiB boundary: the NVMe tier stores each object at a 4 KiB-aligned offset of
its pack file, so each layer's pages of the payload lie at aligned file offsets too, and a same-node
reader can bring them from disk with O_DIRECT straight into a KV cache's pages, layer by layer (the
connector's NVMe loads), instead of reading the whole object into a buffer and copying it into the pages.
The padding costs 4 KiB per chunk at most (0.2% of a 2 MiB chunk).

Objects are self-describing: a tier alone is enough to rebuild the
index (the daemon does after a Redis loss), and decoding proves ``key == H(parent ‖ tokens)``,
so an object can only ever be used as KV for exactly the tokens it was computed from.

The header is written in place in front of tokens and a payload that are already in the caller's
buffer (a registered Mooncake buffer, say), so encoding copies nothing. Any check that fails raises
``ChunkError`` with its ``reason``; callers count it and treat it as a miss. Damaged, truncated, forged or
foreign objects never become KV.
"""

from __future__ import annotations

import hmac
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from prefixcache.cachestore.chunks.mac import MAC_BYTES, ChunkMacKey
from prefixcache.indexer.errors import PrefixCacheError
from prefixcache.indexer.keys import KEY_BYTES, chunk_key
from prefixcache.indexer.tokens import TOKEN_BYTES

MAGIC = b"PCKV"
FORMAT_VERSION = 3
HEADER_BYTES = 256
PAYLOAD_ALIGN = 4096
MAX_DIMS = 8
_FIXED = struct.Struct("<4sHH16s16s16s16sQQQIBBH")  # bytes 0..104
_SHAPE = struct.Struct("<8I")  # bytes 104..136
_MAC_AT = 136  # the MAC covers the header's bytes before it
_CHECKSUM_AT = 248

#: dtype name -> (code, item size). Codes are part of the format: never reuse one.
DTYPES: dict[str, tuple[int, int]] = {
    "float16": (1, 2),
    "bfloat16": (2, 2),
    "float32": (3, 4),
    "float8_e4m3fn": (4, 1),
    "float8_e5m2": (5, 1),
    "uint8": (6, 1),
    "int8": (7, 1),
}
_DTYPE_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


#: Why an object was refused: its MAC does not verify (forged, or its body altered or damaged), or anything else
#: (a damaged header, a truncated object, another chunk or namespace, an unknown format).
ChunkErrorReason = Literal["mac", "damaged"]


class ChunkError(PrefixCacheError):
    """A stored object that must not be used: forged, damaged, truncated, or not the chunk asked for."""

    def __init__(self, message: str, reason: ChunkErrorReason = "damaged") -> None:
        super().__init__(message)
        self.reason: ChunkErrorReason = reason


@dataclass
class RejectCounts:
    """Objects a service refused, in all and those whose MAC did not verify (``prefixcache_corrupt_chunks``)."""

    total: int = 0
    mac: int = 0

    def count(self, error: ChunkError) -> None:
        self.total += 1
        self.mac += error.reason == "mac"


@dataclass(frozen=True)
class ChunkMeta:
    """Everything about a chunk but its KV: identity, lineage, tokens, and the payload's dtype and shape."""

    namespace: bytes
    root: bytes
    parent: bytes
    tokens: bytes  # packed uint32
    dtype: str
    shape: tuple[int, ...]
    tenant: int = 0

    def __post_init__(self) -> None:
        if any(len(d) != KEY_BYTES for d in (self.namespace, self.root, self.parent)):
            raise ValueError("namespace, root and parent are 16-byte digests")
        if not self.tokens or len(self.tokens) % TOKEN_BYTES:
            raise ValueError("a chunk holds at least one whole uint32 token")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; known: {', '.join(DTYPES)}")
        if not 0 < len(self.shape) <= MAX_DIMS or any(not 0 <= d < 2**32 for d in self.shape):
            raise ValueError(f"shape must have 1..{MAX_DIMS} dimensions in 0..2**32-1, got {self.shape}")
        if not 0 <= self.tenant < 2**64:
            raise ValueError("tenant id is a uint64")

    @property
    def key(self) -> bytes:
        return chunk_key(self.parent, self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    @property
    def payload_bytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]

    @property
    def payload_offset(self) -> int:
        return payload_offset(self.num_tokens)

    @property
    def tokens_end(self) -> int:
        return HEADER_BYTES + len(self.tokens)

    @property
    def encoded_size(self) -> int:
        return self.payload_offset + self.payload_bytes


def payload_offset(num_tokens: int) -> int:
    """Where the payload of a chunk of ``num_tokens`` tokens starts in its object."""
    tokens_end = HEADER_BYTES + num_tokens * TOKEN_BYTES
    return -(-tokens_end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def write_header(buffer: memoryview, meta: ChunkMeta, mac_key: ChunkMacKey) -> int:
    """Write header and tokens into ``buffer`` for the payload already at ``meta.payload_offset``, signed with
    ``mac_key``. Returns the object's length; the buffer may be longer.
    """
    if len(buffer) < meta.encoded_size:
        raise ValueError(f"buffer of {len(buffer)} bytes cannot hold a {meta.encoded_size}-byte chunk object")
    signing = ChunkSigning(meta, mac_key)
    signing.update(buffer[meta.payload_offset : meta.encoded_size])
    return signing.write_header(buffer)


class ChunkSigning:
    """One chunk's MAC made as its payload is written: the header's fields and the tokens at once, the payload
    piece by piece, in order (a publish that copies each layer's pages out as the forward pass writes them signs
    each layer behind its copy: connector/layer_signing.py). Hashes on BLAKE3's shared pool of threads
    (``ChunkMacKey.hasher``): signing runs on the connector's own threads, never on the forward pass's."""

    def __init__(self, meta: ChunkMeta, mac_key: ChunkMacKey) -> None:
        self.meta = meta
        self._header = _header_fields(meta)
        self._mac = mac_key.hasher(parallel=True)
        self._mac.update(memoryview(self._header)[:_MAC_AT])
        self._mac.update(meta.tokens)
        self._seen = 0

    def update(self, part: memoryview) -> None:
        """Hash the payload's next ``part``."""
        self._mac.update(part)
        self._seen += len(part)

    def write_header(self, buffer: memoryview) -> int:
        """Once every payload byte passed through ``update``: write header and tokens into ``buffer``, whose
        payload they sign. Returns the object's length."""
        meta = self.meta
        if self._seen != meta.payload_bytes:
            raise ValueError(f"{self._seen} payload bytes signed, not {meta.payload_bytes}")
        buffer[HEADER_BYTES : meta.tokens_end] = meta.tokens
        buffer[meta.tokens_end : meta.payload_offset] = bytes(meta.payload_offset - meta.tokens_end)
        header = self._header
        header[_MAC_AT : _MAC_AT + MAC_BYTES] = self._mac.digest()
        struct.pack_into("<Q", header, _CHECKSUM_AT, xxhash.xxh3_64_intdigest(memoryview(header)[:_CHECKSUM_AT]))
        buffer[:HEADER_BYTES] = header
        return meta.encoded_size


def _header_fields(meta: ChunkMeta) -> bytearray:
    """The header of ``meta`` but its MAC and checksum (zeros)."""
    header = bytearray(HEADER_BYTES)
    _FIXED.pack_into(
        header,
        0,
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        meta.namespace,
        meta.key,
        meta.parent,
        meta.root,
        meta.tenant,
        meta.payload_bytes,
        0,
        meta.num_tokens,
        DTYPES[meta.dtype][0],
        len(meta.shape),
        0,
    )
    _SHAPE.pack_into(header, _FIXED.size, *meta.shape, *([0] * (MAX_DIMS - len(meta.shape))))
    return header


def encode(meta: ChunkMeta, payload: bytes | bytearray | memoryview, mac_key: ChunkMacKey) -> bytearray:
    """A new buffer holding the encoded object (copies the payload; the hot path uses write_header)."""
    view = memoryview(payload).cast("B")
    if len(view) != meta.payload_bytes:
        raise ValueError(f"payload is {len(view)} bytes, but {meta.dtype}{list(meta.shape)} needs {meta.payload_bytes}")
    out = bytearray(meta.encoded_size)
    out[meta.payload_offset :] = view
    write_header(memoryview(out), meta, mac_key)
    return out


def read_meta(buffer: bytes | bytearray | memoryview) -> ChunkMeta:
    """Parse and check the header and tokens (not the payload, nor the MAC, which covers it): what a tier lists
    when rebuilding the index. Every load verifies the whole object (``decode``, ``BodyCheck``)."""
    view = memoryview(buffer).cast("B")
    if len(view) < HEADER_BYTES:
        raise ChunkError(f"object of {len(view)} bytes is shorter than a header")
    magic, version, header_len, namespace, key, parent, root, tenant, payload_len, _, ntok, code, ndim, _ = (
        _FIXED.unpack_from(view)
    )
    if magic != MAGIC:
        raise ChunkError("not a prefixcache chunk (bad magic)")
    if version != FORMAT_VERSION or header_len != HEADER_BYTES:
        raise ChunkError(f"unsupported chunk format version {version} (header {header_len} bytes)")
    (stored_sum,) = struct.unpack_from("<Q", view, _CHECKSUM_AT)
    if xxhash.xxh3_64_intdigest(view[:_CHECKSUM_AT]) != stored_sum:
        raise ChunkError("header checksum mismatch")
    if code not in _DTYPE_BY_CODE or not 0 < ndim <= MAX_DIMS:
        raise ChunkError(f"header names unknown dtype code {code} or {ndim} dimensions")
    if len(view) < payload_offset(ntok):
        raise ChunkError(f"object truncated inside its tokens ({len(view)} bytes)")
    try:
        meta = ChunkMeta(
            namespace,
            root,
            parent,
            bytes(view[HEADER_BYTES : HEADER_BYTES + ntok * TOKEN_BYTES]),
            _DTYPE_BY_CODE[code],
            _SHAPE.unpack_from(view, _FIXED.size)[:ndim],
            tenant,
        )
    except ValueError as exc:
        raise ChunkError(f"invalid header: {exc}") from exc
    if meta.payload_bytes != payload_len:
        raise ChunkError(f"header shape needs {meta.payload_bytes} payload bytes but records {payload_len}")
    if meta.key != key:
        raise ChunkError("the object's tokens do not hash to its key")
    return meta


def decode(
    buffer: bytes | bytearray | memoryview, *, key: bytes, namespace: bytes, mac_key: ChunkMacKey
) -> tuple[ChunkMeta, memoryview]:
    """Verify an object is the chunk ``key`` of ``namespace``, intact and signed with ``mac_key``; return its meta
    and payload view."""
    view = memoryview(buffer).cast("B")
    check = BodyCheck(view, key=key, namespace=namespace, mac_key=mac_key)
    end = check.meta.encoded_size
    if len(view) < end:
        raise ChunkError(f"object truncated: {len(view)} of {end} bytes")
    payload = view[check.meta.payload_offset : end]
    check.update(payload)
    return check.verdict(), payload


def decode_scattered(
    head: memoryview, payload: Sequence[memoryview], *, key: bytes, namespace: bytes, mac_key: ChunkMacKey
) -> ChunkMeta:
    """Verify a chunk whose object was read in pieces: ``head`` holds its header and tokens, ``payload`` its
    payload in order (pages written straight into a KV cache, say). The same checks as ``decode``."""
    check = BodyCheck(head, key=key, namespace=namespace, mac_key=mac_key)
    if sum(len(part) for part in payload) != check.meta.payload_bytes:
        raise ChunkError(f"payload pieces hold {sum(len(p) for p in payload)} bytes, not {check.meta.payload_bytes}")
    for part in payload:
        check.update(part)
    return check.verdict()


class BodyCheck:
    """The checks of one chunk whose payload arrives piece by piece, in order: the header and tokens at once
    (it must be the chunk ``key`` of ``namespace``), the MAC streamed over the pieces as they come, so that a
    load landing layer by layer verifies each layer behind its read. Raises ``ChunkError``."""

    def __init__(self, head: memoryview, *, key: bytes, namespace: bytes, mac_key: ChunkMacKey) -> None:
        view = memoryview(head).cast("B")
        self.meta = read_meta(view)
        if self.meta.key != key:
            raise ChunkError(f"object holds chunk {self.meta.key.hex()}, not {key.hex()}")
        if self.meta.namespace != namespace:
            raise ChunkError(f"object belongs to namespace {self.meta.namespace.hex()}, not {namespace.hex()}")
        self._mac = bytes(view[_MAC_AT : _MAC_AT + MAC_BYTES])
        self._digest = mac_key.hasher()
        self._digest.update(view[:_MAC_AT])
        self._digest.update(view[HEADER_BYTES : self.meta.tokens_end])
        self._seen = 0

    def update(self, part: memoryview) -> None:
        self._digest.update(part)
        self._seen += len(part)

    def verdict(self) -> ChunkMeta:
        """The chunk's meta once every payload byte passed through ``update`` and the MAC verified."""
        if self._seen != self.meta.payload_bytes:
            raise ChunkError(f"payload of {self._seen} bytes, not {self.meta.payload_bytes}")
        if not hmac.compare_digest(self._digest.digest(), self._mac):
            raise ChunkError("MAC mismatch: not signed with this cluster's key, or altered", reason="mac")
        return self.meta
