"""The base class of ``prefixcache.connector.metadata``, as vLLM 0.32 defines it."""

from abc import ABC


class KVConnectorMetadata(ABC):  # noqa: B024 - vLLM's has no abstract methods either
    pass
