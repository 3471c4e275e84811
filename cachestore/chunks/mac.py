"""The key every chunk object is signed with, and the keyed hash that signs it.

A chunk's MAC is keyed BLAKE3 (32 bytes) over its header fields, tokens and payload, made with a
secret that every daemon and connector of one cluster holds and that never crosses the network. Any
process that can write into the DRAM pool or a pack file can also make a self-consistent header
(``key == H(parent ‖ tokens)`` and an unkeyed checksum prove nothing against a writer), so only the
MAC tells a chunk a holder of the key wrote from a forged one. Keyed BLAKE3 was chosen by measurement
(``python -m benchmarks.tiers`` prints its GB/s beside xxh3's and memcpy's): it is the fastest of the
well-reviewed MACs on one core and streams, so a load landing layer by layer verifies behind its reads.
"""

from __future__ import annotations

from pathlib import Path

import blake3

from prefixcache.cachestore.host.secret_files import load_or_create_secret, read_secret
from prefixcache.indexer.errors import ConfigError

MAC_BYTES = 32
KEY_BYTES = 32
#: The key file's name under a data dir's secrets directory (a single node creates it at first start).
KEY_FILE_NAME = "chunk-key"


class ChunkMacKey:
    """A cluster's chunk-signing key. ``hasher()`` starts one chunk's MAC; its value is never shown."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a chunk-signing key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = bytes(key)

    @classmethod
    def from_hex(cls, text: str, source: str) -> ChunkMacKey:
        try:
            return cls(bytes.fromhex(text))
        except ValueError:
            raise ConfigError(f"{source} must hold {KEY_BYTES} bytes as {2 * KEY_BYTES} hex digits") from None

    @classmethod
    def read(cls, path: Path) -> ChunkMacKey:
        """The key in ``path`` (an operator's file, shared by every node of a cluster)."""
        return cls.from_hex(read_secret(path), f"chunk-signing key file {path}")

    @classmethod
    def load_or_create(cls, path: Path) -> ChunkMacKey:
        """The key in ``path``, generated first if there is none (a single node's first start)."""
        return cls.from_hex(load_or_create_secret(path, nbytes=KEY_BYTES), f"chunk-signing key file {path}")

    def hasher(self, *, parallel: bool = False) -> blake3.blake3:
        """One chunk's MAC, on the calling thread; ``parallel``: on BLAKE3's shared pool of threads too (one per
        core the thread that first used it could run on, and bound as it was), for signing: publishes run on a
        thread of their own, and the cores a GPU host leaves idle shorten the time until other instances see a
        prompt's chunks. Verification stays on its thread: on the CPU backend it runs beside the forward pass."""
        return blake3.blake3(key=self._key, max_threads=blake3.blake3.AUTO if parallel else 1)

    def derive(self, context: str) -> bytes:
        """A 32-byte key for another use of the same cluster secret (BLAKE3's key derivation under ``context``,
        a string naming that use): knowing it tells nothing of this key or of keys for other contexts."""
        return blake3.blake3(self._key, derive_key_context=context).digest()

    def __repr__(self) -> str:
        return "ChunkMacKey(<secret>)"
