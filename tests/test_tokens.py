from array import array

import numpy as np
import pytest

from prefixcache.indexer.errors import InvalidTokensError
from prefixcache.indexer.tokens import pack_tokens, unpack_tokens


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3, 2**32 - 1],
        (1, 2, 3, 2**32 - 1),
        np.array([1, 2, 3, 2**32 - 1], dtype=np.int64),
        array("I", [1, 2, 3, 2**32 - 1]),
    ],
)
def test_every_container_packs_to_the_same_little_endian_bytes(tokens):
    assert pack_tokens(tokens) == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00\xff\xff\xff\xff"


def test_unpack_inverts_pack():
    tokens = list(range(0, 100_000, 7))
    assert unpack_tokens(pack_tokens(tokens)).tolist() == tokens


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        ([1, 2.5, 3], "integers; got 2.5"),
        ([1, "7"], "integers; got '7'"),
        ([1, -3], "-3 is outside"),
        ([2**32], "outside 0..2\\*\\*32-1"),
        ("abc", "sequence of integers, not str"),
        (np.array([1.0, 2.0]), "dtype float64"),
        (np.array([[1, 2]]), "one-dimensional"),
        (np.array([-1, 2]), "0..2\\*\\*32-1"),
    ],
)
def test_bad_tokens_get_a_clear_error(tokens, message):
    with pytest.raises(InvalidTokensError, match=message):
        pack_tokens(tokens)
