"""What only the Redis backend can get wrong: reachability, URLs, one round trip, restart."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from prefixcache.cachestore.host.processes import free_port
from prefixcache.cachestore.node.redis_server import EmbeddedRedis
from prefixcache.indexer.chunking import ChunkGeometry
from prefixcache.indexer.errors import ConfigError, IndexUnavailableError
from prefixcache.indexer.index import Location, attach_namespace
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.redis_clients import redact_url
from prefixcache.indexer.redis_index import RedisIndex
from tests.test_index import publish


def test_unreachable_redis_is_a_clear_error_that_hides_the_password():
    index = RedisIndex(f"redis://:hunter2@127.0.0.1:{free_port()}/0", connect_timeout_s=0.2)
    with pytest.raises(IndexUnavailableError, match="unreachable") as info:
        index.ping()
    assert "hunter2" not in str(info.value)


def test_lookup_on_unreachable_redis_raises_quickly(spec):
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.2)
    with pytest.raises(IndexUnavailableError):
        index.lookup(prompt_query(spec.root(), ChunkGeometry(64), list(range(100))))


@pytest.mark.parametrize(("url", "message"), [("http://x:1", "must start with redis://, rediss"), ("", "must start")])
def test_bad_urls_and_prefixes(url, message):
    with pytest.raises(ConfigError, match=message):
        RedisIndex(url)
    with pytest.raises(ConfigError, match="key_prefix"):
        RedisIndex("redis://127.0.0.1:1/0", key_prefix="a b")


def test_redact_url():
    assert redact_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_lookup_is_one_round_trip(redis_index, spec, geometry, request):
    publish(redis_index, spec, list(range(64 * 40)))
    query = prompt_query(spec.root(), geometry, list(range(64 * 40 + 10)))
    redis_index.lookup(query)  # loads the script
    redis_index.flush_access()
    sent = request.getfixturevalue("sent_commands")
    match = redis_index.lookup(query)
    assert match.matched_tokens == 64 * 40
    assert len(sent) == 1
    redis_index.flush_access()  # the hits' statistics follow in a batch of their own
    assert len(sent) == 2
    assert redis_index.get(match.keys[:1])[0].hits == 2


def test_index_survives_a_redis_restart_with_aof(tmp_path, spec, geometry):
    server = EmbeddedRedis(tmp_path / "r", admin=True)
    server.start()
    index = RedisIndex(server.url)
    keys = publish(index, spec, list(range(128)))
    with redis.Redis.from_url(server.admin_url) as admin:  # clients may not: it is one of Redis's @dangerous
        admin.execute_command("BGREWRITEAOF")
    server.stop()
    with pytest.raises(IndexUnavailableError):
        index.ping()
    restarted = EmbeddedRedis(tmp_path / "r", port=server.port, password=server.password)
    restarted.start()
    try:
        # scripts are gone after a restart; redis-py reloads them on NOSCRIPT
        assert index.lookup(prompt_query(spec.root(), geometry, list(range(128)))).keys == keys
    finally:
        index.close()
        restarted.stop()


def test_unacknowledged_feed_events_are_delivered_again_after_a_restart(redis_index, spec):
    keys = publish(redis_index, spec, list(range(128)))
    first = redis_index.read_feed("node-a", "persist", "daemon")
    assert [e.key for e in first] == keys
    redis_index.ack_feed("node-a", "persist", [first[0].id])
    restarted = RedisIndex(redis_index.url, key_prefix=redis_index.keyspace.name)
    try:
        assert [e.key for e in restarted.read_feed("node-a", "persist", "daemon")] == keys[1:]
        assert restarted.read_feed("node-a", "persist", "daemon") == []
    finally:
        restarted.close()


def test_feed_events_trimmed_before_they_were_acknowledged_are_skipped_and_acknowledged(redis_index, spec):
    """The feed is capped (``MAXLEN ~``): events a consumer read but had not acknowledged may be trimmed before it
    replays them, and Redis then answers their ids without fields. They are skipped and acknowledged (what they asked
    for is not done), and the events after them are delivered."""
    keys = publish(redis_index, spec, list(range(128)))
    assert [e.key for e in redis_index.read_feed("node-a", "persist", "daemon")] == keys
    stream = Keyspace.feed(redis_index.keyspace.root, "node-a")
    with redis.Redis.from_url(redis_index.url) as raw:
        raw.xtrim(stream, maxlen=0)
        later = publish(redis_index, spec, list(range(1000, 1064)))
        restarted = RedisIndex(redis_index.url, key_prefix=redis_index.keyspace.name)
        try:
            assert [e.key for e in restarted.read_feed("node-a", "persist", "daemon")] == later
            assert raw.xpending(stream, "persist")["pending"] == 1  # the trimmed ones acknowledged: the later one left
        finally:
            restarted.close()


def test_times_written_are_redis_clock_not_the_clients(redis_index, spec, geometry, monkeypatch):
    """A client whose clock runs an hour ahead writes creation, last-access and location times in Redis's
    clock, so other nodes' ages and LRU order are not thrown off by it."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    keys = publish(redis_index, spec, list(range(128)))
    redis_index.add_location(keys, Location("nvme", "n1"))
    redis_index.lookup(prompt_query(spec.root(), geometry, list(range(128))))
    redis_index.flush_access()
    redis_now = redis_index.clock_s()
    assert abs(redis_now - real()) < 5
    entry = redis_index.get(keys[:1])[0]
    assert abs(entry.created_s - redis_now) < 5 and abs(entry.last_access_s - redis_now) < 5
    assert entry.hits == 1
    added = redis.Redis.from_url(redis_index.url).hget(
        Keyspace.entry(redis_index.keyspace.root, keys[0].hex()), "l:nvme@n1"
    )
    assert abs(int(added) / 1000 - redis_now) < 5


def test_records_another_version_wrote_are_skipped_and_logged_once(redis_index, spec, caplog):
    """Namespace descriptions and entries this version cannot read are left out: the namespace is not listed,
    the entry misses, and each is logged the first time only; the client's own namespace still attaches."""
    raw = redis.Redis.from_url(redis_index.url)
    raw.hset(redis_index.keyspace.namespaces, mapping={"ab" * 16: '{"future": {"field": 1}}', "cd" * 16: "{not json"})
    keys = publish(redis_index, spec, list(range(128)))
    raw.hset(Keyspace.entry(redis_index.keyspace.root, keys[1].hex()), "ntok", "sixty-four")
    with caplog.at_level(logging.WARNING, logger="prefixcache.index"):
        assert attach_namespace(redis_index, spec).known is False
        assert [s.digest for s in redis_index.namespaces()] == [spec.digest]
        assert [e is not None for e in redis_index.get(keys)] == [True, False]
        assert [e.key for e in redis_index.scan()] == [keys[0]]
        assert [e.key for e in redis_index.page(None, 10)] == [keys[0]]
    skipped = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(skipped) == 3  # two namespaces, one entry: once each
