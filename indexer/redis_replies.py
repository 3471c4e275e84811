"""Typed readers of redis-py replies.

redis-py's stubs type every reply as ``bytes | str`` (or the union of every shape a command can answer), since they
cannot know how a client was made. prefixcache's clients never decode (``redis_clients.redis_client``), so every
string they answer is ``bytes``: these functions check that and hand mypy the type the caller reads. A ``str``
would mean a decoding client, a programming error: they raise ``TypeError`` rather than read it.
"""

from __future__ import annotations

from redis.typing import EncodableT

#: One argument of a Lua script call (``Script(args=...)``) or of a command.
ScriptArg = EncodableT


def raw(reply: object) -> bytes:
    """A string reply, as the bytes a client that does not decode answers."""
    if isinstance(reply, bytes):
        return reply
    raise TypeError(f"expected a bytes reply from a client that does not decode, got {type(reply).__name__}")


def text(reply: object, errors: str = "strict") -> str:
    """A string reply decoded from UTF-8 (``errors`` as ``bytes.decode``'s)."""
    return raw(reply).decode(errors=errors)


def raw_list(reply: object) -> list[bytes]:
    """A reply of several strings (``LPOP`` with a count); ``None`` (nothing there) is none."""
    if reply is None:
        return []
    if not isinstance(reply, list):
        raise TypeError(f"expected a list reply, got {type(reply).__name__}")
    return [raw(item) for item in reply]


def raw_hash(reply: object) -> dict[bytes, bytes]:
    """A hash reply (``HGETALL``, a stream entry's fields)."""
    if not isinstance(reply, dict):
        raise TypeError(f"expected a hash reply, got {type(reply).__name__}")
    return {raw(field): raw(value) for field, value in reply.items()}


def stream_messages(reply: object) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The messages of an ``XREADGROUP`` (or ``XREAD``) reply for one stream, as (id, fields); none when it timed
    out or the stream had none. A pending message replayed after it was trimmed from the stream has no fields."""
    if not reply:
        return []
    if not isinstance(reply, list):
        raise TypeError(f"expected a list of streams, got {type(reply).__name__}")
    _stream, messages = reply[0]
    return [(raw(message_id), raw_hash(fields)) for message_id, fields in messages]
