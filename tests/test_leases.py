"""Leases against a real redis-server: granted, held until they expire, never shortened."""

from __future__ import annotations

import itertools

import pytest
import redis

from cachestore.processes import free_port
from indexer.errors import IndexUnavailableError
from indexer.leases import Leases

_prefixes = itertools.count()
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


@pytest.fixture
def leases(redis_server) -> Leases:
    return Leases(redis.Redis.from_url(redis_server.url), f"lease{next(_prefixes)}")


def test_a_lease_is_held_until_it_expires(leases):
    leases.grant([A, B], ttl_s=30, now=1000)
    assert leases.held([A, B, C], now=1010) == [True, True, False]
    assert leases.held([A, B], now=1031) == [False, False]


def test_a_shorter_grant_never_cuts_a_longer_lease(leases):
    leases.grant([A], ttl_s=60, now=1000)
    leases.grant([A, B], ttl_s=10, now=1000)
    assert leases.held([A, B], now=1030) == [True, False]


def test_granting_drops_expired_leases(leases, redis_server):
    leases.grant([A], ttl_s=1, now=1000)
    leases.grant([B], ttl_s=30, now=2000)
    members = redis.Redis.from_url(redis_server.url).zrange(leases._key, 0, -1)
    assert members == [B]


def test_an_unreachable_redis_is_an_index_error():
    dead = Leases(redis.Redis(port=free_port(), socket_connect_timeout=0.2), "x")
    with pytest.raises(IndexUnavailableError):
        dead.grant([A])
    with pytest.raises(IndexUnavailableError):
        dead.held([A])
