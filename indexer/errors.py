"""Errors the indexer raises. Each names what was wrong and what to do, so callers can show it as is."""


class PrefixCacheError(Exception):
    """Base class of every error prefixcache raises on purpose."""


class ConfigError(PrefixCacheError, ValueError):
    """A setting is invalid (bad chunk size, malformed URL, unknown field...)."""


class InvalidTokensError(PrefixCacheError, ValueError):
    """Token ids that cannot be keyed: empty, not integers, or outside 0..2**32-1."""


class IndexUnavailableError(PrefixCacheError, ConnectionError):
    """The index backend (Redis) cannot be reached. Callers treat this as a cache miss, never as data."""
