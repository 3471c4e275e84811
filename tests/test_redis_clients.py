"""Redis connections carry the timeouts they are made with, whatever redis-py's defaults."""

import pytest

from prefixcache.indexer.errors import ConfigError
from prefixcache.indexer.redis_clients import CONNECT_TIMEOUT_S, SOCKET_TIMEOUT_S, redis_client


def test_a_client_carries_explicit_socket_and_connect_timeouts():
    options = redis_client("redis://127.0.0.1:1/0").connection_pool.connection_kwargs
    assert (options["socket_timeout"], options["socket_connect_timeout"]) == (SOCKET_TIMEOUT_S, CONNECT_TIMEOUT_S)
    client = redis_client("unix:///tmp/r.sock", socket_timeout_s=7, connect_timeout_s=0.5)
    options = client.connection_pool.connection_kwargs
    assert (options["socket_timeout"], options["socket_connect_timeout"]) == (7, 0.5)


@pytest.mark.parametrize("url", ["http://host:6379", "redis://:bad-port"])
def test_a_url_that_names_no_redis_is_a_config_error(url):
    with pytest.raises(ConfigError):
        redis_client(url)
