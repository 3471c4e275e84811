"""Chunk geometry: how many tokens make a chunk, checked against the engine's KV block size."""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.indexer.errors import ConfigError

#: Tokens of a chunk's start that file it in its parent's probe bucket (see prefixcache.indexer.keys). Part of
#: the key scheme: a partial hit is found only when the prompt shares at least this many tokens
#: with a stored chunk, which is below any useful amount of recomputation to save.
PROBE_TOKENS = 16
MAX_CHUNK_TOKENS = 1 << 16
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class ChunkGeometry:
    """``chunk_tokens`` per chunk; a multiple of ``block_tokens`` so chunks never split a KV block."""

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int):
            raise ConfigError(f"chunk_tokens must be an integer, got {self.chunk_tokens!r}")
        if not 0 < self.chunk_tokens <= MAX_CHUNK_TOKENS:
            raise ConfigError(f"chunk_tokens must be in 1..{MAX_CHUNK_TOKENS}, got {self.chunk_tokens}")
        if self.block_tokens is not None:
            if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) or self.block_tokens <= 0:
                raise ConfigError(f"block_tokens must be a positive integer, got {self.block_tokens!r}")
            if self.chunk_tokens % self.block_tokens:
                nearest = self.block_tokens * max(1, self.chunk_tokens // self.block_tokens)
                raise ConfigError(
                    f"chunk_tokens={self.chunk_tokens} is not a multiple of the engine's KV block size "
                    f"{self.block_tokens}; choose e.g. {nearest}"
                )

    @property
    def engine_block_tokens(self) -> int:
        """``block_tokens`` of an engine's geometry, which always knows it; a ConfigError where it is not given."""
        if self.block_tokens is None:
            raise ConfigError("this chunk geometry has no KV block size: give block_tokens")
        return self.block_tokens

    def blocks(self, start_token: int, end_token: int) -> slice:
        """The engine's KV blocks holding tokens [start, end): a geometry that knows the block size only."""
        block = self.engine_block_tokens
        return slice(start_token // block, -(-end_token // block))
