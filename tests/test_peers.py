"""The cluster's table of which nodes answer (indexer/peers.py), on a real Redis and a real Redis Cluster, and the
table's arithmetic."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest

from prefixcache.cachestore.client.node_requests import PromotionStream
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.peers import PeerRegistry, PeerTable, PeerView
from prefixcache.indexer.redis_clients import redis_client
from tests.daemon_harness import wait_for

_prefixes = itertools.count()


@pytest.fixture(params=["redis", "cluster"])
def registry(request: pytest.FixtureRequest) -> Iterator[PeerRegistry]:
    server = request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")
    client = redis_client(server.url)
    keys = Keyspace(f"peers{next(_prefixes)}")
    yield PeerRegistry(client, keys)
    client.delete(keys.peers)
    client.close()


def test_a_table_says_who_is_alive_lapsed_suspect_and_stopped():
    table = PeerTable(
        now_ms=10_000,
        beats={"a": 10_500, "b": 9_000, "c": 11_000, "d": 9_500},
        suspects={"c": 12_000, "a": 9_999},
        left=frozenset({"d"}),
    )
    assert table.alive == {"a"}
    assert table.lapsed == {"b", "d"}
    assert table.suspect == {"c"}
    assert table.down == {"b", "c", "d"}


def test_a_beating_node_is_alive_until_its_heartbeat_lapses(registry):
    registry.beat("a", ttl_s=0.3)
    registry.beat("b", ttl_s=60)
    assert registry.read().alive == {"a", "b"}
    assert wait_for(lambda: registry.read().lapsed == {"a"}, timeout_s=5)
    registry.beat("a", ttl_s=60)
    assert registry.read().down == frozenset()


def test_a_node_that_leaves_is_down_at_once_and_alive_again_when_it_beats(registry):
    registry.beat("a", ttl_s=60)
    registry.leave("a")
    table = registry.read()
    assert table.down == {"a"} and table.left == {"a"}
    registry.beat("a", ttl_s=60)
    table = registry.read()
    assert table.alive == {"a"} and table.left == frozenset()


def test_a_suspect_mark_holds_for_its_time_and_a_longer_one_is_kept(registry):
    registry.beat("a", ttl_s=60)
    registry.suspect("a", for_s=60)
    registry.suspect("a", for_s=0.2)  # shorter: the mark of 60 s stays
    assert registry.read().suspect == {"a"}
    registry.beat("b", ttl_s=60)
    registry.suspect("b", for_s=0.2)
    assert wait_for(lambda: registry.read().suspect == {"a"}, timeout_s=5)


def lasts_s(registry: PeerRegistry, node: str) -> float:
    """How long the mark on ``node`` still holds."""
    table = registry.read()
    return (table.suspects[node] - table.now_ms) / 1000


def test_marks_in_a_row_grow_until_one_lapses_long_enough_or_the_node_is_back_from_a_loss(registry):
    registry.beat("a", ttl_s=60)
    registry.suspect("a", for_s=0.2, longest_s=0.7, forgive_s=5)
    assert 0.1 < lasts_s(registry, "a") <= 0.2
    registry.suspect("a", for_s=0.2, longest_s=0.7, forgive_s=5)  # the mark holds: kept as it is
    assert lasts_s(registry, "a") <= 0.2
    assert wait_for(lambda: not registry.read().suspect, timeout_s=5)
    registry.suspect("a", for_s=0.2, longest_s=0.7, forgive_s=5)  # the next in a row: twice as long
    assert 0.3 < lasts_s(registry, "a") <= 0.4
    assert wait_for(lambda: not registry.read().suspect, timeout_s=5)
    registry.suspect("a", for_s=0.2, longest_s=0.7, forgive_s=5)  # and no longer than the longest
    assert 0.6 < lasts_s(registry, "a") <= 0.7
    assert wait_for(lambda: not registry.read().suspect, timeout_s=5)
    time.sleep(0.1)
    registry.suspect("a", for_s=0.2, longest_s=0.7, forgive_s=0.05)  # the last lapsed over forgive_s ago: afresh
    assert lasts_s(registry, "a") <= 0.2

    registry.beat("b", ttl_s=0.1)
    registry.suspect("b", for_s=0.1)
    assert wait_for(lambda: not registry.read().suspect, timeout_s=5)
    registry.suspect("b", for_s=60)  # the second in a row: 120 s, at most 80 s by default
    registry.beat("b", ttl_s=60, back_after_s=60)  # its heartbeat lapsed only briefly: the mark holds
    assert registry.read().suspect == {"b"}
    registry.beat("b", ttl_s=0.05)
    time.sleep(0.3)
    registry.beat("b", ttl_s=60, back_after_s=0.2)  # back after a lapse of back_after_s: read from at once, afresh
    assert registry.read().down == frozenset()
    registry.suspect("b", for_s=0.2)
    assert lasts_s(registry, "b") <= 0.2


def test_a_view_skips_the_down_nodes_but_never_its_own(registry):
    registry.beat("self", ttl_s=0.1)  # lapses at once: a view never avoids its own node
    registry.beat("a", ttl_s=60)
    registry.leave("b")
    view = PeerView(registry, "self", refresh_s=0.05).start()
    try:
        assert wait_for(lambda: view.down == {"b"}, timeout_s=5)
        view.suspect("a", for_s=60)
        assert view.down == {"a", "b"}  # at once here, without waiting for the table
        assert registry.read().suspect == {"a"}  # and for every other client
        view.suspect("self")
        assert "self" not in view.down and "self" not in registry.read().suspect
        registry.beat("b", ttl_s=60)
        assert wait_for(lambda: view.down == {"a"}, timeout_s=5)
    finally:
        view.close()


def test_a_view_that_cannot_read_the_table_for_long_avoids_no_one(registry):
    registry.leave("b")
    view = PeerView(registry, "self", refresh_s=60, stale_s=0.2).start()
    try:
        assert view.down == {"b"}
        assert wait_for(lambda: view.down == frozenset(), timeout_s=5)
    finally:
        view.close()


def test_a_view_knows_when_its_node_is_alone(registry):
    registry.beat("self", ttl_s=60)
    view = PeerView(registry, "self", refresh_s=0.05).start()
    try:
        assert view.alone  # every copy a lookup finds is its own: lookups need not say which lie elsewhere
        registry.beat("a", ttl_s=60)
        assert wait_for(lambda: not view.alone, timeout_s=5)
    finally:
        view.close()


def test_a_promotion_wait_ends_once_the_node_is_found_down(redis_server):
    """A node lost just after it was asked costs the time it takes to be known lost, not the promotion's timeout."""
    client = redis_client(redis_server.url)
    try:
        stream = PromotionStream(client, Keyspace(f"peers{next(_prefixes)}"), "lost-node", [b"k" * 16], timeout_s=30)
        started = time.monotonic()
        assert stream.wait([b"k" * 16], gone=lambda: time.monotonic() - started > 0.5) == [False]
        assert time.monotonic() - started < 10 and not stream.heard
    finally:
        client.close()
