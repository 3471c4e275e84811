"""Token ids to chunk keys, namespaces, and the index that answers "how much of this prompt is cached?"."""

from indexer.chunking import ChunkGeometry
from indexer.embedded_index import EmbeddedIndex
from indexer.index import ChunkEntry, ChunkRecord, Location, PrefixIndex, PrefixMatch, attach_namespace
from indexer.keys import PrefixHasher, PrefixQuery, prompt_query
from indexer.namespace import NamespaceSpec
from indexer.redis_index import RedisIndex

__all__ = [
    "ChunkEntry", "ChunkGeometry", "ChunkRecord", "EmbeddedIndex", "Location", "NamespaceSpec", "PrefixHasher",
    "PrefixIndex", "PrefixMatch", "PrefixQuery", "RedisIndex", "attach_namespace", "prompt_query",
]  # fmt: skip
