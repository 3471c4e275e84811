"""The stored form of one chunk: a 256-byte header, the chunk's tokens, zeros up to a 4 KiB boundary, then the
raw KV payload.

    offset  size  field
    0       4     magic b"PCKV"
    4       2     format version
    6       2     header length (256)
    8       16    namespace digest
    24      16    chunk key
    40      16    parent key (the namespace root for a prompt's first chunk)
    56      16    namespace root (tenant-salted)
    72      8     tenant id (0: none)
    80      8     payload length
    88      8     xxh3-64 of the body (tokens, then payload)
    96      4     token count
    100     1     dtype code
    101     1     number of dimensions (<= 8)
    102     2     reserved (0)
    104     32    shape, 8 x uint32 (unused dimensions 0)
    136     112   reserved (0)
    248     8     xxh3-64 of header bytes 0..248
    256     4n    the chunk's n tokens, uint32
    256+4n        zeros, up to the next multiple of 4096 (version 2; none in version 1)
    P             payload, at P = 4096 * ceil((256 + 4n) / 4096) (version 1: P = 256 + 4n)

Everything is little-endian. The body checksum covers the tokens, then the payload, never the padding.

Why the payload starts at a 4 KiB boundary: the NVMe tier stores each object at a 4 KiB-aligned offset of
its segment file, so each layer's pages of the payload lie at aligned file offsets too, and a same-node
reader can bring them from disk with O_DIRECT straight into a KV cache's pages, layer by layer (the
connector's NVMe loads), instead of reading the whole object into a buffer and copying it into the pages.
The padding costs 4 KiB per chunk at most (0.2% of a 2 MiB chunk). Objects of version 1 stay readable.

Objects are self-describing: a tier alone is enough to rebuild the
index (the daemon does after a Redis loss), and decoding proves ``key == H(parent ‖ tokens)``,
so an object can only ever be used as KV for exactly the tokens it was computed from.

The header is written in place in front of tokens and a payload that are already in the caller's
buffer (a registered Mooncake buffer, say), so encoding copies nothing. Any check that fails raises
``ChunkError``; callers count it and treat it as a miss. Damaged, truncated or foreign objects
never become KV.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from indexer.errors import PrefixCacheError
from indexer.keys import KEY_BYTES, chunk_key
from indexer.tokens import TOKEN_BYTES

MAGIC = b"PCKV"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_BYTES = 256
PAYLOAD_ALIGN = 4096
MAX_DIMS = 8
_FIXED = struct.Struct("<4sHH16s16s16s16sQQQIBBH")  # bytes 0..104
_SHAPE = struct.Struct("<8I")  # bytes 104..136
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


class ChunkError(PrefixCacheError):
    """A stored object that must not be used: damaged, truncated, or not the chunk asked for."""


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
    version: int = FORMAT_VERSION  # of the object it was read from; new objects are written in FORMAT_VERSION

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
        if self.version not in READABLE_VERSIONS:
            raise ValueError(f"unsupported chunk format version {self.version}")

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
        return payload_offset(self.num_tokens, self.version)

    @property
    def tokens_end(self) -> int:
        return HEADER_BYTES + len(self.tokens)

    @property
    def encoded_size(self) -> int:
        return self.payload_offset + self.payload_bytes


def payload_offset(num_tokens: int, version: int = FORMAT_VERSION) -> int:
    """Where the payload of a chunk of ``num_tokens`` tokens starts in its object (of format ``version``)."""
    tokens_end = HEADER_BYTES + num_tokens * TOKEN_BYTES
    return tokens_end if version == 1 else -(-tokens_end // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def write_header(buffer: memoryview, meta: ChunkMeta) -> int:
    """Write header and tokens into ``buffer`` for the payload already at ``meta.payload_offset``.

    Returns the object's length; the buffer may be longer.
    """
    size = meta.encoded_size
    if len(buffer) < size:
        raise ValueError(f"buffer of {len(buffer)} bytes cannot hold a {size}-byte chunk object")
    if meta.version != FORMAT_VERSION:
        raise ValueError(f"new objects are written in format version {FORMAT_VERSION}, not {meta.version}")
    buffer[HEADER_BYTES : meta.tokens_end] = meta.tokens
    buffer[meta.tokens_end : meta.payload_offset] = bytes(meta.payload_offset - meta.tokens_end)
    body = xxhash.xxh3_64(buffer[HEADER_BYTES : meta.tokens_end])
    body.update(buffer[meta.payload_offset : size])
    header = bytearray(HEADER_BYTES)
    _FIXED.pack_into(
        header, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, meta.namespace, meta.key, meta.parent, meta.root,
        meta.tenant, meta.payload_bytes, body.intdigest(), meta.num_tokens, DTYPES[meta.dtype][0], len(meta.shape), 0,
    )  # fmt: skip
    _SHAPE.pack_into(header, _FIXED.size, *meta.shape, *([0] * (MAX_DIMS - len(meta.shape))))
    struct.pack_into("<Q", header, _CHECKSUM_AT, xxhash.xxh3_64_intdigest(memoryview(header)[:_CHECKSUM_AT]))
    buffer[:HEADER_BYTES] = header
    return size


def encode(meta: ChunkMeta, payload: bytes | bytearray | memoryview) -> bytearray:
    """A new buffer holding the encoded object (copies the payload; the hot path uses write_header)."""
    view = memoryview(payload).cast("B")
    if len(view) != meta.payload_bytes:
        raise ValueError(f"payload is {len(view)} bytes, but {meta.dtype}{list(meta.shape)} needs {meta.payload_bytes}")
    out = bytearray(meta.encoded_size)
    out[meta.payload_offset :] = view
    write_header(memoryview(out), meta)
    return out


def read_meta(buffer: bytes | bytearray | memoryview) -> ChunkMeta:
    """Parse and check the header and tokens (not the payload): what a tier lists when rebuilding the index."""
    view = memoryview(buffer).cast("B")
    if len(view) < HEADER_BYTES:
        raise ChunkError(f"object of {len(view)} bytes is shorter than a header")
    magic, version, header_len, namespace, key, parent, root, tenant, payload_len, _, ntok, code, ndim, _ = (
        _FIXED.unpack_from(view)
    )
    if magic != MAGIC:
        raise ChunkError("not a prefixcache chunk (bad magic)")
    if version not in READABLE_VERSIONS or header_len != HEADER_BYTES:
        raise ChunkError(f"unsupported chunk format version {version} (header {header_len} bytes)")
    (stored_sum,) = struct.unpack_from("<Q", view, _CHECKSUM_AT)
    if xxhash.xxh3_64_intdigest(view[:_CHECKSUM_AT]) != stored_sum:
        raise ChunkError("header checksum mismatch")
    if code not in _DTYPE_BY_CODE or not 0 < ndim <= MAX_DIMS:
        raise ChunkError(f"header names unknown dtype code {code} or {ndim} dimensions")
    if len(view) < payload_offset(ntok, version):
        raise ChunkError(f"object truncated inside its tokens ({len(view)} bytes)")
    try:
        meta = ChunkMeta(
            namespace, root, parent, bytes(view[HEADER_BYTES : HEADER_BYTES + ntok * TOKEN_BYTES]),
            _DTYPE_BY_CODE[code], _SHAPE.unpack_from(view, _FIXED.size)[:ndim], tenant, version,
        )  # fmt: skip
    except ValueError as exc:
        raise ChunkError(f"invalid header: {exc}") from exc
    if meta.payload_bytes != payload_len:
        raise ChunkError(f"header shape needs {meta.payload_bytes} payload bytes but records {payload_len}")
    if meta.key != key:
        raise ChunkError("the object's tokens do not hash to its key")
    return meta


def decode(buffer: bytes | bytearray | memoryview, *, key: bytes, namespace: bytes) -> tuple[ChunkMeta, memoryview]:
    """Verify an object is the chunk ``key`` of ``namespace``, intact; return its meta and payload view."""
    view = memoryview(buffer).cast("B")
    check = BodyCheck(view, key=key, namespace=namespace)
    end = check.meta.encoded_size
    if len(view) < end:
        raise ChunkError(f"object truncated: {len(view)} of {end} bytes")
    payload = view[check.meta.payload_offset : end]
    check.update(payload)
    return check.verdict(), payload


def decode_scattered(head: memoryview, payload: Sequence[memoryview], *, key: bytes, namespace: bytes) -> ChunkMeta:
    """Verify a chunk whose object was read in pieces: ``head`` holds its header and tokens, ``payload`` its
    payload in order (pages written straight into a KV cache, say). The same checks as ``decode``."""
    check = BodyCheck(head, key=key, namespace=namespace)
    if sum(len(part) for part in payload) != check.meta.payload_bytes:
        raise ChunkError(f"payload pieces hold {sum(len(p) for p in payload)} bytes, not {check.meta.payload_bytes}")
    for part in payload:
        check.update(part)
    return check.verdict()


class BodyCheck:
    """The checks of one chunk whose payload arrives piece by piece, in order: the header and tokens at once
    (it must be the chunk ``key`` of ``namespace``), the body checksum streamed over the pieces as they come,
    so that a load landing layer by layer verifies each layer behind its read. Raises ``ChunkError``."""

    def __init__(self, head: memoryview, *, key: bytes, namespace: bytes) -> None:
        view = memoryview(head).cast("B")
        self.meta = read_meta(view)
        if self.meta.key != key:
            raise ChunkError(f"object holds chunk {self.meta.key.hex()}, not {key.hex()}")
        if self.meta.namespace != namespace:
            raise ChunkError(f"object belongs to namespace {self.meta.namespace.hex()}, not {namespace.hex()}")
        (self._body_sum,) = struct.unpack_from("<Q", view, 88)
        self._digest = xxhash.xxh3_64(view[HEADER_BYTES : self.meta.tokens_end])
        self._seen = 0

    def update(self, part: memoryview) -> None:
        self._digest.update(part)
        self._seen += len(part)

    def verdict(self) -> ChunkMeta:
        """The chunk's meta once every payload byte passed through ``update`` and matched its checksum."""
        if self._seen != self.meta.payload_bytes:
            raise ChunkError(f"payload of {self._seen} bytes, not {self.meta.payload_bytes}")
        if self._digest.intdigest() != self._body_sum:
            raise ChunkError("body checksum mismatch")
        return self.meta
