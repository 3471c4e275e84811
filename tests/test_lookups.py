"""Lookups of requests added together are made together (connector/lookups.py), on a real Redis index; the
scheduler's view of the index they are made through (cachestore/client/scheduler_index.py)."""

from __future__ import annotations

import itertools

import pytest

from benchmarks.lookup import RoundTripCounter
from prefixcache.cachestore.client.client_stats import read_client_stats
from prefixcache.cachestore.client.config import ClientConfig, MooncakeConfig
from prefixcache.cachestore.client.scheduler_index import SchedulerIndex
from prefixcache.cachestore.host.processes import free_port
from prefixcache.connector.lookups import BatchedLookups
from prefixcache.indexer.errors import IndexUnavailableError
from prefixcache.indexer.keys import prompt_query
from prefixcache.indexer.keyspace import Keyspace
from prefixcache.indexer.leases import Leases
from prefixcache.indexer.redis_clients import redis_client
from prefixcache.indexer.redis_index import RedisIndex
from tests.test_index import publish

_prefixes = itertools.count()


def prompt(seed: int, tokens: int = 64 * 5 + 10) -> list[int]:
    return [seed * 100_000 + i for i in range(tokens)]


def queries(spec, geometry, tokens):
    return [prompt_query(spec.root(), geometry, tokens)]


def test_requests_added_together_are_looked_up_in_one_round_trip_each_with_its_own_match(redis_index, spec, geometry):
    cached = {seed: 64 * seed for seed in (1, 2, 3)}  # request seed -> tokens the index holds of it
    for seed, tokens in cached.items():
        publish(redis_index, spec, prompt(seed)[:tokens])
    redis_index.lookup(queries(spec, geometry, prompt(9))[0])  # loads the script
    lookups = BatchedLookups(redis_index)
    for seed in cached:
        lookups.note(f"r{seed}", len(prompt(seed)), queries(spec, geometry, prompt(seed)))
    with RoundTripCounter() as trips:
        found = {
            seed: lookups.matches(f"r{seed}", len(prompt(seed)), lambda: pytest.fail("noted already"))
            for seed in cached
        }
    assert trips.count == 1
    assert {seed: matches[0].matched_tokens for seed, (matches, _) in found.items()} == cached
    assert all(seconds > 0 for _, seconds in found.values())


def test_a_request_vllm_reaches_in_a_later_pass_is_looked_up_again_and_sees_what_was_published_meanwhile(
    redis_index, spec, geometry
):
    lookups = BatchedLookups(redis_index)
    for seed in (1, 2):
        lookups.note(f"r{seed}", len(prompt(seed)), queries(spec, geometry, prompt(seed)))
    (first,), _ = lookups.matches("r1", len(prompt(1)), lambda: pytest.fail("noted already"))
    assert first.matched_tokens == 0
    publish(redis_index, spec, prompt(2)[:128])  # the first request computed it and published it
    lookups.new_pass()
    asked = []
    (second,), _ = lookups.matches("r2", len(prompt(2)), lambda: asked.append(1) or queries(spec, geometry, prompt(2)))
    assert (second.matched_tokens, asked) == (128, [1])


def test_only_the_lookups_taken_count_as_hits_of_their_chunks(redis_index, spec, geometry):
    keys = publish(redis_index, spec, prompt(1)[:128])
    lookups = BatchedLookups(redis_index)
    for name in ("r1", "r2"):  # the same prompt twice
        lookups.note(name, len(prompt(1)), queries(spec, geometry, prompt(1)))
    lookups.matches("r1", len(prompt(1)), lambda: pytest.fail("noted already"))
    lookups.new_pass()  # vLLM did not reach r2 in that pass: it looks it up again in the next
    lookups.matches("r2", len(prompt(1)), lambda: queries(spec, geometry, prompt(1)))
    redis_index.flush_access()
    assert [entry.hits for entry in redis_index.get(keys)] == [2, 2]


def test_a_request_longer_than_when_it_was_noted_is_looked_up_at_its_length(redis_index, spec, geometry):
    tokens = prompt(1)
    publish(redis_index, spec, tokens[:320])
    lookups = BatchedLookups(redis_index)
    lookups.note("r1", 64, queries(spec, geometry, tokens[:64]))
    (match,), _ = lookups.matches("r1", len(tokens), lambda: queries(spec, geometry, tokens))
    assert match.matched_tokens == 320


def test_a_call_takes_at_most_max_batch_requests_and_none_that_finished(redis_index, spec, geometry):
    redis_index.lookup(queries(spec, geometry, prompt(9))[0])
    lookups = BatchedLookups(redis_index, max_batch=2)
    for seed in range(1, 6):
        lookups.note(f"r{seed}", len(prompt(seed)), queries(spec, geometry, prompt(seed)))
    lookups.forget("r2")
    with RoundTripCounter() as trips:
        for seed in (1, 3, 4, 5):
            lookups.matches(f"r{seed}", len(prompt(seed)), lambda: pytest.fail("noted already"))
    assert trips.count == 2  # r1 with r3, then r4 with r5


def test_when_the_index_is_down_each_request_gets_the_error_when_vllm_asks_about_it(spec, geometry):
    index = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", connect_timeout_s=0.2)
    lookups = BatchedLookups(index)
    for seed in (1, 2):
        lookups.note(f"r{seed}", len(prompt(seed)), queries(spec, geometry, prompt(seed)))
    with pytest.raises(IndexUnavailableError):
        lookups.matches("r1", len(prompt(1)), lambda: pytest.fail("noted already"))
    asked = []  # the second was in the failed call: it is looked up on its own, and fails on its own
    with pytest.raises(IndexUnavailableError):
        lookups.matches("r2", len(prompt(2)), lambda: asked.append(1) or queries(spec, geometry, prompt(2)))
    assert asked == [1]


def test_max_batch_must_be_positive(redis_index):
    with pytest.raises(ValueError, match="at least 1"):
        BatchedLookups(redis_index, max_batch=0)


def client_config(redis_url: str, key_prefix: str, chunk_tokens: int) -> ClientConfig:
    """What a daemon at ``redis_url`` would answer a client (its Mooncake left out: a scheduler needs none)."""
    mooncake = MooncakeConfig(
        master="m:1", metadata_url="http://m", protocol="tcp", device_names="", shm_address="s:1", segment="g:1"
    )
    return ClientConfig(
        node="n1",
        redis_url=redis_url,
        redis_password_required=False,
        key_prefix=key_prefix,
        chunk_tokens=chunk_tokens,
        mooncake=mooncake,
    )


def test_a_scheduler_index_registers_its_namespaces_and_leases_and_records_through_the_index(redis_server, spec):
    prefix = f"sched{next(_prefixes)}"
    scheduler = SchedulerIndex.attach(client_config(redis_server.url, prefix, spec.chunk_tokens), spec.shards())
    try:
        assert [ns.digest for ns in scheduler.index.namespaces()] == [spec.digest]
        scheduler.leases.grant([b"k" * 16])
        scheduler.recorder.record_lookup(spec.digest, requested_tokens=100, matched_tokens=64, seconds=0.001)
        scheduler.recorder.flush()
        connection = redis_client(redis_server.url)
        assert Leases(connection, Keyspace(prefix)).held([b"k" * 16, b"j" * 16]) == [True, False]
        counters = read_client_stats(connection, Keyspace(prefix), "n1")[spec.digest].counters
        assert (counters["lookups"], counters["hits"], counters["matched_tokens"]) == (1, 1, 64)
    finally:
        scheduler.close()


def test_a_scheduler_index_that_cannot_reach_redis_raises(spec):
    config = client_config(f"redis://127.0.0.1:{free_port()}/0", "down", spec.chunk_tokens)
    with pytest.raises(IndexUnavailableError):
        SchedulerIndex.attach(config, [spec])
