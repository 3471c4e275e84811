"""Errors the indexer raises. Each names what was wrong and what to do, so callers can show it as is."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


class PrefixCacheError(Exception):
    """Base class of every error prefixcache raises on purpose."""


class ConfigError(PrefixCacheError, ValueError):
    """A setting is invalid (bad chunk size, malformed URL, unknown field...)."""


class InvalidTokensError(PrefixCacheError, ValueError):
    """Token ids that cannot be keyed: empty, not integers, or outside 0..2**32-1."""


class IndexUnavailableError(PrefixCacheError, ConnectionError):
    """The index backend (Redis) cannot be reached. Callers treat this as a cache miss, never as data."""


def validation_problems(exc: ValidationError, whole: str) -> str:
    """One line naming each bad key of a validated object and what is wrong with it (``whole``: the name of the
    object itself, for problems with it as a whole). Pydantic's "Value error, " before our own validators'
    messages is dropped: it says nothing to the person reading it."""
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
    )
