"""Token ids to the packed little-endian uint32 values that keys are computed over.

Packing is the only per-token work on the lookup path, so it is done once per token:
``array('I').fromlist`` converts a Python list faster than numpy does,
and the hasher hashes slices of that array in place, without further copies.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np

from prefixcache.indexer.errors import InvalidTokensError

TOKEN_BYTES = 4

if array("I").itemsize != TOKEN_BYTES or sys.byteorder != "little":  # pragma: no cover
    raise ImportError("prefixcache keys are little-endian uint32 tokens; this platform's 'unsigned int' is not")

TokenIds: TypeAlias = "Sequence[int] | np.ndarray | array[int]"  # array is generic only to the type checker on 3.11


def token_array(tokens: TokenIds) -> array[int]:
    """``tokens`` as an ``array('I')``, validated.

    Raises InvalidTokensError for anything that is not a sequence of integers in 0..2**32-1
    (floats, strings, None, negative ids, 2-D arrays).
    """
    if isinstance(tokens, np.ndarray):
        return _from_numpy(tokens)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        raise InvalidTokensError(f"token ids must be a sequence of integers, not {type(tokens).__name__}")
    if isinstance(tokens, array) and tokens.typecode == "I":
        return tokens
    try:
        if isinstance(tokens, list):  # fromlist converts a list ~35% faster than the constructor
            packed = array("I")
            packed.fromlist(tokens)
            return packed
        return array("I", tokens)
    except TypeError as exc:
        bad = next((t for t in tokens if not _is_int(t)), None)
        raise InvalidTokensError(f"token ids must be integers; got {bad!r} ({type(bad).__name__})") from exc
    except OverflowError as exc:
        bad = next((t for t in tokens if not 0 <= t < 2**32), None)
        raise InvalidTokensError(f"token id {bad!r} is outside 0..2**32-1") from exc


def pack_tokens(tokens: TokenIds) -> bytes:
    """``tokens`` as packed uint32 little-endian bytes."""
    return token_array(tokens).tobytes()


def unpack_tokens(packed: bytes | memoryview) -> np.ndarray:
    """The inverse of pack_tokens, as a read-only uint32 vector (no copy)."""
    return np.frombuffer(packed, dtype="<u4")


def _from_numpy(tokens: np.ndarray) -> array[int]:
    if tokens.ndim != 1:
        raise InvalidTokensError(f"token ids must be one-dimensional; got shape {tokens.shape}")
    if tokens.dtype.kind not in "iu":
        raise InvalidTokensError(f"token ids must be integers; got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise InvalidTokensError("token ids must lie in 0..2**32-1")
    out = array("I")
    out.frombytes(tokens.astype("<u4", copy=False).tobytes())
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
