"""Sealing chunk objects that leave the machine: AES-256-GCM, keyed from the cluster secret.

Objects in the shared bucket (cachestore/tiers/object_store.py) are read by whoever can read the bucket, so a
chunk's tokens and KV values are encrypted there, and authenticated so that nothing written without the key is
taken for a chunk. The key is derived from the chunk-signing key (``ChunkMacKey.derive``), so every node of a
cluster seals and opens alike and no other secret is kept. Each object gets a fresh random 96-bit nonce, stored
in front of it; the object's name is authenticated too (AES-GCM's associated data), so an object copied under
another chunk's name does not open. A sealed object is ``MAGIC ‖ nonce ‖ ciphertext ‖ tag``: 32 bytes more.
``cryptography`` comes with the ``object`` extra.
"""

from __future__ import annotations

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from prefixcache.cachestore.chunks.codec import ChunkError
from prefixcache.cachestore.chunks.mac import ChunkMacKey

MAGIC = b"PCS1"
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = len(MAGIC) + NONCE_BYTES + TAG_BYTES
#: What the sealing key is derived under: a key for this use alone.
CONTEXT = "prefixcache object tier chunk seal v1"


class SealError(ChunkError):
    """A sealed object that does not open: not one at all (``damaged``), or forged, damaged, sealed with another key
    or under another name (``mac``: it does not authenticate)."""


class ChunkSealer:
    """Seals and opens objects under their names with the cluster's sealing key."""

    __slots__ = ("_aead",)

    def __init__(self, mac_key: ChunkMacKey) -> None:
        self._aead = AESGCM(mac_key.derive(CONTEXT))

    def seal(self, name: str, data: bytes | memoryview) -> bytearray:
        """``data`` encrypted and authenticated together with ``name`` (written once, into the sealed object)."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = bytearray(OVERHEAD + len(memoryview(data).cast("B")))
        sealed[: len(MAGIC)] = MAGIC
        sealed[len(MAGIC) : len(MAGIC) + NONCE_BYTES] = nonce
        self._aead.encrypt_into(nonce, data, name.encode(), memoryview(sealed)[len(MAGIC) + NONCE_BYTES :])
        return sealed

    def open(self, name: str, sealed: bytes | memoryview) -> bytes:
        """The data sealed under ``name``; ``SealError`` for anything else."""
        nonce, body = _parts(sealed)
        try:
            return self._aead.decrypt(nonce, body, name.encode())
        except InvalidTag:
            raise SealError("sealed chunk object does not authenticate", "mac") from None

    def open_into(self, name: str, sealed: bytes | memoryview, out: memoryview) -> int:
        """Decrypt the data sealed under ``name`` straight into ``out`` (no copy of its own); its length, or
        ``SealError``, after which ``out`` holds nothing to use. ``ValueError`` where ``out`` is too small."""
        nonce, body = _parts(sealed)
        size = len(body) - TAG_BYTES
        if size > len(out):
            raise ValueError(f"a buffer of {len(out)} bytes cannot hold {size}")
        try:
            self._aead.decrypt_into(nonce, body, name.encode(), out[:size])
        except InvalidTag:
            raise SealError("sealed chunk object does not authenticate", "mac") from None
        return size

    def __repr__(self) -> str:
        return "ChunkSealer(<secret>)"


def _parts(sealed: bytes | memoryview) -> tuple[bytes, memoryview]:
    """A sealed object's nonce and its ciphertext with the tag; ``SealError`` for what is not a sealed object."""
    view = memoryview(sealed).cast("B")
    if len(view) < OVERHEAD or view[: len(MAGIC)] != MAGIC:
        raise SealError("not a sealed chunk object")
    return bytes(view[len(MAGIC) : len(MAGIC) + NONCE_BYTES]), view[len(MAGIC) + NONCE_BYTES :]
