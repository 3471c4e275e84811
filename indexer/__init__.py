"""Token ids to chunk keys, namespaces, and the index that answers "how much of this prompt is cached?"."""

from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.index import ChunkEntry, ChunkRecord, Location, PrefixIndex, PrefixMatch, attach_namespace
from prefixcache.indexer.keys import PrefixHasher, PrefixQuery, prompt_query
from prefixcache.indexer.namespace import NamespaceSpec
from prefixcache.indexer.redis_index import RedisIndex

__all__ = [
    "ChunkEntry",
    "ChunkGeometry",
    "ChunkRecord",
    "Location",
    "NamespaceSpec",
    "PrefixHasher",
    "PrefixIndex",
    "PrefixMatch",
    "PrefixQuery",
    "RedisIndex",
    "attach_namespace",
    "prompt_query",
]
