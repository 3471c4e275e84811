"""The typed readers of redis-py replies: bytes pass as what the caller reads, anything a decoding client or another
command would answer is refused."""

from __future__ import annotations

import pytest

from prefixcache.indexer.redis_replies import raw, raw_hash, raw_list, stream_messages, text


def test_string_replies_are_bytes():
    assert raw(b"pc:ns") == b"pc:ns"
    assert text(b"node-1") == "node-1"
    assert text(b"\xff", errors="replace") == "\ufffd"
    with pytest.raises(TypeError, match="does not decode"):
        raw("pc:ns")
    with pytest.raises(TypeError):
        text(None)


def test_list_and_hash_replies():
    assert raw_list(None) == []
    assert raw_list([b"a", b"b"]) == [b"a", b"b"]
    assert raw_hash({b"op": b"add"}) == {b"op": b"add"}
    with pytest.raises(TypeError):
        raw_list(b"a")
    with pytest.raises(TypeError):
        raw_hash({"op": b"add"})


def test_stream_messages_of_one_stream():
    fields = {b"op": b"add", b"tier": b"dram", b"key": b"00"}
    assert stream_messages([[b"pc:f:n1", [(b"1-0", fields), (b"2-0", fields)]]]) == [
        (b"1-0", fields),
        (b"2-0", fields),
    ]
    assert stream_messages(None) == [] and stream_messages([]) == []
    with pytest.raises(TypeError):
        stream_messages({b"pc:f:n1": []})
