import mmap

import numpy as np
import pytest

from cachestore.codec import (
    HEADER_BYTES,
    ChunkError,
    ChunkMeta,
    decode,
    decode_scattered,
    encode,
    read_meta,
    write_header,
)
from indexer.keys import chunk_key
from indexer.tokens import pack_tokens

NS, ROOT, PARENT = b"n" * 16, b"r" * 16, b"p" * 16
TOKENS = pack_tokens(range(64))
KEY = chunk_key(PARENT, TOKENS)


def meta(**change) -> ChunkMeta:
    fields = {"namespace": NS, "root": ROOT, "parent": PARENT, "tokens": TOKENS, "dtype": "bfloat16",
              "shape": (8, 2, 64, 4, 64), "tenant": 7}  # fmt: skip
    return ChunkMeta(**{**fields, **change})


def payload(m: ChunkMeta) -> bytes:
    return np.random.default_rng(0).integers(0, 256, m.payload_bytes, dtype=np.uint8).tobytes()


def test_round_trip_returns_meta_and_a_view_of_the_payload():
    m = meta()
    data = payload(m)
    obj = encode(m, data)
    got_meta, view = decode(obj, key=KEY, namespace=NS)
    assert got_meta == m and got_meta.key == KEY and got_meta.num_tokens == 64
    assert bytes(view) == data
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(obj, np.uint8))


def test_header_is_written_in_place_in_front_of_a_payload_already_in_the_buffer():
    m = meta(shape=(2, 16), dtype="float32")
    buf = mmap.mmap(-1, 1 << 16)
    buf[m.payload_offset : m.encoded_size] = payload(m)
    size = write_header(memoryview(buf), m)
    assert size == HEADER_BYTES + 64 * 4 + 128
    assert decode(memoryview(buf)[:size], key=KEY, namespace=NS)[0] == m
    assert read_meta(buf) == m


@pytest.mark.parametrize("offset", [0, 4, 8, 30, 45, 60, 75, 85, 90, 97, 100, 110, 250, HEADER_BYTES + 5, -1])
def test_any_flipped_byte_is_detected(offset):
    obj = encode(meta(), payload(meta()))
    obj[offset] ^= 0x40
    with pytest.raises(ChunkError):
        decode(obj, key=KEY, namespace=NS)


def test_truncated_object_is_detected():
    obj = encode(meta(), payload(meta()))
    with pytest.raises(ChunkError, match="truncated"):
        decode(obj[:-1], key=KEY, namespace=NS)
    with pytest.raises(ChunkError, match="truncated inside its tokens"):
        decode(obj[: HEADER_BYTES + 10], key=KEY, namespace=NS)
    with pytest.raises(ChunkError, match="shorter than a header"):
        decode(obj[:100], key=KEY, namespace=NS)


def test_a_valid_object_of_another_chunk_or_namespace_is_refused():
    obj = encode(meta(), payload(meta()))
    with pytest.raises(ChunkError, match="not " + ("aa" * 16)):
        decode(obj, key=b"\xaa" * 16, namespace=NS)
    with pytest.raises(ChunkError, match="namespace"):
        decode(obj, key=KEY, namespace=b"x" * 16)


def test_bad_meta_and_payload_are_rejected_when_encoding():
    with pytest.raises(ValueError, match="unsupported dtype"):
        meta(dtype="complex64")
    with pytest.raises(ValueError, match="dimensions"):
        meta(shape=())
    with pytest.raises(ValueError, match="whole uint32 token"):
        meta(tokens=b"abc")
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        encode(meta(), b"abc")


def scattered(obj: bytearray, m: ChunkMeta, cuts: list[int]) -> tuple[memoryview, list[memoryview]]:
    """The object as a head (header and tokens) and its payload cut at ``cuts``, each piece in its own buffer."""
    payload = bytes(obj[m.payload_offset : m.encoded_size])
    bounds = [0, *cuts, len(payload)]
    return memoryview(bytearray(obj[: m.payload_offset])), [
        memoryview(bytearray(payload[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def test_a_chunk_read_in_pieces_verifies_as_one_object():
    m = meta()
    obj = encode(m, payload(m))
    head, pieces = scattered(obj, m, [1, 4096, 70000, 200000])
    assert decode_scattered(head, pieces, key=KEY, namespace=NS) == m


@pytest.mark.parametrize("piece", [0, 2, 4])
def test_a_flipped_byte_in_any_piece_is_detected(piece):
    m = meta()
    head, pieces = scattered(encode(m, payload(m)), m, [1, 4096, 70000, 200000])
    pieces[piece][-1] ^= 0x01
    with pytest.raises(ChunkError, match="body checksum"):
        decode_scattered(head, pieces, key=KEY, namespace=NS)


def test_pieces_that_do_not_add_up_to_the_payload_are_refused():
    m = meta()
    head, pieces = scattered(encode(m, payload(m)), m, [4096])
    with pytest.raises(ChunkError, match="pieces hold"):
        decode_scattered(head, pieces[:1], key=KEY, namespace=NS)
    with pytest.raises(ChunkError, match="not " + ("aa" * 16)):
        decode_scattered(head, pieces, key=b"\xaa" * 16, namespace=NS)
