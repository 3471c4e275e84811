"""Leases against a real redis-server: granted, held until they expire, never shortened, timed by Redis."""

from __future__ import annotations

import itertools
import time

import pytest
import redis

from prefixcache.cachestore.host.processes import free_port
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.redis_clients import redis_client

_prefixes = itertools.count()
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


@pytest.fixture
def leases(redis_server) -> Leases:
    return Leases(redis_client(redis_server.url), Keyspace(f"lease{next(_prefixes)}"))


def lease_set(leases: Leases) -> str:
    """The sorted set of a standalone Redis's leases."""
    (shard,) = leases._shards.all()
    return Keyspace.lease(shard.shared)


def test_a_lease_is_held_until_it_expires(leases):
    leases.grant([A, B], ttl_s=0.5)
    assert leases.held([A, B, C]) == [True, True, False]
    time.sleep(0.6)
    assert leases.held([A, B]) == [False, False]


def test_a_shorter_grant_never_cuts_a_longer_lease(leases):
    leases.grant([A], ttl_s=60)
    leases.grant([A, B], ttl_s=0.2)
    time.sleep(0.3)
    assert leases.held([A, B]) == [True, False]


def test_granting_drops_expired_leases(leases, redis_server):
    leases.grant([A], ttl_s=0.1)
    time.sleep(0.2)
    leases.grant([B], ttl_s=30)
    members = redis.Redis.from_url(redis_server.url).zrange(lease_set(leases), 0, -1)
    assert members == [B]


def test_a_client_whose_clock_runs_ahead_keeps_other_clients_leases(leases, redis_server, monkeypatch):
    """Expiry is Redis's clock: a scheduler an hour ahead neither drops another engine's lease nor holds its own
    an hour longer."""
    other = Leases(redis_client(redis_server.url), leases._shards.keyspace)
    other.grant([A], ttl_s=30)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)
    leases.grant([B], ttl_s=30)
    assert leases.held([A, B]) == [True, True]
    expiries = redis.Redis.from_url(redis_server.url).zmscore(lease_set(leases), [A, B])
    assert all(abs(expiry - 30 - real()) < 5 for expiry in expiries)


def test_an_unreachable_redis_is_an_index_error():
    dead = Leases(redis_client(f"redis://127.0.0.1:{free_port()}", connect_timeout_s=0.2), Keyspace("x"))
    with pytest.raises(IndexUnavailableError):
        dead.grant([A])
    with pytest.raises(IndexUnavailableError):
        dead.held([A])
