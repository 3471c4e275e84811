"""Chunk keys: chained xxh3-128 digests over packed token ids, computed incrementally.

    key_0 = H(root ‖ tokens[0:C]),  key_i = H(key_{i-1} ‖ tokens[iC:(i+1)C])

where ``root`` is the namespace (and tenant) digest, H is xxh3-128 and tokens are little-endian
uint32. Nothing depends on process state, so every process on every machine derives the same keys.

A chunk in which media begin (an image's placeholder tokens, say) takes a *media parent* instead:
H(parent ‖ "\0media\0" ‖ the items that begin in it). Chunks before the first item keep the keys of
the same text without media, so prompts that differ only in their media share them; from that chunk
on, every key depends on the items, through the chain.

A partial chunk (a prompt's tail, shorter than C) is keyed the same way, H(parent ‖ its tokens);
the byte length tells it apart from a full chunk. To find a stored chunk that shares only the
first m tokens of a prompt's next chunk (token-granular reuse at the point where prompts diverge),
every stored chunk is also filed in a *probe bucket*: the key its first PROBE_TOKENS tokens would
have as a chunk of their own. A lookup sends the probe of every position where the chain may
break; the index answers with the chunks in that bucket and the client compares tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import xxhash

from prefixcache.indexer.chunking import PROBE_TOKENS, ChunkGeometry
from prefixcache.indexer.errors import InvalidTokensError
from prefixcache.indexer.tokens import TOKEN_BYTES, TokenIds, token_array

KEY_BYTES = 16
_digest = xxhash.xxh3_128_digest


def chunk_key(parent: bytes, packed_tokens: bytes | memoryview) -> bytes:
    """The key of a chunk (full or partial) holding ``packed_tokens`` after ``parent``."""
    return _digest(bytes(parent) + bytes(packed_tokens))


def media_parent(parent: bytes, media: bytes | None) -> bytes:
    """The parent a chunk is keyed under: ``parent`` itself, or, when media begin in the chunk, a digest of
    ``parent`` and ``media`` (a canonical description of those items)."""
    return _digest(parent + b"\x00media\x00" + media) if media else parent


def parent_at(root: bytes, keys: Sequence[bytes], media: Mapping[int, bytes], position: int) -> bytes:
    """What chunk ``position`` of a chain is keyed under: the previous key (the root for the first chunk),
    or its media parent where media begin in that chunk."""
    return media_parent(root if position == 0 else keys[position - 1], media.get(position))


@dataclass(frozen=True)
class PrefixQuery:
    """What a longest-prefix lookup needs: the chain, the probes, and the tokens to compare."""

    root: bytes
    chunk_tokens: int
    keys: Sequence[bytes]
    #: probes[i] is the probe bucket of position i (i = 0..len(keys)); None where fewer than
    #: PROBE_TOKENS tokens follow the position.
    probes: Sequence[bytes | None]
    packed: bytes
    num_tokens: int
    #: per chunk position, the media that begin in that chunk (see ``media_parent``)
    media: Mapping[int, bytes] = field(default_factory=dict)

    def parent(self, position: int) -> bytes:
        """What chunk ``position`` is keyed under."""
        return parent_at(self.root, self.keys, self.media, position)

    def tokens_from(self, position: int) -> np.ndarray:
        """The prompt's tokens from chunk ``position`` on, at most one chunk, as uint32."""
        start = position * self.chunk_tokens * TOKEN_BYTES
        end = min(len(self.packed), start + self.chunk_tokens * TOKEN_BYTES)
        return np.frombuffer(self.packed, dtype="<u4", offset=start, count=(end - start) // TOKEN_BYTES)


class PrefixHasher:
    """Keys of a growing token sequence; each token is packed and hashed once.

    A request's hasher lives as long as the request, so a prompt that grows (chunked prefill,
    decode, the next chat turn) re-hashes only its new chunks.
    """

    def __init__(self, root: bytes, geometry: ChunkGeometry, media: Mapping[int, bytes] | None = None) -> None:
        """``media``: per chunk position, a canonical description of the media items that begin in that
        chunk (none for a text prompt)."""
        if len(root) != KEY_BYTES:
            raise ValueError(f"a namespace root is {KEY_BYTES} bytes, got {len(root)}")
        self.root = root
        self.chunk_tokens = geometry.chunk_tokens
        self.media = dict(media or {})
        self._tokens = array("I")
        self._keys: list[bytes] = []
        self._probes: list[bytes | None] = []  # probes of full chunks: they never change

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def keys(self) -> list[bytes]:
        """Keys of the full chunks so far."""
        return self._keys

    def packed(self) -> bytes:
        """The tokens so far as packed uint32 little-endian bytes (a copy)."""
        return self._tokens.tobytes()

    def extend(self, tokens: TokenIds) -> PrefixHasher:
        """Append tokens; hashes every chunk they complete. Returns self for chaining."""
        self._tokens.extend(token_array(tokens))
        c = self.chunk_tokens
        done = len(self._keys)
        if (done + 1) * c > len(self._tokens):
            return self
        probe_bytes = PROBE_TOKENS * TOKEN_BYTES if c > PROBE_TOKENS else 0
        chunk_bytes = c * TOKEN_BYTES
        packed = memoryview(self._tokens).cast("B")
        parent, media = self.parent(done), self.media
        try:
            for start in range(done * chunk_bytes, (len(self._tokens) // c) * chunk_bytes, chunk_bytes):
                self._probes.append(_digest(parent + packed[start : start + probe_bytes]) if probe_bytes else None)
                parent = _digest(parent + packed[start : start + chunk_bytes])
                self._keys.append(parent)
                if media:
                    parent = media_parent(parent, media.get(len(self._keys)))
        finally:
            packed.release()  # the array cannot grow while a view exists
        return self

    def tail_key(self) -> bytes | None:
        """Key of the partial chunk after the last full one, or None if there is no tail."""
        start = len(self._keys) * self.chunk_tokens
        if start == len(self._tokens):
            return None
        return chunk_key(self.parent(len(self._keys)), self._tokens[start:].tobytes())

    def probe(self, position: int) -> bytes | None:
        """Probe bucket of chunk ``position`` (None when fewer than PROBE_TOKENS tokens follow it)."""
        if position < len(self._probes):
            return self._probes[position]
        start = position * self.chunk_tokens
        if self.chunk_tokens <= PROBE_TOKENS or start + PROBE_TOKENS > len(self._tokens):
            return None
        return chunk_key(self.parent(position), self._tokens[start : start + PROBE_TOKENS].tobytes())

    def query(self) -> PrefixQuery:
        """A snapshot for ``PrefixIndex.lookup``."""
        if not self._tokens:
            raise InvalidTokensError("cannot look up an empty prompt")
        return PrefixQuery(
            root=self.root,
            chunk_tokens=self.chunk_tokens,
            keys=list(self._keys),
            probes=[*self._probes, self.probe(len(self._keys))],
            packed=self.packed(),
            num_tokens=len(self._tokens),
            media=self.media,
        )

    def parent(self, position: int) -> bytes:
        """What chunk ``position`` is keyed under (``parent_at``)."""
        return parent_at(self.root, self._keys, self.media, position)


def extend_all(hashers: Sequence[PrefixHasher], tokens: TokenIds) -> None:
    """Append ``tokens`` to every chain, converting them once (the ranks of a parallel engine keep one chain
    each over the same prompt)."""
    packed = token_array(tokens)
    for hasher in hashers:
        hasher.extend(packed)


def prompt_query(
    root: bytes, geometry: ChunkGeometry, tokens: TokenIds, media: Mapping[int, bytes] | None = None
) -> PrefixQuery:
    """One-shot helper: the lookup query of a whole prompt."""
    return PrefixHasher(root, geometry, media).extend(tokens).query()


def probe_of(parent: bytes, packed_tokens: bytes) -> bytes | None:
    """The probe bucket a stored chunk is filed under (None for chunks shorter than PROBE_TOKENS)."""
    if len(packed_tokens) < PROBE_TOKENS * TOKEN_BYTES:
        return None
    return chunk_key(parent, packed_tokens[: PROBE_TOKENS * TOKEN_BYTES])
