import mmap
import struct

import numpy as np
import pytest
import xxhash

from prefixcache.cachestore.chunks.codec import (
    HEADER_BYTES,
    PAYLOAD_ALIGN,
    BodyCheck,
    ChunkError,
    ChunkMeta,
    ChunkSigning,
    decode,
    decode_scattered,
    encode,
    read_meta,
    write_header,
)
from prefixcache.cachestore.chunks.mac import ChunkMacKey
from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.keys import chunk_key
from prefixcache.indexer.tokens import pack_tokens

NS, ROOT, PARENT = b"n" * 16, b"r" * 16, b"p" * 16
MAC_KEY = ChunkMacKey(bytes(range(32)))
OTHER_KEY = ChunkMacKey(bytes(range(1, 33)))
TOKENS = pack_tokens(range(64))
KEY = chunk_key(PARENT, TOKENS)


def meta(**change) -> ChunkMeta:
    fields = {
        "namespace": NS,
        "root": ROOT,
        "parent": PARENT,
        "tokens": TOKENS,
        "dtype": "bfloat16",
        "shape": (8, 2, 64, 4, 64),
        "tenant": 7,
    }
    return ChunkMeta(**{**fields, **change})


def payload(m: ChunkMeta) -> bytes:
    return np.random.default_rng(0).integers(0, 256, m.payload_bytes, dtype=np.uint8).tobytes()


def test_round_trip_returns_meta_and_a_view_of_the_payload():
    m = meta()
    data = payload(m)
    obj = encode(m, data, MAC_KEY)
    got_meta, view = decode(obj, key=KEY, namespace=NS, mac_key=MAC_KEY)
    assert got_meta == m and got_meta.key == KEY and got_meta.num_tokens == 64
    assert bytes(view) == data
    assert np.shares_memory(np.frombuffer(view, np.uint8), np.frombuffer(obj, np.uint8))


def test_header_is_written_in_place_in_front_of_a_payload_already_in_the_buffer():
    m = meta(shape=(2, 16), dtype="float32")
    buf = mmap.mmap(-1, 1 << 16)
    buf[m.payload_offset : m.encoded_size] = payload(m)
    size = write_header(memoryview(buf), m, MAC_KEY)
    assert m.payload_offset == PAYLOAD_ALIGN  # the header and 64 tokens, padded to a 4 KiB boundary
    assert size == PAYLOAD_ALIGN + 128
    assert decode(memoryview(buf)[:size], key=KEY, namespace=NS, mac_key=MAC_KEY)[0] == m
    assert read_meta(buf) == m


def test_a_chunk_signed_piece_by_piece_is_the_object_write_header_makes_and_refuses_a_header_before_its_payload():
    m = meta(shape=(4, 16), dtype="float32")
    whole = bytearray(m.encoded_size)
    whole[m.payload_offset :] = payload(m)
    write_header(memoryview(whole), m, MAC_KEY)
    pieces = bytearray(b"\xff" * m.encoded_size)  # whatever the slot held before
    pieces[m.payload_offset :] = payload(m)
    signing = ChunkSigning(m, MAC_KEY)
    layer = m.payload_bytes // 4
    for start in range(m.payload_offset, m.encoded_size - layer, layer):  # every layer but the last
        signing.update(memoryview(pieces)[start : start + layer])
    with pytest.raises(ValueError, match="payload bytes signed"):
        signing.write_header(memoryview(pieces))
    signing.update(memoryview(pieces)[m.encoded_size - layer :])
    assert signing.write_header(memoryview(pieces)) == m.encoded_size
    assert pieces == whole


def test_the_padding_before_the_payload_is_zeroed_whatever_the_buffer_held():
    m = meta()
    buf = bytearray(b"\xff" * m.encoded_size)
    buf[m.payload_offset :] = payload(m)
    write_header(memoryview(buf), m, MAC_KEY)
    assert m.payload_offset % PAYLOAD_ALIGN == 0
    assert bytes(buf[m.tokens_end : m.payload_offset]) == bytes(m.payload_offset - m.tokens_end)
    assert decode(buf, key=KEY, namespace=NS, mac_key=MAC_KEY)[0] == m


def test_a_body_check_fed_piece_by_piece_accepts_the_chunk_and_refuses_a_short_or_changed_payload():
    m, data = meta(), payload(meta())
    obj = encode(m, data, MAC_KEY)
    head = memoryview(obj)[: m.payload_offset]
    whole = BodyCheck(head, key=KEY, namespace=NS, mac_key=MAC_KEY)
    for at in range(0, len(data), 65536):
        whole.update(memoryview(data)[at : at + 65536])
    assert whole.verdict() == m
    short = BodyCheck(head, key=KEY, namespace=NS, mac_key=MAC_KEY)
    short.update(memoryview(data)[:-1])
    with pytest.raises(ChunkError, match="payload of"):
        short.verdict()
    changed = BodyCheck(head, key=KEY, namespace=NS, mac_key=MAC_KEY)
    changed.update(memoryview(bytes([data[0] ^ 1]) + data[1:]))
    with pytest.raises(ChunkError, match="MAC mismatch"):
        changed.verdict()


@pytest.mark.parametrize("offset", [0, 4, 8, 30, 45, 60, 75, 85, 90, 97, 100, 110, 250, HEADER_BYTES + 5, -1])
def test_any_flipped_byte_is_detected(offset):
    obj = encode(meta(), payload(meta()), MAC_KEY)
    obj[offset] ^= 0x40
    with pytest.raises(ChunkError):
        decode(obj, key=KEY, namespace=NS, mac_key=MAC_KEY)


def test_truncated_object_is_detected():
    obj = encode(meta(), payload(meta()), MAC_KEY)
    with pytest.raises(ChunkError, match="truncated"):
        decode(obj[:-1], key=KEY, namespace=NS, mac_key=MAC_KEY)
    with pytest.raises(ChunkError, match="truncated inside its tokens"):
        decode(obj[: HEADER_BYTES + 10], key=KEY, namespace=NS, mac_key=MAC_KEY)
    with pytest.raises(ChunkError, match="shorter than a header"):
        decode(obj[:100], key=KEY, namespace=NS, mac_key=MAC_KEY)


def test_a_valid_object_of_another_chunk_or_namespace_is_refused():
    obj = encode(meta(), payload(meta()), MAC_KEY)
    with pytest.raises(ChunkError, match="not " + ("aa" * 16)):
        decode(obj, key=b"\xaa" * 16, namespace=NS, mac_key=MAC_KEY)
    with pytest.raises(ChunkError, match="namespace"):
        decode(obj, key=KEY, namespace=b"x" * 16, mac_key=MAC_KEY)


def test_bad_meta_and_payload_are_rejected_when_encoding():
    with pytest.raises(ValueError, match="unsupported dtype"):
        meta(dtype="complex64")
    with pytest.raises(ValueError, match="dimensions"):
        meta(shape=())
    with pytest.raises(ValueError, match="whole uint32 token"):
        meta(tokens=b"abc")
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        encode(meta(), b"abc", MAC_KEY)


def scattered(obj: bytearray, m: ChunkMeta, cuts: list[int]) -> tuple[memoryview, list[memoryview]]:
    """The object as a head (header and tokens) and its payload cut at ``cuts``, each piece in its own buffer."""
    payload = bytes(obj[m.payload_offset : m.encoded_size])
    bounds = [0, *cuts, len(payload)]
    return memoryview(bytearray(obj[: m.payload_offset])), [
        memoryview(bytearray(payload[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)
    ]


def test_a_chunk_read_in_pieces_verifies_as_one_object():
    m = meta()
    obj = encode(m, payload(m), MAC_KEY)
    head, pieces = scattered(obj, m, [1, 4096, 70000, 200000])
    assert decode_scattered(head, pieces, key=KEY, namespace=NS, mac_key=MAC_KEY) == m


@pytest.mark.parametrize("piece", [0, 2, 4])
def test_a_flipped_byte_in_any_piece_is_detected(piece):
    m = meta()
    head, pieces = scattered(encode(m, payload(m), MAC_KEY), m, [1, 4096, 70000, 200000])
    pieces[piece][-1] ^= 0x01
    with pytest.raises(ChunkError, match="MAC mismatch"):
        decode_scattered(head, pieces, key=KEY, namespace=NS, mac_key=MAC_KEY)


def test_pieces_that_do_not_add_up_to_the_payload_are_refused():
    m = meta()
    head, pieces = scattered(encode(m, payload(m), MAC_KEY), m, [4096])
    with pytest.raises(ChunkError, match="pieces hold"):
        decode_scattered(head, pieces[:1], key=KEY, namespace=NS, mac_key=MAC_KEY)
    with pytest.raises(ChunkError, match="not " + ("aa" * 16)):
        decode_scattered(head, pieces, key=b"\xaa" * 16, namespace=NS, mac_key=MAC_KEY)


def test_an_object_signed_with_another_key_is_refused_as_a_mac_failure():
    m = meta()
    obj = encode(m, payload(m), OTHER_KEY)
    assert read_meta(obj) == m  # the header is consistent: only the MAC tells
    with pytest.raises(ChunkError, match="MAC mismatch") as refused:
        decode(obj, key=KEY, namespace=NS, mac_key=MAC_KEY)
    assert refused.value.reason == "mac"


def forge_payload(obj: bytearray, m: ChunkMeta) -> None:
    obj[m.payload_offset :] = bytes(m.payload_bytes)


def forge_tenant(obj: bytearray, m: ChunkMeta) -> None:
    struct.pack_into("<Q", obj, 72, 8)


@pytest.mark.parametrize("forge", [forge_payload, forge_tenant], ids=["payload", "tenant-field"])
def test_a_forgery_with_a_valid_header_and_header_checksum_fails_the_mac(forge):
    """An attacker who can write the pool rewrites a payload or a header field and makes the header consistent
    again (its checksum recomputed): only the MAC tells."""
    m = meta()
    obj = encode(m, payload(m), MAC_KEY)
    forge(obj, m)
    struct.pack_into("<Q", obj, 248, xxhash.xxh3_64_intdigest(bytes(obj[:248])))
    read_meta(obj)  # consistent
    with pytest.raises(ChunkError, match="MAC mismatch") as refused:
        decode(obj, key=KEY, namespace=NS, mac_key=MAC_KEY)
    assert refused.value.reason == "mac"


def test_an_object_of_an_earlier_format_version_is_refused():
    m = meta()
    obj = encode(m, payload(m), MAC_KEY)
    struct.pack_into("<H", obj, 4, 2)
    struct.pack_into("<Q", obj, 248, xxhash.xxh3_64_intdigest(bytes(obj[:248])))
    with pytest.raises(ChunkError, match="unsupported chunk format version 2") as refused:
        decode(obj, key=KEY, namespace=NS, mac_key=MAC_KEY)
    assert refused.value.reason == "damaged"


def test_a_damaged_header_is_refused_as_damaged_before_the_payload_is_read():
    obj = encode(meta(), payload(meta()), MAC_KEY)
    obj[30] ^= 0x01
    with pytest.raises(ChunkError, match="header checksum") as refused:
        read_meta(obj)
    assert refused.value.reason == "damaged"


def test_a_key_file_of_the_wrong_length_or_not_hex_is_refused(tmp_path):
    for text in ("abcd", "zz" * 32):
        path = tmp_path / "key"
        path.write_text(text)
        with pytest.raises(ConfigError, match="64 hex digits"):
            ChunkMacKey.read(path)
    assert "secret" in repr(MAC_KEY) and "00010203" not in repr(MAC_KEY)
